"""The packed branch pass: all token trees of all decisions in one sequence after the prompt.

One call feeds `[prompt tokens][tree 1][tree 2]...` with a 4-D additive mask: a prompt token sees the
prompt causally; a tree token sees the whole prompt and its own ancestors in its tree, nothing of other
trees. Position ids restart at `len(prompt)` for every tree, so each branch is computed exactly as if it
followed the prompt alone. When the trees exceed the token budget they are split into microbatches: the
first call also computes the prompt and keeps its KV cache; later calls run on top of that cache, which
is cropped back to the prompt after each call.

The LM head is applied only at the positions whose logits are scored (`logits_to_keep`).
"""

from __future__ import annotations

import inspect
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from pcd_engine.branches import TokenTree
from pcd_engine.cache import PrefixCache


@dataclass
class PassStats:
    forward_calls: int = 0
    fed_tokens: int = 0
    reused_tokens: int = 0


def microbatches(trees: Sequence[TokenTree], first_budget: int, budget: int) -> list[list[int]]:
    """Group tree indices in order; each group's token count fits the budget (one tree at least)."""
    groups: list[list[int]] = [[]]
    used, limit = 0, first_budget
    for i, tree in enumerate(trees):
        n = len(tree.tokens)
        if groups[-1] and used + n > limit:
            groups.append([])
            used, limit = 0, budget
        groups[-1].append(i)
        used += n
    return groups


def pack_inputs(
    prompt_ids: Sequence[int], past_len: int, trees: Sequence[TokenTree], dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, list[int]]:
    """input ids (1, L), position ids (1, L), additive mask (1, 1, L, past+L), tree offsets in L."""
    n_prompt = len(prompt_ids)
    prompt_end = past_len + n_prompt  # every tree position restarts here
    offsets, ids, positions = [], list(prompt_ids), list(range(past_len, prompt_end))
    for tree in trees:
        offsets.append(len(ids))
        ids.extend(tree.tokens)
        positions.extend(prompt_end + d for d in tree.depths)
    length = len(ids)
    allowed = torch.zeros(length, past_len + length, dtype=torch.bool)
    allowed[:n_prompt, :prompt_end] = torch.ones(n_prompt, prompt_end, dtype=torch.bool).tril(past_len)
    allowed[n_prompt:, :prompt_end] = True
    for tree, offset in zip(trees, offsets, strict=True):
        rows = slice(offset, offset + len(tree.tokens))
        cols = slice(past_len + offset, past_len + offset + len(tree.tokens))
        allowed[rows, cols] = tree.ancestors
    mask = torch.zeros(allowed.shape, dtype=dtype).masked_fill_(~allowed, torch.finfo(dtype).min)
    return torch.tensor([ids]), torch.tensor([positions]), mask[None, None], offsets


class BranchRunner:
    """Runs packed branch passes on one Hugging Face causal LM and returns scored log-probs."""

    def __init__(self, model: Any, max_tokens_per_forward: int = 2048) -> None:
        self.model = model
        params = inspect.signature(model.forward).parameters
        self.cache_kw = "cache" if "cache" in params else "past_key_values"  # transformers 5 renamed it
        self._can_slice_logits = "logits_to_keep" in params
        self.max_tokens_per_forward = max_tokens_per_forward

    @property
    def device(self) -> torch.device:
        return next(self.model.parameters()).device

    @property
    def dtype(self) -> torch.dtype:
        return next(self.model.parameters()).dtype

    @torch.inference_mode()
    def run(
        self,
        prompt_ids: Sequence[int],
        trees: Sequence[TokenTree],
        stats: PassStats,
        prefix_cache: PrefixCache | None = None,
        cacheable: int = 0,
    ) -> list[torch.Tensor]:
        """For each tree, float32 log-probs (len(tree.scored), vocab) at its scored positions.

        With a `prefix_cache`, the longest cached prefix of the prompt is reused and, on a miss,
        the KV of the first `cacheable` prompt tokens is stored for later requests.
        """
        cache, past = self.cached_prefix(prompt_ids, stats, prefix_cache, cacheable)
        budget = self.max_tokens_per_forward
        groups = microbatches(trees, max(budget - len(prompt_ids) + past, 1), budget)
        out: list[torch.Tensor] = []
        for number, group in enumerate(groups):
            feed = prompt_ids[past:] if number == 0 else ()
            keep_cache = len(groups) > 1 or cache is not None
            logprobs, cache = self._forward(
                feed, len(prompt_ids) - len(feed), [trees[i] for i in group], cache, keep_cache
            )
            stats.forward_calls += 1
            stats.fed_tokens += len(feed) + sum(len(trees[i].tokens) for i in group)
            out.extend(logprobs)
            if cache is not None:  # drop this group's tree tokens, keep the prompt
                cache.crop(-(cache.get_seq_length() - len(prompt_ids)))
        return out

    def cached_prefix(
        self, prompt_ids: Sequence[int], stats: PassStats, prefix_cache: PrefixCache | None, cacheable: int
    ) -> tuple[Any, int]:
        """(private KV, length) of the longest cached prefix of the prompt; on a miss, the first
        `cacheable` tokens are computed and stored for later requests. (None, 0) without a cache."""
        if prefix_cache is None:
            return None, 0
        cache, past = prefix_cache.lookup(prompt_ids)
        stats.reused_tokens = past
        if past < cacheable:  # first request of this schema: compute and keep the head alone
            cache, past = self._prefill_head(prompt_ids[:cacheable], stats), cacheable
            prefix_cache.store(prompt_ids[:cacheable], cache)
        return cache, past

    @torch.inference_mode()
    def _prefill_head(self, head: Sequence[int], stats: PassStats) -> Any:
        ids = torch.tensor([list(head)], device=self.device)
        output = self.model(input_ids=ids, use_cache=True, **self._head_only())
        stats.forward_calls += 1
        stats.fed_tokens += len(head)
        return output["cache" if "cache" in output else "past_key_values"]

    def _head_only(self) -> dict[str, Any]:
        return {"logits_to_keep": 1} if self._can_slice_logits else {}

    def _forward(
        self,
        prompt_ids: Sequence[int],
        past_len: int,
        trees: Sequence[TokenTree],
        cache: Any,
        keep_cache: bool,
    ) -> tuple[list[torch.Tensor], Any]:
        ids, positions, mask, offsets = pack_inputs(prompt_ids, past_len, trees, self.dtype)
        keep = [offset + i for tree, offset in zip(trees, offsets, strict=True) for i in tree.scored]
        keep_t = torch.tensor(keep, device=self.device)
        kwargs: dict[str, Any] = {
            "input_ids": ids.to(self.device),
            "attention_mask": mask.to(self.device),
            "position_ids": positions.to(self.device),
            "use_cache": keep_cache,
        }
        if cache is not None:
            kwargs[self.cache_kw] = cache
        if self._can_slice_logits:
            kwargs["logits_to_keep"] = keep_t
        output = self.model(**kwargs)
        logits = output.logits[0] if self._can_slice_logits else output.logits[0, keep_t]
        logprobs = torch.log_softmax(logits.float(), dim=-1)
        new_cache = output["cache" if "cache" in output else "past_key_values"] if keep_cache else None
        return list(torch.split(logprobs, [len(t.scored) for t in trees])), new_cache

    @torch.inference_mode()
    def prefill(self, prompt_ids: Sequence[int]) -> torch.Tensor:
        """A bare forward pass over the prompt (the latency floor); returns the last logits."""
        ids = torch.tensor([list(prompt_ids)], device=self.device)
        return self.model(input_ids=ids, use_cache=False, **self._head_only()).logits[0, -1]
