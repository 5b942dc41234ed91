"""BranchRunner: runs packed branch passes on one Hugging Face causal LM.

`run` answers one prompt: its trees go after the prompt in one forward call or, past the token budget
`max_tokens_per_forward`, in microbatches (the first call also computes the prompt and keeps its KV;
later calls run on that KV, cropped back to the prompt after each). `run_rows` answers many prompts
that share a computed head: padded rows on that head, grouped so that rows x width fits the budget;
when CUDA runs out of memory, a group is halved and retried.

Where the head's KV comes from (the prefix cache, or computed now) is the caller's choice
(`scorer.py`); the layout of a call is `packing.py`'s, the LM head `projection.py`'s. Given a
`HiddenCapture` per prompt, the same calls also keep the hidden states a head reads (`hidden.py`).
Given a `kept` list, a call that runs whole keeps its KV for a second pass (`continue_call`,
`continuation.py`), which feeds only tokens past the first call's trees.
"""

from __future__ import annotations

import copy
import inspect
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from pcd_engine import hidden, packing
from pcd_engine.branches import TokenTree
from pcd_engine.cache import can_freeze, freeze, frozen_view, kept_view
from pcd_engine.continuation import Continuation, KeptCall, pack_continuations, pack_trees
from pcd_engine.hidden import HiddenCapture
from pcd_engine.projection import LMHeadProjection

# per row of a call: its capture, the text's (start, end) in the row, the call's trees' global indices
RowCapture = tuple[HiddenCapture, tuple[int, int] | None, Sequence[int]]
# one prompt's first call, kept for a second pass, and its row in it (None: not kept, see `run`)
Kept = tuple[KeptCall, int] | None


@dataclass
class PassStats:
    """One request's counters: forward calls and tokens fed on its behalf, prefix-cache reuse."""

    forward_calls: int = 0
    fed_tokens: int = 0
    reused_tokens: int = 0
    cache_hit: bool | None = None  # None: no prefix cache used


