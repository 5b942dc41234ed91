"""What a request returns: the validated object, per-field scores, and diagnostics."""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Generic, TypeVar

from pydantic import BaseModel

from pcd_engine.schema import JSONScalar

if TYPE_CHECKING:
    from pcd_engine.rules import Scores

T = TypeVar("T")


@dataclass(frozen=True)
class FieldResult:
    """One field of the answer: a scored decision, or a generated open field.

    For a scored field (`source == "scored"`), `probabilities` and `log_scores` are keyed by every
    allowed JSON value (str, int, bool or None); `margin` is the chosen value's probability minus the
    runner-up's; `rule` names the scoring rule ("fixed" for a field with a single allowed value).
    `log_scores` are always the rule's own scores (the content-free prior subtracted where the rule
    does that), and `raw_probabilities` their softmax. `probabilities` are those, or, when a
    calibration was applied (`calibration` names its method: "bias", "temperature", "batch", "none"),
    the calibrated ones, and `value` is then their most probable value; `calibrated` is True when
    they differ from the raw ones' method. `abstained` marks a field whose confidence was below the
    request's `abstain_below`. A shortlisted field (rule "...+topN") lists in `shortlist` the values
    its second pass scored exactly; the others' scores are estimates and the answer is never one of
    them. A generated field (`source == "generated"`) has its value (any JSON
    value) and no scores.
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
    calibration: str | None = None  # the method of the calibration applied, None if none was
    abstained: bool = False  # confidence below the request's abstain_below: review this field
    shortlist: tuple[JSONScalar, ...] | None = None  # values scored exactly (shortlist.py); None: all

    @classmethod
    def scored(cls, path: str, values: Sequence[JSONScalar], scores: Scores, rule: str) -> FieldResult:
        """A scored field from a rule's scores over `values` (in candidate order)."""
        probabilities, chosen = scores.probabilities, scores.chosen
        runner_up = max(p for i, p in enumerate(probabilities) if i != chosen)
        return cls(
            path,
            values[chosen],
            dict(zip(values, probabilities, strict=True)),
            dict(zip(values, scores.log_scores, strict=True)),
            probabilities[chosen] - runner_up,
            rule,
        )

    @classmethod
    def generated(cls, path: str, value: Any) -> FieldResult:
        return cls(path, value, {}, {}, None, "generated", source="generated")

    @property
    def confidence(self) -> float | None:
        """The chosen value's probability; None for a generated field."""
        return self.probabilities[self.value] if self.source == "scored" else None

    @property
    def raw_probabilities(self) -> dict[JSONScalar, float]:
        """The rule's own probabilities (a softmax over `log_scores`), before any calibration."""
        if not self.log_scores:
            return {}
        top = max(self.log_scores.values())
        weights = {k: math.exp(s - top) for k, s in self.log_scores.items()}
        total = sum(weights.values())
        return {k: w / total for k, w in weights.items()}

    def to_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {"value": self.value, "source": self.source}
        if self.source == "scored":
            out["probabilities"] = {json_key(k): p for k, p in self.probabilities.items()}
            out["margin"] = self.margin
            out["rule"] = self.rule
            out["rescored"] = self.rescored
            out["calibration"] = self.calibration
            out["abstained"] = self.abstained
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
class TokenLogprob:
    """One generated token: its text, its log-probability, and the `top` most probable tokens at its
    position (text, log-probability), most probable first. The distribution is the model's after the
    grammar mask and repetition penalty, before temperature and top-p: the one greedy decoding takes
    its maximum from. A token that ends inside a multi-byte character decodes to U+FFFD."""

    token: str
    logprob: float
    top: tuple[tuple[str, float], ...] = ()


@dataclass(frozen=True)
class Generation:
    """The answer of `PCDEngine.generate`: text, why it ended, token counts, each token's
    log-probability when asked for (`logprobs=`), and where the time went: `timings_ms` "prefill"
    (the prompt, up to the first token) and "decode" (the other tokens)."""

    text: str
    finish_reason: str  # "stop" or "length"
    prompt_tokens: int
    completion_tokens: int
    logprobs: tuple[TokenLogprob, ...] | None = None
    timings_ms: dict[str, float] = field(default_factory=dict, compare=False)  # not the answer


@dataclass(frozen=True)
class GenerationChunk:
    """One piece of `PCDEngine.stream`; the last has the finish reason, the token counts and the
    timings (as `Generation`'s). With `logprobs=`, each chunk carries the tokens decoded since the
    previous one (their texts together are the stream's text, up to a stop string)."""

    text: str
    finish_reason: str | None = None
    prompt_tokens: int | None = None
    completion_tokens: int | None = None
    logprobs: tuple[TokenLogprob, ...] | None = None
    timings_ms: dict[str, float] | None = field(default=None, compare=False)


@dataclass(frozen=True)
class PCDResult(Generic[T]):
    """`value` is a validated instance of the schema (a dict for TypedDict and JSON-schema inputs);
    `fields` is keyed by dotted path. With `logprobs=`, `token_logprobs` holds the tokens generated
    for the open fields (the JSON text after the scored values; empty when nothing was generated)."""

    value: T
    fields: dict[str, FieldResult]
    diagnostics: Diagnostics
    token_logprobs: tuple[TokenLogprob, ...] | None = None  # generated tokens, with `logprobs=`

    @property
    def abstained_fields(self) -> list[str]:
        """Paths of the fields whose confidence was below the request's `abstain_below`."""
        return [path for path, f in self.fields.items() if f.abstained]

    @property
    def needs_review(self) -> bool:
        return any(f.abstained for f in self.fields.values())

    def to_json(self) -> dict[str, Any]:
        return {
            "value": (
                self.value.model_dump(mode="json", by_alias=True)
                if isinstance(self.value, BaseModel)
                else self.value
            ),
            "fields": {path: f.to_json() for path, f in self.fields.items()},
            "needs_review": self.needs_review,
            "abstained_fields": self.abstained_fields,
        }


def json_key(value: JSONScalar) -> str:
    """A JSON object key for a candidate value: strings as they are, others as JSON (true, null, 3)."""
    return value if isinstance(value, str) else json.dumps(value)
