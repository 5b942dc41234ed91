"""Which texts to label next: the least certain answers, spread over the predicted values.

A text's uncertainty is that of its least certain scored field: the lowest margin (chosen value's
probability minus the runner-up's), or with `by="entropy"` the highest entropy divided by the log of
the field's number of values. Texts are grouped by (that field, its predicted value); the groups
take turns, each giving its most uncertain text, so that one value does not take every slot.

    >>> picked = pick_uncertain(per_text_fields, count=50)  # doctest: +SKIP
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from pcd_engine.results import FieldResult
from pcd_engine.schema import JSONScalar

MEASURES = ("margin", "entropy")


@dataclass(frozen=True)
class Uncertain:
    index: int  # the text's position in the input
    field: str  # its least certain field
    value: JSONScalar  # that field's predicted value
    uncertainty: float  # higher: less certain (1 - margin, or the normalised entropy)


def uncertainty(fields: Mapping[str, FieldResult], by: str = "margin") -> tuple[str, float] | None:
    """(least certain field, its uncertainty) over the scored fields; None if none is scored."""
    scored = [f for f in fields.values() if f.source == "scored" and f.rule != "fixed"]
    if not scored:
        return None

    def of(f: FieldResult) -> float:
        if by == "margin":
            return 1.0 - (f.margin or 0.0)
        entropy = -sum(p * math.log(p) for p in f.probabilities.values() if p > 0)
        return entropy / math.log(len(f.probabilities))

    worst = max(scored, key=of)
    return worst.path, of(worst)


def check_suggest(count: int, by: str) -> None:
    """ValueError for a count or measure `pick_uncertain` cannot use (run before any text is scored)."""
    if by not in MEASURES:
        raise ValueError(f"by must be one of {MEASURES}, got {by!r}")
    if isinstance(count, bool) or not isinstance(count, int) or count < 1:
        raise ValueError(f"count must be an int of at least 1, got {count!r}")


def pick_uncertain(
    per_text: Sequence[Mapping[str, FieldResult] | None], count: int, by: str = "margin"
) -> list[Uncertain]:
    """Up to `count` texts (None: a text with no answer, never picked), least certain first within
    each (field, predicted value) group, the groups taking turns in order of their least certain text."""
    check_suggest(count, by)
    groups: dict[tuple[str, str], list[Uncertain]] = {}
    for index, fields in enumerate(per_text):
        found = uncertainty(fields, by) if fields is not None else None
        if found is None:
            continue
        path, u = found
        value = fields[path].value  # type: ignore[index]
        groups.setdefault((path, repr(value)), []).append(Uncertain(index, path, value, u))
    queues = sorted(
        (sorted(g, key=lambda c: (-c.uncertainty, c.index)) for g in groups.values()),
        key=lambda g: (-g[0].uncertainty, g[0].index),
    )
    picked: list[Uncertain] = []
    depth = 0
    while len(picked) < count and any(depth < len(q) for q in queues):
        for queue in queues:
            if depth < len(queue) and len(picked) < count:
                picked.append(queue[depth])
        depth += 1
    return picked


@dataclass(frozen=True)
class Suggestion:
    """A text worth labeling, ready to label: its current best guess as a label in the schema's JSON
    form (scored fields only), the line `pcd calibrate` reads once corrected."""

    text: str
    label: dict[str, Any]
    index: int
    field: str
    uncertainty: float

    def to_json(self) -> dict[str, Any]:
        return {
            "text": self.text,
            "label": self.label,
            "pcd": {"index": self.index, "field": self.field, "uncertainty": self.uncertainty},
        }


@dataclass
class LabelSuggestions:
    picked: list[Suggestion]
    errors: Mapping[int, Exception] = field(default_factory=dict)  # input index -> why it got no answer
