"""Scoring rules: from a tree's log-probs to a score per candidate and a choice.

All rules read the same packed pass:

- `OptionRule("sum")` (rule name "option"): log-likelihood of each candidate's continuation tokens,
  terminator included. `OptionRule("mean")` ("option-mean") divides by the continuation's length.
- `GreedyRule` ("greedy"): walk the trie, taking the best child at each node: the result of greedy
  decoding constrained to the candidates' canonical tokenizations. Its probabilities are those of
  constrained decoding: at each node a softmax over the allowed children, multiplied along the path.
- `CodeRule` ("code"): the log-prob of each candidate's first continuation token only; used with the
  code layout, where string values are listed under single-token codes (A, B, ...).

Any rule can be wrapped in `ContextualCalibration` ("option-cc", "greedy-cc"): the engine then
subtracts, position by position, the log-probs the same branches get for content-free inputs ("N/A",
"", "[MASK]"; Zhao et al. 2021, "Calibrate Before Use"), which removes a small model's prior for a
value (e.g. always `true`, or the first listed option) before the base rule reads the scores.

Probabilities are a softmax over the scores (not calibrated to observed accuracy).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch

from pcd_engine.branches import TokenTree


@dataclass(frozen=True)
class Scores:
    log_scores: tuple[float, ...]  # one per candidate, in the rule's units
    probabilities: tuple[float, ...]  # sums to 1
    chosen: int


class Rule(Protocol):
    @property
    def name(self) -> str: ...

    @property
    def uses_codes(self) -> bool: ...

    @property
    def corrects_prior(self) -> bool: ...

    def score(self, tree: TokenTree, logprobs: torch.Tensor) -> Scores: ...


def token_logprobs(tree: TokenTree, logprobs: torch.Tensor) -> list[torch.Tensor]:
    """Per candidate, the log-prob of each continuation token given everything before it."""
    rows = {fed: row for row, fed in enumerate(tree.scored)}
    out = []
    for path in tree.paths:
        index = torch.tensor([rows[pred] for pred, _ in path])
        tokens = torch.tensor([token for _, token in path])
        out.append(logprobs[index, tokens])
    return out


def _from_scores(log_scores: torch.Tensor, chosen: int | None = None) -> Scores:
    probs = torch.softmax(log_scores.double(), dim=0)
    pick = int(torch.argmax(log_scores)) if chosen is None else chosen
    return Scores(tuple(log_scores.tolist()), tuple(probs.tolist()), pick)


@dataclass(frozen=True)
class OptionRule:
    normalize: str = "sum"  # "sum" or "mean"
    uses_codes: bool = False
    corrects_prior: bool = False

    @property
    def name(self) -> str:
        return "option" if self.normalize == "sum" else "option-mean"

    def score(self, tree: TokenTree, logprobs: torch.Tensor) -> Scores:
        per_token = token_logprobs(tree, logprobs)
        reduce = torch.sum if self.normalize == "sum" else torch.mean
        return _from_scores(torch.stack([reduce(t) for t in per_token]))


@dataclass(frozen=True)
class CodeRule:
    name: str = "code"
    uses_codes: bool = True
    corrects_prior: bool = False

    def score(self, tree: TokenTree, logprobs: torch.Tensor) -> Scores:
        root = logprobs[0]  # row 0 is tree.root
        firsts = [path[0][1] for path in tree.paths]
        if len(set(firsts)) != len(firsts):
            raise ValueError("code rule needs candidates with distinct first tokens")
        return _from_scores(root[torch.tensor(firsts)])


@dataclass(frozen=True)
class GreedyRule:
    name: str = "greedy"
    uses_codes: bool = False
    corrects_prior: bool = False

    def score(self, tree: TokenTree, logprobs: torch.Tensor) -> Scores:
        rows = {fed: row for row, fed in enumerate(tree.scored)}
        log_scores = []
        for path in tree.paths:
            total = 0.0
            for pred, token in path:
                allowed = torch.tensor(list(tree.children(pred)))
                local = torch.log_softmax(logprobs[rows[pred], allowed].double(), dim=0)
                total += float(local[allowed.tolist().index(token)])
            log_scores.append(total)
        return _from_scores(torch.tensor(log_scores), self._walk(tree, logprobs, rows))

    @staticmethod
    def _walk(tree: TokenTree, logprobs: torch.Tensor, rows: dict[int, int]) -> int:
        node: int | None = tree.root
        taken: list[int] = []
        while node is not None:
            children = tree.children(node)
            tokens = list(children)
            best = tokens[int(torch.argmax(logprobs[rows[node], torch.tensor(tokens)]))]
            taken.append(best)
            node = children[best]
        return [tree.continuation(c) for c in range(len(tree.paths))].index(tuple(taken))


@dataclass(frozen=True)
class ContextualCalibration:
    """A base rule applied to log-probs minus the content-free prior (the engine does the subtraction)."""

    base: Rule
    corrects_prior: bool = True

    @property
    def name(self) -> str:
        return f"{self.base.name}-cc"

    @property
    def uses_codes(self) -> bool:
        return self.base.uses_codes

    def score(self, tree: TokenTree, logprobs: torch.Tensor) -> Scores:
        return self.base.score(tree, logprobs)


RULES: dict[str, Rule] = {
    "option": OptionRule("sum"),
    "option-mean": OptionRule("mean"),
    "greedy": GreedyRule(),
    "code": CodeRule(),
    "option-cc": ContextualCalibration(OptionRule("sum")),
    "greedy-cc": ContextualCalibration(GreedyRule()),
}


def get_rule(rule: str | Rule) -> Rule:
    if not isinstance(rule, str):
        return rule
    try:
        return RULES[rule]
    except KeyError:
        raise ValueError(f"unknown rule {rule!r}; choose one of {sorted(RULES)}") from None
