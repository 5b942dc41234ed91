"""The packed branch pass: all token trees of all decisions in one sequence after the prompt.

One call feeds `[prompt tokens][tree 1][tree 2]...` with a 4-D attention mask (built as booleans,
made additive on the model's device): a prompt token sees the
prompt causally; a tree token sees the whole prompt and its own ancestors in its tree, nothing of other
trees. Position ids restart at `len(prompt)` for every tree, so each branch is computed exactly as if it
followed the prompt alone. When the trees exceed the token budget they are split into microbatches: the
first call also computes the prompt and keeps its KV cache; later calls run on top of that cache, which
is cropped back to the prompt after each call.

`run_batch` answers many requests that share the schema's prompt head with padded rows: the head's KV
is computed (or taken from the prefix cache) once and repeated per row; each row is
`[padding][the request's own prompt tokens][tree 1][tree 2]...`, left-padded so that every row's
trees sit at the same offsets. Rows are grouped by length into forward calls of at most
`max_tokens_per_forward` tokens; when CUDA runs out of memory, a group is halved and retried.
(Packing several requests into one long sequence instead would make every query attend over every
other request's keys, all masked: attention work grows with the square of the packed length.)

The LM head is applied only at the positions whose logits are scored, and its output is kept only
for the tokens the trees score (`TokenTree.vocab`). For trees whose rule needs no normaliser, only
those rows of the LM head are computed at all (`normalized=False`).
"""

from __future__ import annotations

import copy
import inspect
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from pcd_engine.branches import TokenTree
from pcd_engine.cache import PrefixCache, frozen_view

# full-vocabulary float32 logits held at once while projecting: small on CPU (memory), large on a GPU
# (each chunk reads the whole LM-head weight, so fewer, larger chunks are faster)
LOGITS_BYTES = {"cpu": 16 * 2**20, "cuda": 512 * 2**20}


@dataclass
class PassStats:
    forward_calls: int = 0
    fed_tokens: int = 0
    reused_tokens: int = 0
    cache_hit: bool | None = None  # None: no prefix cache used


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
    prompt_ids: Sequence[int], past_len: int, trees: Sequence[TokenTree]
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, list[int]]:
    """input ids (1, L), position ids (1, L), boolean mask (1, 1, L, past+L) (True: may attend),
    tree offsets in L."""
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
    return torch.tensor([ids]), torch.tensor([positions]), allowed[None, None], offsets


def pack_rows(
    prompts: Sequence[Sequence[int]], past_len: int, trees: Sequence[TokenTree]
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, list[int]]:
    """`pack_inputs` for several prompts on one shared past: left-padded rows (B, L), positions,
    masks (B, 1, L, past+L) and the tree offsets, the same in every row. A padding token sees only
    itself and no real token sees it."""
    packed = [pack_inputs(p, past_len, trees) for p in prompts]
    width = max(ids.shape[1] for ids, _, _, _ in packed)
    ids_out = torch.zeros(len(prompts), width, dtype=torch.long)
    positions_out = torch.full((len(prompts), width), past_len, dtype=torch.long)
    allowed = torch.zeros(len(prompts), 1, width, past_len + width, dtype=torch.bool)
    for row, (ids, positions, mask, _) in enumerate(packed):
        pad = width - ids.shape[1]
        ids_out[row, pad:], positions_out[row, pad:] = ids[0], positions[0]
        own = mask[0, 0]
        allowed[row, 0, pad:, :past_len] = own[:, :past_len]
        allowed[row, 0, pad:, past_len + pad :] = own[:, past_len:]
        allowed[row, 0, torch.arange(pad), past_len + torch.arange(pad)] = True
    offsets = [o + width - packed[0][0].shape[1] for o in packed[0][3]]
    return ids_out, positions_out, allowed, offsets


