"""What a request returns: the validated object, per-field scores, and diagnostics."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any, Generic, TypeVar

from pydantic import BaseModel

from pcd_engine.schema import JSONScalar

T = TypeVar("T", bound=BaseModel)


@dataclass(frozen=True)
class FieldResult:
    """One scored decision.

    `probabilities` and `log_scores` are keyed by every allowed JSON value (str, int, bool or None);
    `margin` is the chosen value's probability minus the runner-up's. `rule` names the scoring rule
    used ("fixed" for a field with a single allowed value); `calibrated` is False while the
    probabilities are a plain softmax over scores.
    """

    path: str
    value: JSONScalar
    probabilities: dict[JSONScalar, float]
    log_scores: dict[JSONScalar, float]
    margin: float
    rule: str
    calibrated: bool = False
    source: str = "scored"

    @property
    def confidence(self) -> float:
        return self.probabilities[self.value]

    def to_json(self) -> dict[str, Any]:
        return {
            "value": self.value,
            "probabilities": {json_key(k): p for k, p in self.probabilities.items()},
            "margin": self.margin,
            "rule": self.rule,
        }


@dataclass(frozen=True)
class Diagnostics:
    prompt_tokens: int
    cached_tokens: int  # leading prompt tokens whose KV came from the prefix cache
    branch_tokens: int
    forward_calls: int
    timings_ms: dict[str, float] = field(default_factory=dict)


@dataclass(frozen=True)
class PCDResult(Generic[T]):
    """`value` is a validated instance of the schema; `fields` is keyed by dotted path."""

    value: T
    fields: dict[str, FieldResult]
    diagnostics: Diagnostics

    def to_json(self) -> dict[str, Any]:
        return {
            "value": self.value.model_dump(mode="json"),
            "fields": {path: f.to_json() for path, f in self.fields.items()},
        }


def json_key(value: JSONScalar) -> str:
    """A JSON object key for a candidate value: strings as they are, others as JSON (true, null, 3)."""
    return value if isinstance(value, str) else json.dumps(value)
