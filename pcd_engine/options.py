"""The per-call options of the engine's calls, written once.

`PlanOptions` choose a schema's plan (`engine.plan`, `calibrate`, `suggest_labels`); `ClassifyOptions`
add what one `classify` / `classify_batch` call may set for itself. `GenerateOptions` are those of
plain chat (`generate`, `stream`); `ToolPlanOptions` choose a tool decision's plan
(`tools.calibrate`) and `ToolCallOptions` add what one `tools.call` sets for itself. The public calls
take them as keyword arguments, `**options: Unpack[ClassifyOptions]`, so type checkers and editors see
every name and type, and an unknown name is refused as Python would refuse it. `RequestOptions` is the checked
record the pipeline reads, the engine's defaults filled in.

    >>> RequestOptions.of({"abstain_below": 0.7}, None).abstain_below
    0.7
    >>> RequestOptions.of({"abstain_belo": 0.7}, None)  # doctest: +ELLIPSIS
    Traceback (most recent call last):
    TypeError: unexpected keyword argument 'abstain_belo'; the options are abstain_below, ..., sampling
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any, TypedDict, cast

from pcd_engine.calibration import Calibration
from pcd_engine.conversation import joined
from pcd_engine.errors import CalibrationError
from pcd_engine.generate import Sampling, check_logprobs
from pcd_engine.grammars import Grammar
from pcd_engine.rules import Rule

ON_ABSTAIN = ("flag", "raise")


class PlanOptions(TypedDict, total=False):
    """What chooses a schema's plan; None or left out: the engine's default."""

    instructions: str | None  # the system instructions that head the field list
    rule: str | Rule | None  # how values are scored (rules.py)
    allow_generation: bool | None  # generate open fields (False: UnsupportedSchemaError for them)
    examples: Sequence[tuple[str, Any]] | None  # labeled (text, answer) pairs in the cached head


class ClassifyOptions(PlanOptions, total=False):
    """`PlanOptions`, and what one `classify` / `classify_batch` call sets for itself."""

    sampling: Sampling | None  # decoding of the open fields (default: the engine's, greedy)
    calibration: Calibration | None  # fitted for this schema, model and rule (`engine.calibrate`)
    abstain_below: float | None  # a field less confident than this is abstained (default: engine's)
    on_abstain: str  # "flag" (result.needs_review) or "raise" (AbstentionError carrying the result)
    logprobs: int | None  # record generated tokens' log-probabilities, with this many alternatives


class GenerateOptions(TypedDict, total=False):
    """What one `generate` / `stream` call sets; left out: the default in the comment."""

    max_tokens: int  # the longest answer, in tokens (512)
    stop: Sequence[str] | str | None  # strings that end the answer, not included (none)
    sampling: Sampling | None  # decoding (the engine's: greedy unless it was built otherwise)
    temperature: float  # these six override one field of `sampling` each
    top_p: float
    top_k: int
    min_p: float
    repetition_penalty: float
    seed: int | None
    json_object: bool  # the answer is one JSON object, any keys (False)
    grammar: Grammar | None  # the answer follows this regex, EBNF grammar or JSON schema (none)
    logprobs: int | None  # record each token's log-probability and this many alternatives (none)
    tools: Sequence[Any]  # shown to a template with a tool protocol; no call is decided (none)


SAMPLING_FIELDS = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty", "seed")


class ToolPlanOptions(TypedDict, total=False):
    """What chooses a tool decision's plan, beside the tools (`tools.call`, `tools.calibrate`)."""

    tool_choice: Any  # "auto" (default), "required", "none", or a tool's name as OpenAI writes it
    instructions: str | None  # go before the tool instructions (a conversation's system text first)
    rule: str | None  # how the decision and closed arguments are scored (the engine's)


class ToolCallOptions(ToolPlanOptions, total=False):
    """`ToolPlanOptions`, and what one `tools.call` sets for itself."""

    calibration: Calibration | None  # fitted on `tools.schema(tools, tool_choice)`
    abstain_below: float | None  # as in `classify`, for the decision and the scored arguments
    max_tokens: int  # the longest text answer or generated argument (512)
    sampling: Sampling | None  # decoding of a text answer and of open arguments (greedy)
    logprobs: int | None  # as in `generate`


def refuse_unknown(options: Mapping[str, Any], declared: Any, what: str) -> None:
    """TypeError for a keyword that the TypedDict `declared` does not name, as Python raises for an
    unknown keyword argument, listing the `what` it does name."""
    if unknown := sorted(set(options) - declared.__optional_keys__):
        names = ", ".join(sorted(declared.__optional_keys__))
        raise TypeError(f"unexpected keyword argument {unknown[0]!r}; the {what} are {names}")


@dataclass(frozen=True)
class RequestOptions:
    """A call's options, checked, with the engine's defaults filled in."""

    plan: PlanOptions = field(default_factory=lambda: PlanOptions())
    sampling: Sampling | None = None
    calibration: Calibration | None = None
    batch_calibration: bool = False  # classify_batch(calibrate="batch")
    abstain_below: float | None = None
    on_abstain: str = "flag"
    logprobs: int | None = None

    @classmethod
    def of(
        cls, options: Mapping[str, Any], abstain_below: float | None, batch_calibration: bool = False
    ) -> RequestOptions:
        """The checked options of a call (`abstain_below`: the engine's default threshold)."""
        refuse_unknown(options, ClassifyOptions, "options")
        planned = cast(PlanOptions, {k: v for k, v in options.items() if k in PlanOptions.__optional_keys__})
        own = {k: v for k, v in options.items() if k not in PlanOptions.__optional_keys__}
        if own.get("abstain_below") is None:
            own["abstain_below"] = abstain_below
        return cls(plan=planned, batch_calibration=batch_calibration, **own)

    def with_system(self, system: str | None) -> RequestOptions:
        """These options for inputs whose conversation has `system` text: it goes before the
        instructions (conversation.joined)."""
        if system is None:
            return self
        instructions = joined(system, self.plan.get("instructions"))
        return replace(self, plan=cast(PlanOptions, {**self.plan, "instructions": instructions}))

    def __post_init__(self) -> None:
        check_logprobs(self.logprobs)
        if self.abstain_below is not None and not 0.0 <= self.abstain_below <= 1.0:
            raise ValueError(f"abstain_below must be a probability in [0, 1], got {self.abstain_below!r}")
        if self.on_abstain not in ON_ABSTAIN:
            raise ValueError(f"on_abstain must be one of {ON_ABSTAIN}, got {self.on_abstain!r}")
        if self.calibration is not None and self.batch_calibration:
            raise CalibrationError("pass either a calibration or calibrate='batch', not both")