def additive_mask(allowed: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The additive form attention adds to its scores: 0 where allowed, the dtype's minimum elsewhere
    (built where `allowed` lives, so on the GPU only a boolean mask crosses from the CPU)."""
    mask = torch.zeros(allowed.shape, dtype=dtype, device=allowed.device)
    return mask.masked_fill_(~allowed, torch.finfo(dtype).min)


def _to_cpu(tensors: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    """The tensors on the CPU, with one device-to-host copy for all of them."""
    if not tensors or tensors[0].device.type == "cpu":
        return list(tensors)
    flat = torch.cat([t.reshape(-1) for t in tensors]).cpu()
    parts = torch.split(flat, [t.numel() for t in tensors])
    return [part.reshape(t.shape) for part, t in zip(parts, tensors, strict=True)]


class BranchRunner:
    """Runs packed branch passes on one Hugging Face causal LM and returns the scored columns.

    Per tree, a float32 tensor (len(tree.scored), len(tree.vocab)): log-probs normalised over the
    whole vocabulary, or, for a tree marked `normalized=False`, plain logits of its tokens only.
    """

    def __init__(self, model: Any, max_tokens_per_forward: int = 2048) -> None:
        self.model = model
        params = inspect.signature(model.forward).parameters
        self.cache_kw = "cache" if "cache" in params else "past_key_values"  # transformers 5 renamed it
        self._can_slice_logits = "logits_to_keep" in params
        self.max_tokens_per_forward = max_tokens_per_forward
        self._head_splits: bool | None = None  # logits == lm_head(decoder output)? checked on first use

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
        normalized: Sequence[bool] | None = None,
    ) -> list[torch.Tensor]:
        """For each tree, its scored columns (see the class) for one prompt.

        With a `prefix_cache`, the longest cached prefix of the prompt is reused and, on a miss,
        the KV of the first `cacheable` prompt tokens is stored for later requests.
        """
        norms = list(normalized) if normalized is not None else [True] * len(trees)
        cache, past = self.cached_prefix(prompt_ids, stats, prefix_cache, cacheable)
        budget = self.max_tokens_per_forward
        groups = microbatches(trees, max(budget - len(prompt_ids) + past, 1), budget)
        out: list[torch.Tensor] = []
        if len(groups) == 1 and cache is not None:  # nothing of this call is needed afterwards
            cache = frozen_view(cache) or cache
        for number, group in enumerate(groups):
            feed = prompt_ids[past:] if number == 0 else ()
            keep_cache = len(groups) > 1 or cache is not None
            chosen = [trees[i] for i in group]
            packed = pack_inputs(feed, len(prompt_ids) - len(feed), chosen)
            (scores,), cache = self._forward(packed, chosen, [norms[i] for i in group], cache, keep_cache)
            stats.forward_calls += 1
            stats.fed_tokens += len(feed) + sum(len(t.tokens) for t in chosen)
            out.extend(scores)
            if cache is not None and len(groups) > 1:  # drop this group's tree tokens, keep the prompt
                cache.crop(-(cache.get_seq_length() - len(prompt_ids)))
        return out

    @torch.inference_mode()
    def run_batch(
        self,
        prompts: Sequence[Sequence[int]],
        trees: Sequence[TokenTree],
        stats: Sequence[PassStats],
        prefix_cache: PrefixCache | None = None,
        cacheable: int = 0,
        normalized: Sequence[bool] | None = None,
    ) -> list[list[torch.Tensor]]:
        """`run` for many prompts that share their first `cacheable` tokens, several per forward call.

        A prompt whose own tokens and trees do not fit the token budget is run alone (`run` splits
        its trees into microbatches).
        """
        norms = list(normalized) if normalized is not None else [True] * len(trees)
        tree_tokens = sum(len(t.tokens) for t in trees)
        budget = self.max_tokens_per_forward
        width = {i: len(p) - cacheable + tree_tokens for i, p in enumerate(prompts)}
        together = sorted((i for i in width if width[i] <= budget), key=width.__getitem__)
        out: dict[int, list[torch.Tensor]] = {}
        for i in width.keys() - set(together):
            out[i] = self.run(prompts[i], trees, stats[i], prefix_cache, cacheable, norms)
        if together and cacheable > 0:
            shared = self._shared_head(prompts[together[0]][:cacheable], stats, together, prefix_cache)
            groups: list[list[int]] = [[]]
            for i in together:  # ascending width: the newcomer is the widest of its group
                if groups[-1] and (len(groups[-1]) + 1) * width[i] > budget:
                    groups.append([])
                groups[-1].append(i)
            for group in groups:
                out.update(self._rows(prompts, group, trees, norms, shared, cacheable, stats))
        elif together:
            for i in together:
                out[i] = self.run(prompts[i], trees, stats[i], prefix_cache, cacheable, norms)
        return [out[i] for i in range(len(prompts))]

    def _shared_head(
        self,
        head: Sequence[int],
        stats: Sequence[PassStats],
        rows: Sequence[int],
        prefix_cache: PrefixCache | None,
    ) -> Any:
        """The KV of the shared head, from the prefix cache or computed once for the whole batch."""
        first = stats[rows[0]]
        if prefix_cache is not None:
            shared, _ = self.cached_prefix(head, first, prefix_cache, len(head))
        else:
            shared = self._prefill_head(head, first)
        for i in rows[1:]:
            stats[i].reused_tokens, stats[i].cache_hit = len(head), first.cache_hit
        return shared

    def _rows(
        self,
        prompts: Sequence[Sequence[int]],
        group: Sequence[int],
        trees: Sequence[TokenTree],
        norms: Sequence[bool],
        shared: Any,
        past: int,
        stats: Sequence[PassStats],
    ) -> dict[int, list[torch.Tensor]]:
        """One forward call for the group's rows; on CUDA out-of-memory, two calls of half as many."""
        cache = frozen_view(shared, len(group))
        if cache is None:  # not a DynamicCache: a real copy, repeated per row
            cache = copy.deepcopy(shared)
            if len(group) > 1:
                cache.batch_repeat_interleave(len(group))
        packed = pack_rows([prompts[i][past:] for i in group], past, trees)
        try:
            scores, _ = self._forward(packed, trees, norms, cache, keep_cache=False)
        except torch.OutOfMemoryError:
            if len(group) == 1:
                raise
            del cache
            torch.cuda.empty_cache()
            half = len(group) // 2
            return {
                **self._rows(prompts, group[:half], trees, norms, shared, past, stats),
                **self._rows(prompts, group[half:], trees, norms, shared, past, stats),
            }
        tree_tokens = sum(len(t.tokens) for t in trees)
        for i in group:
            stats[i].forward_calls += 1
            stats[i].fed_tokens += len(prompts[i]) - past + tree_tokens
        return dict(zip(group, scores, strict=True))

    def cached_prefix(
        self, prompt_ids: Sequence[int], stats: PassStats, prefix_cache: PrefixCache | None, cacheable: int
    ) -> tuple[Any, int]:
        """(private KV, length) of the longest cached prefix of the prompt; on a miss, the first
        `cacheable` tokens are computed and stored for later requests. (None, 0) without a cache."""
        if prefix_cache is None:
            return None, 0
        cache, past = prefix_cache.lookup(prompt_ids)
        stats.reused_tokens = past
        stats.cache_hit = past > 0 and past >= cacheable
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
        packed: tuple[torch.Tensor, torch.Tensor, torch.Tensor, list[int]],
        trees: Sequence[TokenTree],
        normalized: Sequence[bool],
        cache: Any,
        keep_cache: bool,
    ) -> tuple[list[list[torch.Tensor]], Any]:
        """Per row, per tree, the scored columns; and the grown cache when `keep_cache`."""
        ids, positions, mask, offsets = packed
        keep = [offset + i for tree, offset in zip(trees, offsets, strict=True) for i in tree.scored]
        keep_t = torch.tensor(keep, device=self.device)
        kwargs: dict[str, Any] = {
            "input_ids": ids.to(self.device),
            "attention_mask": additive_mask(mask.to(self.device), self.dtype),
            "position_ids": positions.to(self.device),
            "use_cache": keep_cache,
        }
        if cache is not None:
            kwargs[self.cache_kw] = cache
        sizes = [len(t.scored) for t in trees]
        if self._splits_head():
            output = self.model.get_decoder()(**kwargs)
            hidden = output.last_hidden_state[:, keep_t]
            parts = torch.split(hidden, sizes, dim=1)
            per_tree = [self._project(h, t, n) for h, t, n in zip(parts, trees, normalized, strict=True)]
        else:
            if self._can_slice_logits:
                kwargs["logits_to_keep"] = keep_t
            output = self.model(**kwargs)
            logits = output.logits if self._can_slice_logits else output.logits[:, keep_t]
            logprobs = torch.log_softmax(logits.float(), dim=-1)
            parts = torch.split(logprobs, sizes, dim=1)
            per_tree = [p[..., list(t.vocab)] for p, t in zip(parts, trees, strict=True)]
        new_cache = output["cache" if "cache" in output else "past_key_values"] if keep_cache else None
        per_tree = _to_cpu(per_tree)  # small; the rules then index them without device round trips
        rows = [[scores[row] for scores in per_tree] for row in range(ids.shape[0])]
        return rows, new_cache

    def _project(self, hidden: torch.Tensor, tree: TokenTree, normalized: bool) -> torch.Tensor:
        """Scored columns from hidden states (B, K, H): the full LM head + log-softmax, a chunk of
        positions at a time so that full-vocabulary logits stay within LOGITS_BYTES; or
        only the LM-head rows of the tree's own tokens."""
        head = self.model.get_output_embeddings()
        if normalized:
            flat = hidden.reshape(-1, hidden.shape[-1])
            columns = torch.tensor(tree.vocab, device=hidden.device)
            budget = LOGITS_BYTES.get(hidden.device.type, LOGITS_BYTES["cpu"])
            step = max(1, budget // (4 * head.weight.shape[0]))
            parts = [
                torch.log_softmax(head(flat[i : i + step]).float(), dim=-1)[:, columns]
                for i in range(0, flat.shape[0], step)
            ]
            return torch.cat(parts).reshape(*hidden.shape[:-1], len(tree.vocab))
        rows = torch.tensor(tree.vocab, device=hidden.device)
        bias = head.bias[rows] if getattr(head, "bias", None) is not None else None
        return torch.nn.functional.linear(hidden, head.weight[rows], bias).float()

    def _splits_head(self) -> bool:
        """Whether the logits are exactly the LM head applied to the decoder's output (no scaling or
        soft-capping in between), checked once on a probe; otherwise the full head is always used."""
        if self._head_splits is None:
            decoder, head = self.model.get_decoder(), self.model.get_output_embeddings()
            ids = torch.tensor([[0, 1, 2]], device=self.device)
            with torch.inference_mode():
                want = self.model(input_ids=ids).logits.float()
                got = head(decoder(input_ids=ids).last_hidden_state).float()
            self._head_splits = bool(torch.allclose(got, want, atol=1e-4, rtol=1e-4))
        return self._head_splits

    @torch.inference_mode()
    def prefill(self, prompt_ids: Sequence[int]) -> torch.Tensor:
        """A bare forward pass over the prompt (the latency floor); returns the last logits."""
        ids = torch.tensor([list(prompt_ids)], device=self.device)
        return self.model(input_ids=ids, use_cache=False, **self._head_only()).logits[0, -1]
