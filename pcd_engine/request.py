"""One structured request on its way through the engine: rendered prompt, counters, fields, outcome.

`Request.render` checks an input and renders its prompt (InputError before any model work); the
pipeline's phases then fill in the request's fields, value or error, and `result()` turns it into the
`PCDResult` (or the error) the caller gets.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from pydantic import BaseModel, ValidationError

from pcd_engine.decisions import closed_value
from pcd_engine.errors import AbstentionError, InputError, PCDError, StructuredOutputError
from pcd_engine.hidden import HiddenStates
from pcd_engine.plan import SchemaPlan
from pcd_engine.prompt import ChatPrompt, Conversation, PromptIds, RawPrompt
from pcd_engine.results import Diagnostics, FieldResult, PCDResult, TokenLogprob
from pcd_engine.runner import PassStats
from pcd_engine.schema import Limits


def example_turns(
    schema: type[BaseModel], examples: Sequence[tuple[str, Any]]
) -> tuple[tuple[str, str], ...]:
    """Labeled examples as (text, answer JSON) turns; InputError for an example that is not a
    (str, object of the schema) pair. The answer is the validated object in the schema's JSON form."""
    turns = []
    for index, example in enumerate(examples):
        if not (isinstance(example, tuple | list) and len(example) == 2 and isinstance(example[0], str)):
            raise InputError(f"example #{index} must be a (text, answer) pair, got {example!r:.80}")
        text, answer = example
        try:
            value = answer if isinstance(answer, schema) else schema.model_validate(answer)
        except ValidationError as error:
            raise InputError(
                f"example #{index}: the answer is not a valid {schema.__name__}: {error}"
            ) from None
        dumped = value.model_dump(mode="json", by_alias=True)
        turns.append((text, json.dumps(dumped, ensure_ascii=False)))
    return tuple(turns)


@dataclass
class Request:
    text: str
    prompt: PromptIds
    started: float
    branch_tokens: int
    timings: dict[str, float] = field(default_factory=dict)
    stats: PassStats = field(default_factory=PassStats)
    fields: dict[str, FieldResult] = field(default_factory=dict)
    hidden: HiddenStates | None = None  # kept by the scoring pass when a head will read them
    variants: list[dict[str, FieldResult]] = field(default_factory=list)  # Pipeline.score(variants=)
    value: BaseModel | None = None
    error: PCDError | None = None
    generated_tokens: int = 0
    attempts: int = 0
    rescored: int = 0
    token_logprobs: tuple[TokenLogprob, ...] | None = None  # the open fields' generated tokens

    @classmethod
    def render(
        cls,
        prompt: ChatPrompt,
        plan: SchemaPlan,
        text: Any,
        limits: Limits,
        index: int | None = None,
        allow_empty: bool = False,
    ) -> Request:
        """The request for input `text` (number `index` of a batch), a str, a `Conversation` or a
        `RawPrompt` (for a plan of its layout); InputError if it cannot be one."""
        started = time.perf_counter()
        where = "text" if index is None else f"text #{index}"
        conversation = text if isinstance(text, Conversation) else None
        raw = text if isinstance(text, RawPrompt) else None
        if (raw.layout if raw is not None else "chat") != plan.layout:
            raise InputError(f"{where}: a batch is all raw prompts of one answer kind, or no raw prompt")
        if conversation is not None or raw is not None:
            text = text.text
        if not isinstance(text, str):
            kind = type(text).__name__
            raise InputError(f"{where} must be a str, a Conversation or a RawPrompt, got {kind}")
        if raw is not None and not text.strip():
            raise InputError(f"{where}: a raw prompt must not be empty")
        if not text.strip() and not allow_empty:
            raise InputError(
                f"{where} is empty or only whitespace; PCDEngine(allow_empty_text=True) allows it"
            )
        try:
            text.encode("utf-8")
        except UnicodeEncodeError as error:
            raise InputError(
                f"{where} is not valid Unicode: {error.reason} at character {error.start}"
            ) from None
        if raw is not None:
            ids = prompt.raw(plan.head, text)
        elif conversation is not None:
            ids = prompt.with_conversation(plan.head, plan.system, conversation, plan.tools)
        else:
            ids = prompt.with_head(plan.head, text)
        if len(ids) > limits.max_prompt_tokens:
            raise InputError(
                f"{where}: the prompt is {len(ids)} tokens, over the limit of "
                f"{limits.max_prompt_tokens} (Limits.max_prompt_tokens); shorten the text"
            )
        return cls(text, ids, started, plan.branch_tokens, {"render": elapsed_ms(started)})

    def validate_closed(self, plan: SchemaPlan) -> None:
        """The answer made of the scored fields alone (a model without open fields)."""
        try:
            self.value = closed_value(plan, self.fields)
        except StructuredOutputError as error:
            self.error = error

    def result(self, to_output: Callable[[BaseModel], Any]) -> PCDResult[Any] | PCDError:
        if self.error is not None:
            return self.error
        assert self.value is not None
        self.timings["total"] = elapsed_ms(self.started)
        diagnostics = Diagnostics(
            prompt_tokens=len(self.prompt),
            cached_tokens=self.stats.reused_tokens,
            branch_tokens=self.branch_tokens,
            forward_calls=self.stats.forward_calls,
            timings_ms=dict(self.timings),
            generated_tokens=self.generated_tokens,
            attempts=self.attempts,
            prefix_cache_hit=self.stats.cache_hit,
            rescored_fields=self.rescored,
        )
        return PCDResult(to_output(self.value), self.fields, diagnostics, self.token_logprobs)


def rendered(items: Sequence[Request | PCDError]) -> list[Request]:
    """The requests among a batch's items: the inputs that rendered, without the errors."""
    return [item for item in items if isinstance(item, Request)]


def in_order(
    items: Sequence[Request | PCDError],
    to_output: Callable[[BaseModel], Any],
    return_exceptions: bool,
    raise_on_abstain: bool = False,
) -> list[PCDResult[Any] | PCDError]:
    """One result or error per input, in order; without `return_exceptions` the first error raises.
    With `raise_on_abstain`, a result that needs review becomes an AbstentionError carrying it."""
    out: list[PCDResult[Any] | PCDError] = []
    for item in items:
        outcome = item if isinstance(item, PCDError) else item.result(to_output)
        if raise_on_abstain and isinstance(outcome, PCDResult) and outcome.needs_review:
            outcome = AbstentionError(outcome)
        if isinstance(outcome, PCDError) and not return_exceptions:
            raise outcome
        out.append(outcome)
    return out


def elapsed_ms(since: float) -> float:
    return (time.perf_counter() - since) * 1e3
