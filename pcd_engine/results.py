"""What a request returns: the validated object, per-field scores, and diagnostics."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any, Generic, TypeVar

from pydantic import BaseModel

from pcd_engine.schema import JSONScalar

T = TypeVar("T")


@dataclass(frozen=True)
class FieldResult:
    """One field of the answer: a scored decision, or a generated open field.

    For a scored field (`source == "scored"`), `probabilities` and `log_scores` are keyed by every
    allowed JSON value (str, int, bool or None); `margin` is the chosen value's probability minus the
    runner-up's; `rule` names the scoring rule ("fixed" for a field with a single allowed value);
    `calibrated` is False while the probabilities are a plain softmax over scores. A generated field
    (`source == "generated"`) has its value (any JSON value) and no scores.
    """

    path: str
    value: Any
    probabilities: dict[JSONScalar, float]
    log_scores: dict[JSONScalar, float]
    margin: float | None
    rule: str
    calibrated: bool = False
    source: str = "scored"
    rescored: bool = False  # decided on the FP32 reference model (its margin was below the threshold)

    @classmethod
    def generated(cls, path: str, value: Any) -> FieldResult:
        return cls(path, value, {}, {}, None, "generated", source="generated")

    @property
    def confidence(self) -> float | None:
        """The chosen value's probability; None for a generated field."""
        return self.probabilities[self.value] if self.source == "scored" else None

    def to_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {"value": self.value, "source": self.source}
        if self.source == "scored":
            out["probabilities"] = {json_key(k): p for k, p in self.probabilities.items()}
            out["margin"] = self.margin
            out["rule"] = self.rule
            out["rescored"] = self.rescored
        return out


@dataclass(frozen=True)
class Diagnostics:
    prompt_tokens: int
    cached_tokens: int  # leading prompt tokens whose KV came from the prefix cache
    branch_tokens: int
    forward_calls: int
    timings_ms: dict[str, float] = field(default_factory=dict)
    generated_tokens: int = 0  # decoding steps of constrained generation (open fields)
    attempts: int = 0  # generations run for open fields: 1, or 2 after a retry
    prefix_cache_hit: bool | None = None  # the schema's prompt head came from the cache (None: off)
    rescored_fields: int = 0  # close calls scored again on the FP32 reference model


@dataclass(frozen=True)
class Generation:
    """The answer of `PCDEngine.generate`: text, why it ended, token counts."""

    text: str
    finish_reason: str  # "stop" or "length"
    prompt_tokens: int
    completion_tokens: int


@dataclass(frozen=True)
class GenerationChunk:
    """One piece of `PCDEngine.stream`; the last has the finish reason and the token counts."""

    text: str
    finish_reason: str | None = None
    prompt_tokens: int | None = None
    completion_tokens: int | None = None


@dataclass(frozen=True)
class PCDResult(Generic[T]):
    """`value` is a validated instance of the schema (a dict for TypedDict and JSON-schema inputs);
    `fields` is keyed by dotted path."""

    value: T
    fields: dict[str, FieldResult]
    diagnostics: Diagnostics

    def to_json(self) -> dict[str, Any]:
        return {
            "value": self.value.model_dump(mode="json") if isinstance(self.value, BaseModel) else self.value,
            "fields": {path: f.to_json() for path, f in self.fields.items()},
        }


def json_key(value: JSONScalar) -> str:
    """A JSON object key for a candidate value: strings as they are, others as JSON (true, null, 3)."""
    return value if isinstance(value, str) else json.dumps(value)
