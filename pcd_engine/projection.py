"""LM-head projection: from one forward call to each tree's scored columns, and nothing more.

Only the positions a rule reads are projected, and only onto the tokens the tree scores
(`TokenTree.vocab`), so a request's scores are kilobytes whatever the vocabulary. When the model's
logits are exactly `lm_head(decoder output)` (checked once on a probe), the decoder runs alone and the
head is applied here:

- a tree whose rule needs a normaliser gets log-probs over the whole vocabulary; the rows of all such
  trees are projected together, a chunk of positions at a time, so that each chunk reads the head's
  weight once (on a CPU that read, not the arithmetic, is most of the cost) and full-vocabulary logits
  stay within `LOGITS_BYTES`;
- any other tree gets plain logits from only its own rows of the LM head (a rule that compares tokens
  of one row cannot be changed by the row-wide shift it skips).

A model that scales or soft-caps its logits runs whole, with `logits_to_keep` where it accepts it, and
every tree gets log-probs.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from pcd_engine.branches import TokenTree

# full-vocabulary float32 logits held at once while projecting: small on CPU (memory), large on a GPU
# (each chunk reads the whole LM-head weight, so fewer, larger chunks are faster)
LOGITS_BYTES = {"cpu": 32 * 2**20, "cuda": 512 * 2**20}


class LMHeadProjection:
    """Runs the model for a packed call and returns, per tree, its scored columns on the CPU:
    a float32 tensor (rows, len(tree.scored), len(tree.vocab))."""

    def __init__(self, model: Any, can_slice_logits: bool) -> None:
        self.model = model
        self.can_slice_logits = can_slice_logits  # the model's forward takes `logits_to_keep`
        self._head_splits: bool | None = None

    @property
    def head_splits(self) -> bool:
        """Whether the logits are exactly the LM head applied to the decoder's output (no scaling or
        soft-capping in between), checked once on a probe; otherwise the whole model always runs."""
        if self._head_splits is None:
            decoder, head = self.model.get_decoder(), self.model.get_output_embeddings()
            ids = torch.tensor([[0, 1, 2]], device=next(self.model.parameters()).device)
            with torch.inference_mode():
                want = self.model(input_ids=ids).logits.float()
                got = head(decoder(input_ids=ids).last_hidden_state).float()
            self._head_splits = bool(torch.allclose(got, want, atol=1e-4, rtol=1e-4))
        return self._head_splits

    @head_splits.setter
    def head_splits(self, value: bool) -> None:
        self._head_splits = value

    def forward(
        self,
        inputs: dict[str, Any],
        keep: torch.Tensor,
        trees: Sequence[TokenTree],
        normalized: Sequence[bool],
    ) -> tuple[list[torch.Tensor], Any]:
        """(per tree, its scored columns; the model's output) for the model `inputs`, reading the
        positions `keep` (each tree's `scored` positions, tree after tree)."""
        if self.head_splits:
            output = self.model.get_decoder()(**inputs)
            return self.project(output.last_hidden_state[:, keep], trees, normalized), output
        if self.can_slice_logits:
            inputs = {**inputs, "logits_to_keep": keep}
        output = self.model(**inputs)
        logits = output.logits if self.can_slice_logits else output.logits[:, keep]
        sizes = [len(t.scored) for t in trees]
        parts = torch.split(torch.log_softmax(logits.float(), dim=-1), sizes, dim=1)
        return to_cpu([p[..., list(t.vocab)] for p, t in zip(parts, trees, strict=True)]), output

    def target_logprobs(self, inputs: dict[str, Any], targets: torch.Tensor) -> torch.Tensor:
        """The log-prob (over the whole vocabulary) of each position's target token (B, N), on the CPU,
        from the model run on `inputs`; a chunk of positions at a time, as for normalised trees."""
        if not self.head_splits:
            logits = self.model(**inputs).logits.float()
            return torch.log_softmax(logits, dim=-1).gather(-1, targets[..., None])[..., 0].cpu()
        hidden = self.model.get_decoder()(**inputs).last_hidden_state
        head = self.model.get_output_embeddings()
        flat, wanted = hidden.reshape(-1, hidden.shape[-1]), targets.reshape(-1)
        budget = LOGITS_BYTES.get(flat.device.type, LOGITS_BYTES["cpu"])
        step = max(1, budget // (4 * head.weight.shape[0]))
        pieces = []
        for i in range(0, flat.shape[0], step):
            logprobs = torch.log_softmax(head(flat[i : i + step]).float(), dim=-1)
            pieces.append(logprobs.gather(-1, wanted[i : i + step, None])[:, 0])
        return torch.cat(pieces).reshape(targets.shape).cpu()

    def project(
        self, hidden: torch.Tensor, trees: Sequence[TokenTree], normalized: Sequence[bool]
    ) -> list[torch.Tensor]:
        """Per tree, its scored columns on the CPU from the decoder's hidden states (B, K, H) at the
        scored positions, tree after tree. The result is small; the rules then index it without
        device round trips."""
        parts = torch.split(hidden, [len(t.scored) for t in trees], dim=1)
        per_tree = {
            k: self._own_rows(h, t)
            for k, (h, t, n) in enumerate(zip(parts, trees, normalized, strict=True))
            if not n
        }
        wanted = [k for k, n in enumerate(normalized) if n]
        if wanted:  # every normalised tree's rows through the full head together
            full = self._log_softmax_columns([parts[k] for k in wanted], [trees[k] for k in wanted])
            per_tree.update(zip(wanted, full, strict=True))
        return to_cpu([per_tree[k] for k in range(len(trees))])

    def _log_softmax_columns(
        self, parts: Sequence[torch.Tensor], trees: Sequence[TokenTree]
    ) -> list[torch.Tensor]:
        """Per tree, log-probs over the whole vocabulary of its own columns, from hidden states
        (B, K, H) per tree. All trees' rows go through the full LM head together, a chunk of rows at a
        time, so that each chunk reads the head's weight once and full logits stay within
        `LOGITS_BYTES`."""
        head = self.model.get_output_embeddings()
        flat = torch.cat([p.reshape(-1, p.shape[-1]) for p in parts])
        bounds, start = [], 0
        for p in parts:
            bounds.append((start, start + p.shape[0] * p.shape[1]))
            start = bounds[-1][1]
        columns = [torch.tensor(t.vocab, device=flat.device) for t in trees]
        budget = LOGITS_BYTES.get(flat.device.type, LOGITS_BYTES["cpu"])
        step = max(1, budget // (4 * head.weight.shape[0]))
        pieces: list[list[torch.Tensor]] = [[] for _ in trees]
        for i in range(0, flat.shape[0], step):
            logprobs = torch.log_softmax(head(flat[i : i + step]).float(), dim=-1)
            for k, (lo, hi) in enumerate(bounds):
                a, b = max(lo, i), min(hi, i + step)
                if a < b:
                    pieces[k].append(logprobs[a - i : b - i][:, columns[k]])
        return [
            torch.cat(piece).reshape(*p.shape[:-1], len(t.vocab))
            for piece, p, t in zip(pieces, parts, trees, strict=True)
        ]

    def _own_rows(self, hidden: torch.Tensor, tree: TokenTree) -> torch.Tensor:
        """Plain logits (B, K, len(tree.vocab)) from only the LM-head rows of the tree's own tokens."""
        head = self.model.get_output_embeddings()
        rows = torch.tensor(tree.vocab, device=hidden.device)
        bias = head.bias[rows] if getattr(head, "bias", None) is not None else None
        return torch.nn.functional.linear(hidden, head.weight[rows], bias).float()


def to_cpu(tensors: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    """The tensors on the CPU, with one device-to-host copy for all of them."""
    if not tensors or tensors[0].device.type == "cpu":
        return list(tensors)
    flat = torch.cat([t.reshape(-1) for t in tensors]).cpu()
    parts = torch.split(flat, [t.numel() for t in tensors])
    return [part.reshape(t.shape) for part, t in zip(parts, tensors, strict=True)]
