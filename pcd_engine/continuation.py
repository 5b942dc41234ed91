"""Second passes on a first pass's KV: more tokens after some of its tree nodes, nothing fed again.

A shortlist's first pass (shortlist.py) feeds each value's tree cut at its distinguishing token. Its
forward call keeps its keys and values (`cache.kept_view`) and its layout: a `KeptCall`. The second
pass then feeds, per shortlisted value, only the tokens past the cut, hung on the cut tree's node they
follow (`Continuation`): each fed token sees exactly what that node saw in the first call (its row of
the first call's mask: the prompt and the node's ancestors) plus the continuation's own tokens before
it, at the next positions. Every token so has the same tokens before it, at the same positions, as in
the whole tree, and gets the same log-prob: the second pass is exact and feeds no prompt token again.

Several prompts of one first call (its rows) continue in one call, left to right in each row and
padded to the longest row; a padding token sees only itself and no real token sees it.

Whole trees can follow the prompt in the same way (`pack_trees`): a gated decision's tree (gates.py,
a tool's arguments once the tool is chosen) sees what the prompt's last token saw and its own
ancestors, at the positions the first call would have given it, and none of the first call's trees.

    >>> from pcd_engine.branches import build_tree, cut_tree
    >>> whole = build_tree(lambda s: [ord(c) for c in s], "{", ["abcd", "abxy"])
    >>> continuation_of(cut_tree(whole), whole, 1)
    Continuation(node=2, tokens=(120, 121))
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple

import torch

from pcd_engine.branches import TokenTree
from pcd_engine.packing import PackedInputs, pack_inputs


@dataclass(frozen=True)
class Continuation:
    """The tokens of one value past its cut: `tokens[0]` (the distinguishing token, already scored by
    the first pass) is fed after fed index `node` of the cut tree (-1: the prompt's last token); every
    token but the last is fed, and predicts the next one."""

    node: int
    tokens: tuple[int, ...]

    @property
    def fed(self) -> tuple[int, ...]:
        return self.tokens[:-1]

    @property
    def targets(self) -> tuple[int, ...]:
        return self.tokens[1:]


def continuation_of(cut: TokenTree, whole: TokenTree, value: int) -> Continuation | None:
    """Value `value`'s tokens past its cut (`cut` is `cut_tree(whole)`); None when the cut is whole."""
    path = cut.paths[value]
    rest = whole.continuation(value)[len(path) - 1 :]
    return Continuation(path[-1][0], rest) if len(rest) > 1 else None


@dataclass
class KeptCall:
    """A first call's KV (its prefix, then its own `width` tokens per row) and its layout: the trees it
    fed, in order, where each of their tokens sits (`packed`), and how many tokens preceded it."""

    kv: Any
    packed: PackedInputs
    past: int
    trees: tuple[TokenTree, ...]

    @property
    def rows(self) -> int:
        return int(self.packed.ids.shape[0])

    def column(self, tree: TokenTree, node: int) -> int:
        """Where fed index `node` of `tree` (one of the call's trees, by identity) sits in every row."""
        number = next(t for t, own in enumerate(self.trees) if own is tree)
        return self.packed.at(number, node)


class ContinuedInputs(NamedTuple):
    ids: torch.Tensor  # (B, N) token ids, one row per row of the kept call
    positions: torch.Tensor  # (B, N)
    allowed: torch.Tensor  # (B, 1, N, past + width + N) bool
    targets: torch.Tensor  # (B, N) the token each fed token predicts (0 under padding)
    spans: list[list[tuple[int, int]]]  # per row, per continuation, its (start, end) in the row


def pack_continuations(
    kept: KeptCall, per_row: Sequence[Sequence[tuple[TokenTree, Continuation]]]
) -> ContinuedInputs:
    """The inputs of one call that continues `kept`: per row of it, the continuations (each with the
    cut tree it hangs on) side by side, left-aligned; rows padded to the longest."""
    if len(per_row) != kept.rows:
        raise ValueError(f"a continuation call has one entry per kept row ({kept.rows}), got {len(per_row)}")
    seen = kept.past + kept.packed.ids.shape[1]
    width = max(1, max(sum(len(c.fed) for _, c in row) for row in per_row))
    ids = torch.zeros(kept.rows, width, dtype=torch.long)
    positions = torch.zeros(kept.rows, width, dtype=torch.long)
    targets = torch.zeros(kept.rows, width, dtype=torch.long)
    allowed = torch.zeros(kept.rows, 1, width, seen + width, dtype=torch.bool)
    allowed[:, 0, torch.arange(width), seen + torch.arange(width)] = True  # padding sees itself
    spans: list[list[tuple[int, int]]] = []
    for r, row in enumerate(per_row):
        spans.append([])
        start = 0
        for tree, cont in row:
            column, end = kept.column(tree, cont.node), start + len(cont.fed)
            ids[r, start:end] = torch.tensor(cont.fed)
            targets[r, start:end] = torch.tensor(cont.targets)
            positions[r, start:end] = kept.packed.positions[r, column] + 1 + torch.arange(len(cont.fed))
            allowed[r, 0, start:end, :seen] = kept.packed.allowed[r, 0, column]
            causal = torch.ones(len(cont.fed), len(cont.fed), dtype=torch.bool).tril()
            allowed[r, 0, start:end, seen + start : seen + end] = causal
            spans[-1].append((start, end))
            start = end
    return ContinuedInputs(ids, positions, allowed, targets, spans)


def pack_trees(kept: KeptCall, trees: Sequence[TokenTree]) -> PackedInputs:
    """The inputs of one call that feeds `trees` after the prompt of every row of `kept`, as `run`
    would have fed them beside the first call's trees: each tree token sees that row's past and
    prompt (the row of the prompt's last token in the first call's mask) and its own ancestors, at
    positions counted from the prompt's end. Trees whose chain is empty (scored from the prompt's last
    token itself) cannot follow a kept call."""
    if any(tree.root < 0 for tree in trees):
        raise ValueError("a tree that starts at the prompt's last token cannot follow a kept call")
    own = pack_inputs((), 0, trees)  # the forest alone: positions are depths, the mask its own
    rows, width = kept.rows, own.ids.shape[1]
    seen = kept.past + kept.packed.ids.shape[1]
    last = kept.packed.prompt_last
    allowed = torch.zeros(rows, 1, width, seen + width, dtype=torch.bool)
    allowed[:, 0, :, :seen] = kept.packed.allowed[:, 0, last : last + 1, :]
    allowed[:, 0, :, seen:] = own.allowed[0, 0]
    positions = kept.packed.positions[:, last : last + 1] + 1 + own.positions
    return PackedInputs(own.ids.expand(rows, width), positions, allowed, own.columns, -1)
