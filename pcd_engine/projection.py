"""LM-head projection: from one forward call to each tree's scored columns, and nothing more.

Only the positions a rule reads are projected, and only onto the tokens the tree scores
(`TokenTree.vocab`), so a request's scores are kilobytes whatever the vocabulary. When the model's
logits are exactly `lm_head(decoder output)` (checked once on a probe), the decoder runs alone and the
head is applied here:

- a tree whose rule needs a normaliser gets log-probs over the whole vocabulary, projected a chunk of
  positions at a time so that full-vocabulary logits stay within `LOGITS_BYTES`;
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
LOGITS_BYTES = {"cpu": 16 * 2**20, "cuda": 512 * 2**20}


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
        sizes = [len(t.scored) for t in trees]
        if self.head_splits:
            output = self.model.get_decoder()(**inputs)
            parts = torch.split(output.last_hidden_state[:, keep], sizes, dim=1)
            per_tree = [self._project(h, t, n) for h, t, n in zip(parts, trees, normalized, strict=True)]
        else:
            if self.can_slice_logits:
                inputs = {**inputs, "logits_to_keep": keep}
            output = self.model(**inputs)
            logits = output.logits if self.can_slice_logits else output.logits[:, keep]
            parts = torch.split(torch.log_softmax(logits.float(), dim=-1), sizes, dim=1)
            per_tree = [p[..., list(t.vocab)] for p, t in zip(parts, trees, strict=True)]
        return to_cpu(per_tree), output  # small; the rules then index them without device round trips

    def _project(self, hidden: torch.Tensor, tree: TokenTree, normalized: bool) -> torch.Tensor:
        """Scored columns from hidden states (B, K, H): the full LM head + log-softmax, a chunk of
        positions at a time; or only the LM-head rows of the tree's own tokens."""
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


def to_cpu(tensors: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    """The tensors on the CPU, with one device-to-host copy for all of them."""
    if not tensors or tensors[0].device.type == "cpu":
        return list(tensors)
    flat = torch.cat([t.reshape(-1) for t in tensors]).cpu()
    parts = torch.split(flat, [t.numel() for t in tensors])
    return [part.reshape(t.shape) for part, t in zip(parts, tensors, strict=True)]