class BranchRunner:
    """Per tree, a float32 tensor (len(tree.scored), len(tree.vocab)): log-probs normalised over the
    whole vocabulary, or, for a tree marked `normalized=False`, plain logits of its tokens only.

    Every method takes `kv`, the KV of the first `past` prompt tokens (None and 0: nothing computed
    yet); a `kv` given is only read, never changed.
    """

    def __init__(self, model: Any, max_tokens_per_forward: int | None = None) -> None:
        if max_tokens_per_forward is None:  # a GPU runs many more tokens per call at the same cost
            on_gpu = next(model.parameters()).device.type == "cuda"
            max_tokens_per_forward = 32768 if on_gpu else 2048
        if max_tokens_per_forward < 1:
            raise ValueError(f"max_tokens_per_forward must be >= 1, got {max_tokens_per_forward}")
        self.model = model
        params = inspect.signature(model.forward).parameters
        self.cache_kw = "cache" if "cache" in params else "past_key_values"  # transformers 5 renamed it
        self.max_tokens_per_forward = max_tokens_per_forward
        self.projection = LMHeadProjection(model, can_slice_logits="logits_to_keep" in params)

    @property
    def device(self) -> torch.device:
        return next(self.model.parameters()).device

    @property
    def dtype(self) -> torch.dtype:
        return next(self.model.parameters()).dtype

    def fits(self, own_tokens: int, trees: Sequence[TokenTree]) -> bool:
        """Whether a row of `own_tokens` prompt tokens and the trees fits one forward call."""
        return own_tokens + packing.fed_tokens(trees) <= self.max_tokens_per_forward

    @torch.inference_mode()
    def run(
        self,
        prompt_ids: Sequence[int],
        trees: Sequence[TokenTree],
        stats: PassStats,
        kv: Any = None,
        past: int = 0,
        normalized: Sequence[bool] | None = None,
        capture: HiddenCapture | None = None,
        kept: list[Kept] | None = None,
    ) -> list[torch.Tensor]:
        """For each tree, its scored columns (see the class) after one prompt; with `capture`, also
        its hidden states (the text must start at or after `past`). `kept` receives the call for a
        second pass, or None where the trees ran in microbatches (their tokens are not all kept)."""
        normalized = list(normalized) if normalized is not None else [True] * len(trees)
        budget = self.max_tokens_per_forward
        groups = packing.microbatches(trees, max(budget - len(prompt_ids) + past, 1), budget)
        whole = len(groups) == 1
        keeping = kept is not None and whole
        out: list[torch.Tensor] = []
        if whole and kv is not None:  # nothing of this call is needed afterwards, or only its own part
            view = kept_view(kv) if keeping else frozen_view(kv)
            keeping = keeping and view is not None
            kv = view or kv
        for number, group in enumerate(groups):
            feed = prompt_ids[past:] if number == 0 else ()
            keep_kv = not whole or kv is not None or keeping
            chosen = [trees[i] for i in group]
            packed = packing.pack_inputs(feed, len(prompt_ids) - len(feed), chosen)
            rows = None
            if capture is not None:
                text = (capture.text_start - past, capture.text_end - past) if number == 0 else None
                rows = [(capture, text, group)]
            (scores,), kv = self._forward(packed, chosen, [normalized[i] for i in group], kv, keep_kv, rows)
            stats.forward_calls += 1
            stats.fed_tokens += packed.ids.shape[1]
            out.extend(scores)
            if kv is not None and not whole:  # drop this group's tree tokens, keep the prompt
                kv.crop(-(kv.get_seq_length() - len(prompt_ids)))
        if kept is not None:  # a cache the model grew itself may hold layers no later call can read
            keeping = keeping and can_freeze(kv)
            kept.append((KeptCall(kv, packed, past, tuple(trees)), 0) if keeping else None)
        return out

    @torch.inference_mode()
    def run_rows(
        self,
        prompts: Sequence[Sequence[int]],
        trees: Sequence[TokenTree],
        stats: Sequence[PassStats],
        kv: Any,
        past: int,
        normalized: Sequence[bool],
        capture: Sequence[HiddenCapture] | None = None,
        kept: list[Kept] | None = None,
    ) -> list[list[torch.Tensor]]:
        """`run` for prompts that share their first `past` tokens (whose KV is `kv`) and each `fits`,
        several per forward call: rows sorted by width, grouped within the token budget; with
        `capture` (one per prompt), their hidden states too; `kept` receives one entry per prompt
        (its call and row)."""
        tree_tokens = packing.fed_tokens(trees)
        width = [len(p) - past + tree_tokens for p in prompts]
        groups: list[list[int]] = [[]]
        for i in sorted(range(len(prompts)), key=width.__getitem__):  # the newcomer is the widest
            if groups[-1] and (len(groups[-1]) + 1) * width[i] > self.max_tokens_per_forward:
                groups.append([])
            groups[-1].append(i)
        out: dict[int, list[torch.Tensor]] = {}
        calls: dict[int, Kept] | None = {} if kept is not None else None
        for group in groups:
            out.update(self._rows(prompts, group, trees, normalized, kv, past, stats, capture, calls))
        if kept is not None and calls is not None:
            kept.extend(calls[i] for i in range(len(prompts)))
        return [out[i] for i in range(len(prompts))]

    def _rows(
        self,
        prompts: Sequence[Sequence[int]],
        group: Sequence[int],
        trees: Sequence[TokenTree],
        normalized: Sequence[bool],
        shared: Any,
        past: int,
        stats: Sequence[PassStats],
        capture: Sequence[HiddenCapture] | None,
        kept: dict[int, Kept] | None = None,
    ) -> dict[int, list[torch.Tensor]]:
        """One forward call for the group's rows; on CUDA out-of-memory, two calls of half as many.
        `kept` receives, per prompt number, the call kept for a second pass (None: not kept)."""
        view = kept_view if kept is not None else frozen_view
        kv = view(shared, len(group)) if shared is not None else None
        keeping = kept is not None and (kv is not None or shared is None)
        if kv is None and shared is not None:  # not a DynamicCache: a real copy, repeated per row
            kv = copy.deepcopy(shared)
            if len(group) > 1:
                kv.batch_repeat_interleave(len(group))
        packed = packing.pack_rows([prompts[i][past:] for i in group], past, trees)
        tree_tokens = packing.fed_tokens(trees)
        rows: list[RowCapture] | None = None
        if capture is not None:  # rows are left-padded to the call's width
            width = packed.ids.shape[1]
            rows = []
            for i in group:
                pad = width - (len(prompts[i]) - past + tree_tokens)
                c = capture[i]
                rows.append((c, (pad + c.text_start - past, pad + c.text_end - past), range(len(trees))))
        try:
            scores, grown = self._forward(packed, trees, normalized, kv, keeping and kv is None, rows)
        except torch.OutOfMemoryError:
            if len(group) == 1:
                raise
            del kv
            torch.cuda.empty_cache()
            half = len(group) // 2
            return {
                **self._rows(prompts, group[:half], trees, normalized, shared, past, stats, capture, kept),
                **self._rows(prompts, group[half:], trees, normalized, shared, past, stats, capture, kept),
            }
        for i in group:
            stats[i].forward_calls += 1
            stats[i].fed_tokens += len(prompts[i]) - past + tree_tokens
        if kept is not None:  # a kept view kept its part in place; a new cache is the model's own
            held = grown if kv is None else kv
            call = KeptCall(held, packed, past, tuple(trees)) if keeping and can_freeze(held) else None
            kept.update({i: (call, row) if call is not None else None for row, i in enumerate(group)})
        return dict(zip(group, scores, strict=True))

    @torch.inference_mode()
    def continue_call(
        self,
        kept: KeptCall,
        per_row: Sequence[Sequence[tuple[TokenTree, Continuation]]],
        stats: Sequence[PassStats | None],
    ) -> list[list[torch.Tensor]]:
        """A second pass on a kept first call (continuation.py): per row, per continuation, the
        log-probs (over the whole vocabulary) of its targets, in one forward call. `stats` (one per
        row, None for a row with nothing of its own) count the call and each row's own tokens."""
        inputs = pack_continuations(kept, per_row)
        model_inputs: dict[str, Any] = {
            "input_ids": inputs.ids.to(self.device),
            "attention_mask": packing.additive_mask(inputs.allowed.to(self.device), self.dtype),
            "position_ids": inputs.positions.to(self.device),
            "use_cache": False,
            self.cache_kw: freeze(kept.kv, kept.rows),
        }
        logprobs = self.projection.target_logprobs(model_inputs, inputs.targets.to(self.device))
        for counters, spans in zip(stats, inputs.spans, strict=True):
            if counters is not None:
                counters.forward_calls += 1
                counters.fed_tokens += sum(end - start for start, end in spans)
        return [[logprobs[r, a:b] for a, b in spans] for r, spans in enumerate(inputs.spans)]

    @torch.inference_mode()
    def run_after(
        self,
        kept: KeptCall,
        trees: Sequence[TokenTree],
        normalized: Sequence[bool],
        stats: Sequence[PassStats | None],
        capture: Sequence[RowCapture] | None = None,
    ) -> list[list[torch.Tensor]]:
        """Per row of a kept first call, per tree, the scored columns (as `run` gives them) of `trees`
        fed after that row's prompt in one forward call, the prompt not fed again
        (`continuation.pack_trees`). `stats` (one per row, None for a row of no request) count it;
        `capture` (one per row) reads the trees' fork states."""
        packed = pack_trees(kept, trees)
        frozen = freeze(kept.kv, kept.rows)
        scores, _ = self._forward(packed, trees, normalized, frozen, keep_kv=False, capture=capture)
        for counters in stats:
            if counters is not None:
                counters.forward_calls += 1
                counters.fed_tokens += packed.ids.shape[1]
        return scores

    @torch.inference_mode()
    def prefill_head(self, head: Sequence[int], stats: PassStats) -> Any:
        """The KV of `head` alone (to store in a prefix cache, or to share across rows)."""
        ids = torch.tensor([list(head)], device=self.device)
        output = self.model(input_ids=ids, use_cache=True, **self._last_logits_only())
        stats.forward_calls += 1
        stats.fed_tokens += len(head)
        return output["cache" if "cache" in output else "past_key_values"]

    @torch.inference_mode()
    def prefill(self, prompt_ids: Sequence[int]) -> torch.Tensor:
        """A bare forward pass over the prompt (the latency floor); returns the last logits."""
        ids = torch.tensor([list(prompt_ids)], device=self.device)
        return self.model(input_ids=ids, use_cache=False, **self._last_logits_only()).logits[0, -1]

    def _last_logits_only(self) -> dict[str, Any]:
        return {"logits_to_keep": 1} if self.projection.can_slice_logits else {}

    def _forward(
        self,
        packed: packing.PackedInputs,
        trees: Sequence[TokenTree],
        normalized: Sequence[bool],
        kv: Any,
        keep_kv: bool,
        capture: Sequence[RowCapture] | None = None,
    ) -> tuple[list[list[torch.Tensor]], Any]:
        """Per row, per tree, the scored columns; and the grown KV when `keep_kv`. With `capture`
        (one per row), each row's hidden states are read into its HiddenCapture."""
        ids, positions, allowed = packed.ids, packed.positions, packed.allowed
        keep = [packed.at(t, i) for t, tree in enumerate(trees) for i in tree.scored]
        inputs: dict[str, Any] = {
            "input_ids": ids.to(self.device),
            "attention_mask": packing.additive_mask(allowed.to(self.device), self.dtype),
            "position_ids": positions.to(self.device),
            "use_cache": keep_kv,
        }
        if kv is not None:
            inputs[self.cache_kw] = kv
        keep_t = torch.tensor(keep, device=self.device)
        if capture is None:
            per_tree, output = self.projection.forward(inputs, keep_t, trees, normalized)
        else:
            with hidden.hooked(self.model) as seen:
                per_tree, output = self.projection.forward(inputs, keep_t, trees, normalized)
                for row, (into, text, indices) in enumerate(capture):
                    pairs = enumerate(zip(indices, trees, strict=True))
                    forks = [(k, packed.at(t, tree.root)) for t, (k, tree) in pairs]
                    hidden.read(seen, row, into, text, forks)
        grown = output["cache" if "cache" in output else "past_key_values"] if keep_kv else None
        return [[scores[row] for scores in per_tree] for row in range(ids.shape[0])], grown
