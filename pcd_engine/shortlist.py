"""Shortlists for many-valued fields: every value's cut tree first, the best values' whole ones second.

A field with many values (banking77's 77 intents: 387 tokens to feed and project whole) is scored in
two passes on the same prompt. The first pass reads each value's tree cut at its distinguishing token
(52 tokens). The second (`Scorer.finish_shortlists`) scores the whole continuations of the `size`
values the first pass ranks best, exactly. It continues the first call's KV (continuation.py): only
each value's tokens past its cut are fed (about 30 for banking77's 8), each seeing what the cut
tree's node before it saw, so it gets the log-prob the whole tree would give it. Where the first
call was not kept (its trees ran in microbatches), the text is fed again with a sub-tree of the
whole continuations (`branches.sub_tree`), with the same result. The answer is always one of them.

A value outside the shortlist keeps a score, so that probabilities, heads, calibration and abstention
see every value: its first-pass score plus the shortlisted values' mean tail (whole score minus
first-pass score, priors subtracted for `-cc` rules), and never above the lowest shortlisted score.

When it pays is a count (`ShortlistPolicy`). On a CPU time follows the tokens fed and projected, so
a field is shortlisted where the cut tree and the second pass's estimated tokens are fewer than the
whole tree's, and the plan uses them where the saving outweighs the second call's fixed cost. On a
GPU a forward call costs about the same for a few tokens or a few thousand, so the fixed cost of a
call is counted as thousands of tokens: a request is given a second call only where the whole trees
are far larger than that.

    >>> engine = PCDEngine(model, tokenizer, shortlist=ShortlistPolicy(size=16))  # doctest: +SKIP
    >>> engine.plan(Banking).scored_decisions[0].rule_name  # doctest: +SKIP
    'option-boolcut-cc+top16'
"""

from __future__ import annotations

import dataclasses
import statistics
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from pcd_engine import packing
from pcd_engine.branches import TokenTree, cut_tree
from pcd_engine.results import FieldResult
from pcd_engine.rules import ContextualCalibration, OptionRule, Rule, from_scores


@dataclass(frozen=True)
class ShortlistPolicy:
    """`size` values scored whole in the second pass. `call_cost` is what one more forward call costs,
    in tokens fed (CPU: SmolLM2 on 2 cores takes about 65 ms for a call of one token and 2 ms per
    token more, so the second call pays where it saves about 48 tokens; bitext's 27 intents and 11
    categories save 45, banking77's 77 intents 263. GPU: a call of a few thousand tokens costs about
    the same as a call of a few)."""

    size: int = 8
    call_cost: int = 48

    def __post_init__(self) -> None:
        if self.size < 1:
            raise ValueError(f"a shortlist keeps at least one value, got size={self.size}")

    @classmethod
    def for_device(cls, device: torch.device | str) -> ShortlistPolicy:
        return cls(call_cost=4096) if torch.device(device).type == "cuda" else cls()

    def saving(self, whole: TokenTree) -> int:
        """Tokens the two passes save on one field's tree (negative: they cost more): the whole tree
        against the cut tree and the second pass, which feeds at most the `size` longest tails (a
        value's tokens past its distinguishing one, continuation.py)."""
        cut = cut_tree(whole)
        tails = sorted((len(w) - len(c) for w, c in zip(whole.paths, cut.paths, strict=True)), reverse=True)
        return len(whole.tokens) - len(cut.tokens) - sum(tails[: self.size])

    def shortlisted(self, decisions: Sequence[tuple[Rule, TokenTree | None]]) -> list[bool]:
        """Per decision (its rule and whole tree), whether the plan scores it in two passes."""
        savings = [
            self.saving(tree) if tree is not None and eligible(rule, tree, self.size) else 0
            for rule, tree in decisions
        ]
        worth = [s > 0 for s in savings]
        total = sum(s for s, w in zip(savings, worth, strict=True) if w)
        return worth if total > self.call_cost else [False] * len(decisions)

    def gated(self, groups: Sequence[Sequence[TokenTree]]) -> bool:
        """Whether scoring each group of trees (a tool's arguments) only where it is chosen, in one
        more call (gates.py), pays: the tokens of every group but the largest, against `call_cost`."""
        sizes = sorted((packing.fed_tokens(trees) for trees in groups), reverse=True)
        return sum(sizes[1:]) > self.call_cost


def eligible(rule: Rule, tree: TokenTree, size: int) -> bool:
    """A decision scored by a sum of log-probs over whole trees, with more values than the list."""
    used: Any = rule
    base = used.base if isinstance(used, ContextualCalibration) else used
    whole = isinstance(base, OptionRule) and base.normalize == "sum" and not base.until_unique
    return whole and len(tree.paths) > size


def best(first: FieldResult, size: int) -> list[int]:
    """The candidates the first pass ranks best, best first: by calibrated probabilities where
    `first` was calibrated, else by the rule's scores."""
    scores = list((first.probabilities if first.calibrated else first.log_scores).values())
    return sorted(range(len(scores)), key=lambda c: -scores[c])[:size]


def completed(
    first: FieldResult, exact: Mapping[int, float], ranked: FieldResult, size: int, rule: str
) -> FieldResult:
    """A shortlisted field answered from its first pass and the second pass's exact scores (by
    candidate index): its shortlist is the `size` values `ranked` (the first pass, or the first
    pass through a calibration) ranks best, each of them among `exact`'s."""
    picks = best(ranked, size)
    return combined(first, picks, [exact[c] for c in picks], rule)


def combined(first: FieldResult, picks: Sequence[int], exact: Sequence[float], rule: str) -> FieldResult:
    """Every value's score: exact for the shortlist, estimated for the rest (see the module)."""
    before = list(first.log_scores.values())
    tail = statistics.fmean(e - before[c] for c, e in zip(picks, exact, strict=True))
    lowest = min(exact)
    scores = [min(b + tail, lowest) for b in before]
    for c, e in zip(picks, exact, strict=True):
        scores[c] = e
    chosen = picks[max(range(len(exact)), key=exact.__getitem__)]
    result = from_scores(torch.tensor(scores, dtype=torch.float64), chosen)
    values = list(first.log_scores)
    field = FieldResult.scored(first.path, values, result, rule)
    return dataclasses.replace(field, shortlist=tuple(values[c] for c in picks))
