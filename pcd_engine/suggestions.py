"""Which texts to label next: a random share that keeps the labels a sample, the rest uncertain and
unlike each other (and unlike the texts already labeled).

`pick` chooses `count` texts in two parts:

- `share` of them (default 0.3) drawn uniformly at random, marked `sampled`: the labels stay close
  to a sample of what you classify, so a calibration fitted on them stays calibrated on ordinary
  texts (the texts picked by uncertainty alone are the hardest ones: a calibration fitted on them
  alone was overconfident, ECE 0.21 on held-out rows);
- the rest one at a time, each drawn with probability proportional to its uncertainty times its
  squared distance to the nearest text picked or labeled so far: k-means++ seeding weighted by
  uncertainty, in the model's own hidden states (the text's mean state at the middle layer,
  standardised, reduced to `DIMS` principal directions). Ten texts that say the same thing are not
  all picked, and a round after a calibration (`labeled`) looks away from what is labeled.

A text's uncertainty is the mean over its scored fields of 1 - margin (or, `by="entropy"`, the
entropy divided by the log of the field's number of values), under the calibration it was scored
with, if any.

    >>> picked = pick(per_text_fields, features, count=50)  # doctest: +SKIP
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from pcd_engine.results import FieldResult
from pcd_engine.schema import JSONScalar

MEASURES = ("margin", "entropy")
SUGGESTION_SHARE = 0.3  # the random share (docs/benchmarks.md: suggested against random labels)
DIMS = 32  # principal directions of the hidden states the distances are measured in


@dataclass(frozen=True)
class Picked:
    index: int  # the text's position in the input
    field: str  # its least certain field
    value: JSONScalar  # that field's predicted value
    uncertainty: float  # the mean over its scored fields
    sampled: bool  # drawn at random (the share that keeps the labels a sample), not by uncertainty


def uncertainty(fields: Mapping[str, FieldResult], by: str = "margin") -> tuple[str, float] | None:
    """(least certain field, the mean uncertainty over the scored fields); None if none is scored."""
    scored = [f for f in fields.values() if f.source == "scored" and f.rule != "fixed"]
    if not scored:
        return None
    each = [_uncertainty(f, by) for f in scored]
    worst = max(range(len(scored)), key=each.__getitem__)
    return scored[worst].path, sum(each) / len(each)


def _uncertainty(f: FieldResult, by: str) -> float:
    if by == "margin":
        return 1.0 - (f.margin or 0.0)
    entropy = -sum(p * math.log(p) for p in f.probabilities.values() if p > 0)
    return entropy / math.log(len(f.probabilities))


def check_suggest(count: int, by: str, share: float = SUGGESTION_SHARE) -> None:
    """ValueError for a count, measure or share `pick` cannot use (run before any text is scored)."""
    if by not in MEASURES:
        raise ValueError(f"by must be one of {MEASURES}, got {by!r}")
    if isinstance(count, bool) or not isinstance(count, int) or count < 1:
        raise ValueError(f"count must be an int of at least 1, got {count!r}")
    if not 0.0 <= share <= 1.0:
        raise ValueError(f"share must be between 0 and 1, got {share!r}")


def pick(
    per_text: Sequence[Mapping[str, FieldResult] | None],
    features: Sequence[torch.Tensor | None],
    count: int,
    *,
    by: str = "margin",
    share: float = SUGGESTION_SHARE,
    labeled: Sequence[torch.Tensor] = (),
    seed: int = 0,
) -> list[Picked]:
    """Up to `count` texts (see the module); a text with no answer (None) is never picked.
    `features` are the texts' hidden states (one vector each), `labeled` those of texts already
    labeled; `seed` makes the draws repeatable."""
    check_suggest(count, by, share)
    found = {i: uncertainty(f, by) for i, f in enumerate(per_text) if f is not None}
    live = [i for i, u in found.items() if u is not None and features[i] is not None]
    if not live:
        return []
    u = torch.tensor([found[i][1] for i in live], dtype=torch.float64)  # type: ignore[index]
    x, seen = _space([features[i] for i in live], labeled)  # type: ignore[misc]
    generator = torch.Generator().manual_seed(seed)
    count = min(count, len(live))
    randoms = round(share * count)
    chosen = torch.randperm(len(live), generator=generator)[:randoms].tolist()
    distance = torch.full((len(live),), math.inf, dtype=torch.float64)
    for point in [*seen, *(x[c] for c in chosen)]:
        distance = torch.minimum(distance, ((x - point) ** 2).sum(dim=1))
    while len(chosen) < count:
        reach = distance if torch.isfinite(distance).all() else torch.ones_like(distance)
        weight = u.clamp_min(1e-6) * reach
        weight[chosen] = 0.0
        if float(weight.sum()) <= 0.0:  # every text left sits on one picked: take them by uncertainty
            weight = u.clamp_min(1e-6).clone()
            weight[chosen] = 0.0
        c = int(torch.multinomial(weight, 1, generator=generator))
        chosen.append(c)
        distance = torch.minimum(distance, ((x - x[c]) ** 2).sum(dim=1))
    out = []
    for k, c in enumerate(chosen):
        path, mean = found[live[c]]  # type: ignore[misc]
        value = per_text[live[c]][path].value  # type: ignore[index]
        out.append(Picked(live[c], path, value, mean, k < randoms))
    return out


def _space(
    features: Sequence[torch.Tensor], labeled: Sequence[torch.Tensor]
) -> tuple[torch.Tensor, torch.Tensor]:
    """The texts' and the labeled texts' features standardised together and reduced to `DIMS`
    principal directions (fewer when there are fewer texts)."""
    every = torch.stack([*features, *labeled]).double()
    every = (every - every.mean(dim=0)) / every.std(dim=0, unbiased=False).clamp_min(1e-6)
    if min(every.shape) > DIMS:
        _, directions = torch.linalg.eigh(every.T @ every)  # ascending: the last are the principal
        every = every @ directions[:, -DIMS:]
    return every[: len(features)], every[len(features) :]


@dataclass(frozen=True)
class Suggestion:
    """A text worth labeling, ready to label: its current best guess as a label in the schema's JSON
    form (scored fields only), the line `pcd calibrate` reads once corrected."""

    text: str
    label: dict[str, Any]
    index: int
    field: str
    uncertainty: float
    sampled: bool = False

    def to_json(self) -> dict[str, Any]:
        return {
            "text": self.text,
            "label": self.label,
            "pcd": {
                "index": self.index,
                "field": self.field,
                "uncertainty": self.uncertainty,
                "sampled": self.sampled,
            },
        }


@dataclass
class LabelSuggestions:
    picked: list[Suggestion]
    errors: Mapping[int, Exception] = field(default_factory=dict)  # input index -> why it got no answer
