"""Scoring rules: from a tree's log-probs to a score per candidate and a choice.

All rules read the same packed pass: per tree, a tensor (len(tree.scored), len(tree.vocab)) whose
row r holds, at fed index `tree.scored[r]`, the scores of the tree's own tokens (`tree.column`). They
are log-probs normalised over the whole vocabulary when the rule `needs_normalizer`; otherwise plain
logits, because the rule only compares tokens of one row (a row-wide shift cannot change it), and the
runner then projects the hidden state onto those few LM-head rows only.


- `OptionRule("sum")` (rule name "option"): log-likelihood of each candidate's continuation tokens,
  terminator included. `OptionRule("mean")` ("option-mean") divides by the continuation's length.
  `OptionRule("sum", until_unique=True)` ("option-unique") sums only up to the token that sets the
  candidate apart from the others: a sibling tree with far fewer tokens to feed and to project
  (77 intents: 52 instead of 387), at the cost of the tail's log-probability (measured, not exact).
  `OptionRule("sum", cut_bools=True)` ("option-boolcut") cuts only yes/no decisions: a bool is
  scored by its word (` true` / ` false`) without the terminator after it, strings whole.
- `GreedyRule` ("greedy"): walk the trie, taking the best child at each node: the result of greedy
  decoding constrained to the candidates' canonical tokenizations. Its probabilities are those of
  constrained decoding: at each node a softmax over the allowed children, multiplied along the path.
- `CodeRule` ("code"): the log-prob of each candidate's first continuation token only, renormalised
  over the codes; used with the code layout, where string values are listed under single-token
  codes (A, B, ...).

`greedy` and `code` read trees cut at the distinguishing token too (`until_unique`), exactly: past it a
greedy node has one child (log-probability 0 among the allowed) and the code rule reads the first
token only.

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

from pcd_engine.branches import TokenTree, path_scores


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

    @property
    def needs_normalizer(self) -> bool: ...

    @property
    def until_unique(self) -> bool: ...  # reads each candidate only up to its distinguishing token

    @property
    def cut_bools(self) -> bool: ...  # reads yes/no decisions only up to their distinguishing token

    def score(self, tree: TokenTree, logprobs: torch.Tensor) -> Scores: ...


def tree_shape(rule: Rule) -> tuple[bool, bool, bool]:
    """What a rule's trees look like (codes, cut or not): rules of one shape can read one packed pass."""
    return (rule.uses_codes, rule.until_unique, rule.cut_bools)


def token_logprobs(tree: TokenTree, logprobs: torch.Tensor) -> list[torch.Tensor]:
    """Per candidate, the log-prob of each continuation token given everything before it."""
    return [path_scores(tree, logprobs, c) for c in range(len(tree.paths))]


def from_scores(log_scores: torch.Tensor, chosen: int | None = None) -> Scores:
    """Scores with their softmax and the choice (the argmax unless `chosen` is given)."""
    probs = torch.softmax(log_scores.double(), dim=0)
    pick = int(torch.argmax(log_scores)) if chosen is None else chosen
    return Scores(tuple(log_scores.tolist()), tuple(probs.tolist()), pick)


@dataclass(frozen=True)
class OptionRule:
    normalize: str = "sum"  # "sum" or "mean"
    uses_codes: bool = False
    corrects_prior: bool = False
    needs_normalizer: bool = True  # a sum of log-probs from different rows
    until_unique: bool = False  # an approximation: drops log p(rest | distinguishing prefix)
    cut_bools: bool = False  # the same for yes/no decisions only (` true` / ` false`, no terminator)

    @property
    def name(self) -> str:
        base = "option" if self.normalize == "sum" else "option-mean"
        return base + ("-unique" if self.until_unique else "-boolcut" if self.cut_bools else "")

    def score(self, tree: TokenTree, logprobs: torch.Tensor) -> Scores:
        per_token = token_logprobs(tree, logprobs)
        reduce = torch.sum if self.normalize == "sum" else torch.mean
        return from_scores(torch.stack([reduce(t) for t in per_token]))


@dataclass(frozen=True)
class CodeRule:
    name: str = "code"
    uses_codes: bool = True
    corrects_prior: bool = False
    needs_normalizer: bool = False
    until_unique: bool = True  # exact: it reads the first continuation token only
    cut_bools: bool = False

    def score(self, tree: TokenTree, logprobs: torch.Tensor) -> Scores:
        root = logprobs[0]  # row 0 is tree.root
        firsts = [path[0][1] for path in tree.paths]
        if len(set(firsts)) != len(firsts):
            raise ValueError("code rule needs candidates with distinct first tokens")
        scores = root[torch.tensor([tree.column[t] for t in firsts])]
        return from_scores(scores - torch.logsumexp(scores, dim=0))


@dataclass(frozen=True)
class GreedyRule:
    name: str = "greedy"
    uses_codes: bool = False
    corrects_prior: bool = False
    needs_normalizer: bool = False
    until_unique: bool = True  # exact: past the distinguishing token each node has one child (log 1)
    cut_bools: bool = False

    def score(self, tree: TokenTree, logprobs: torch.Tensor) -> Scores:
        rows = {fed: row for row, fed in enumerate(tree.scored)}
        log_scores = []
        for path in tree.paths:
            total = 0.0
            for pred, token in path:
                allowed = list(tree.children(pred))
                columns = torch.tensor([tree.column[t] for t in allowed])
                local = torch.log_softmax(logprobs[rows[pred], columns].double(), dim=0)
                total += float(local[allowed.index(token)])
            log_scores.append(total)
        return from_scores(torch.tensor(log_scores), self._walk(tree, logprobs, rows))

    @staticmethod
    def _walk(tree: TokenTree, logprobs: torch.Tensor, rows: dict[int, int]) -> int:
        node: int | None = tree.root
        taken: list[int] = []
        while node is not None:
            children = tree.children(node)
            tokens = list(children)
            columns = torch.tensor([tree.column[t] for t in tokens])
            best = tokens[int(torch.argmax(logprobs[rows[node], columns]))]
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

    @property
    def needs_normalizer(self) -> bool:  # per row, text and prior differ by a shift only where
        return self.base.needs_normalizer  # the base rule compares tokens of one row

    @property
    def until_unique(self) -> bool:
        return self.base.until_unique

    @property
    def cut_bools(self) -> bool:
        return self.base.cut_bools

    def score(self, tree: TokenTree, logprobs: torch.Tensor) -> Scores:
        return self.base.score(tree, logprobs)


RULES: dict[str, Rule] = {
    "option": OptionRule("sum"),
    "option-mean": OptionRule("mean"),
    "greedy": GreedyRule(),
    "code": CodeRule(),
    "option-cc": ContextualCalibration(OptionRule("sum")),
    "greedy-cc": ContextualCalibration(GreedyRule()),
    "option-unique": OptionRule("sum", until_unique=True),
    "option-unique-cc": ContextualCalibration(OptionRule("sum", until_unique=True)),
    "option-boolcut": OptionRule("sum", cut_bools=True),
    "option-boolcut-cc": ContextualCalibration(OptionRule("sum", cut_bools=True)),
}


def get_rule(rule: str | Rule) -> Rule:
    if not isinstance(rule, str):
        return rule
    try:
        return RULES[rule]
    except KeyError:
        raise ValueError(f"unknown rule {rule!r}; choose one of {sorted(RULES)}") from None
