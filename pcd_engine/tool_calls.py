"""Tool calls on an engine: the decision scored, then the chosen tool's open arguments or a text answer.

`ToolCaller.call` reads the messages as a `Conversation` (conversation.py) and the engine renders it
after the decision schema's head as every door does (earlier calls and results in the template's tool
protocol, or in words where it has none). It scores the decision and the candidate tools' closed
arguments (`engine.classify`, so calibrations, heads and `abstain_below` apply as to any field; where
it pays, only the chosen tool's arguments are scored, in a second call on the first's KV: gates.py),
then generates
only the chosen tool's open arguments under its JSON schema (xgrammar) with the scored ones pinned,
and validates the whole against the tool's own argument schema; a text answer is plain generation.
`ToolCaller.calibrate` fits the decision from labeled conversations.

    >>> asked = [{"role": "user", "content": "Weather in Paris?"}]
    >>> result = engine.tools.call(asked, [weather])  # doctest: +SKIP
    >>> result.tool, result.arguments, result.probabilities  # doctest: +SKIP
    ('get_weather', {'city': 'Paris'}, {'get_weather': 0.93, None: 0.07})
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any, Protocol

from pydantic import BaseModel
from typing_extensions import Unpack

from pcd_engine.bounded_cache import BoundedCache
from pcd_engine.calibration import Calibration
from pcd_engine.conversation import Conversation, joined, new_call_id
from pcd_engine.errors import InputError, StructuredOutputError
from pcd_engine.generate import Sampling
from pcd_engine.options import (
    ClassifyOptions,
    GenerateOptions,
    PlanOptions,
    ToolCallOptions,
    ToolPlanOptions,
    refuse_unknown,
)
from pcd_engine.prompt import ChatPrompt, TextInput
from pcd_engine.results import FieldResult, Generation, PCDResult, TokenLogprob
from pcd_engine.tools import ToolArguments, ToolChoice, ToolPlan, as_tools, build_tool_plan, pinned_arguments

ARGUMENT_INSTRUCTIONS = (
    "The assistant calls the tool {name!r}{description}. Reply with one JSON object holding the "
    "arguments of the call, with the fields below."
)


@dataclass(frozen=True)
class ToolCallResult:
    """The answer of `engine.tools.call`: a tool call (`tool`, `arguments`) or a text answer
    (`tool` None, `text`).

    `decision` is the scored tool field (its values are the tool names and, where a text answer was
    allowed, `text_value`; None under tool_choice "none"); `probabilities` the same keyed by tool
    name, None for the text answer; `fields` the chosen tool's arguments by their own paths
    (scored ones with probabilities, generated ones without). `scoring` is the decision pass's whole
    result (diagnostics included); `logprobs` the generated tokens of the text or the open arguments,
    with `logprobs=`; `timings_ms` the scoring's and the generation's timings summed by phase (the
    keys of `Diagnostics.timings_ms` and of `Generation.timings_ms`)."""

    tool: str | None
    arguments: dict[str, Any] | None
    text: str | None
    decision: FieldResult | None
    fields: dict[str, FieldResult]
    finish_reason: str  # "tool_calls", "stop" or "length"
    prompt_tokens: int
    completion_tokens: int
    scoring: PCDResult[Any] | None = None
    logprobs: tuple[TokenLogprob, ...] | None = None
    text_value: str | None = None  # the decision's value that means a text answer
    call_id: str | None = None  # the call's id (conversation.new_call_id), None for a text answer
    timings_ms: dict[str, float] = field(default_factory=dict, compare=False)

    @property
    def probabilities(self) -> dict[str | None, float]:
        """Every allowed tool's probability (None: the text answer)."""
        if self.decision is None:
            return {None: 1.0}
        return {None if v == self.text_value else str(v): p for v, p in self.decision.probabilities.items()}

    @property
    def keyed_probabilities(self) -> dict[str, float]:
        """`probabilities` with JSON keys: the text answer as "" (no tool is named so)."""
        return {name if name is not None else "": p for name, p in self.probabilities.items()}

    @property
    def abstained_fields(self) -> list[str]:
        found = ["tool"] if self.decision is not None and self.decision.abstained else []
        return found + [p for p, f in self.fields.items() if f.abstained]

    @property
    def needs_review(self) -> bool:
        return bool(self.abstained_fields)

    def to_json(self) -> dict[str, Any]:
        """The decision and arguments with their probabilities, as the adapters publish them."""
        out: dict[str, Any] = {
            "tool": self.tool,
            "call_id": self.call_id,
            "probabilities": self.keyed_probabilities,
            "decision": self.decision.to_json() if self.decision is not None else None,
            "arguments": {path: f.to_json() for path, f in self.fields.items()},
            "abstained_fields": self.abstained_fields,
            "needs_review": self.needs_review,
        }
        if self.scoring is not None:
            d = self.scoring.diagnostics
            out.update(forward_calls=d.forward_calls, cached_tokens=d.cached_tokens)
        return out


class ToolEngine(Protocol):
    """What the tool caller uses of an engine (`PCDEngine` is one): its prompt and public calls."""

    prompt: ChatPrompt

    def classify(
        self, text: TextInput, schema: Any, **options: Unpack[ClassifyOptions]
    ) -> PCDResult[Any]: ...

    def calibrate(
        self,
        schema: Any,
        texts: Sequence[str | Conversation],
        labels: Sequence[Any] | None = None,
        *,
        method: str = "auto",
        folds: int = 5,
        **options: Unpack[PlanOptions],
    ) -> Calibration: ...

    def generate(self, messages: Any, **options: Unpack[GenerateOptions]) -> Generation: ...


class ToolCaller:
    """Tool calls on an engine, by composition (it uses the engine's public `classify` and
    `generate`); `engine.tools` is one. Plans are kept per (tools, choice) in a bounded cache.

        >>> engine.tools.call(messages, tools, tool_choice="required")  # doctest: +SKIP
    """

    def __init__(self, engine: ToolEngine, max_plans: int = 256) -> None:
        self.engine = engine
        self.plans: BoundedCache[str, ToolPlan] = BoundedCache(max_plans)

    def plan(self, tools: Sequence[Any], tool_choice: Any = "auto") -> ToolPlan:
        """The cached ToolPlan of these tools and this choice (InputError for bad ones)."""
        parsed = as_tools(tools)
        choice = ToolChoice.parse(tool_choice, parsed)
        key = json.dumps([[t.openai() for t in parsed], choice.mode, choice.name], sort_keys=True)
        return self.plans.get_or_build(
            key, lambda: build_tool_plan(parsed, choice, self.engine.prompt.supports_tools)
        )

    def schema(self, tools: Sequence[Any], tool_choice: Any = "auto") -> type[BaseModel]:
        """The decision schema (what `classify` scores for these tools, with the plan's
        `instructions`). Its labels, in its JSON form, are `{"tool": name}` (the plan's `text_value`
        for a text answer) with closed arguments under the tool's name; `calibrate` takes them in a
        friendlier form."""
        plan = self.plan(tools, tool_choice)
        if plan.schema is None:
            raise InputError('tool_choice "none" has no decision to score')
        return plan.schema

    def calibrate(
        self,
        tools: Sequence[Any],
        conversations: Sequence[Any],
        labels: Sequence[Any] | None = None,
        *,
        method: str = "auto",
        folds: int = 5,
        **options: Unpack[ToolPlanOptions],
    ) -> Calibration:
        """Fit a Calibration of the decision (and the scored arguments) for `call(...,
        calibration=...)`: each conversation a user's text or a list of messages, all with the same
        system text; each label a tool's name, None for a text answer, or `{"tool": ..., "arguments":
        {...}}`. `method`, `folds` and `rule` (default: the engine's) as in `engine.calibrate`; a
        calibration applies to calls with the same rule. The options are `ToolPlanOptions`."""
        refuse_unknown(options, ToolPlanOptions, "options")
        tool_choice = options.get("tool_choice", "auto")
        plan = self.plan(tools, tool_choice)
        if plan.schema is None or plan.forced is not None:
            raise InputError(f"tool_choice {tool_choice!r} leaves no decision to calibrate")
        inputs = [Conversation.of(item) for item in conversations]
        decided = [plan.label(label, n) for n, label in enumerate(labels)] if labels is not None else None
        asked = joined(options.get("instructions"), plan.instructions)
        rule = options.get("rule")
        return self.engine.calibrate(
            plan.schema, inputs, decided, method=method, folds=folds, instructions=asked, rule=rule
        )

    def call(
        self,
        messages: Any,
        tools: Sequence[Any],
        **options: Unpack[ToolCallOptions],
    ) -> ToolCallResult:
        """Decide the next step of a conversation: a call of one of `tools` (OpenAI entries, bare
        function dicts or `Tool`s) or a text answer, as `tool_choice` allows. The decision and the
        candidate tools' closed arguments are scored (only the chosen tool's, after the decision,
        where the plan gates them: gates.py); the chosen tool's open arguments are then generated
        under its schema; a text answer is generated as plain chat.
        `instructions` go before the tool instructions (the messages' system text before both);
        `calibration` (fitted on `schema(tools, tool_choice)`) and `abstain_below` apply to the
        decision and the scored arguments; `rule` scores them (default: the engine's). A choice that
        leaves one tool ("required" with one tool, or a tool's name) is that tool's structured
        output: `classify` on its arguments. The options are `ToolCallOptions`."""
        refuse_unknown(options, ToolCallOptions, "options")
        instructions, rule = options.get("instructions"), options.get("rule")
        abstain_below, sampling = options.get("abstain_below"), options.get("sampling")
        logprobs, max_tokens = options.get("logprobs"), options.get("max_tokens", 512)
        plan = self.plan(tools, options.get("tool_choice", "auto"))
        conversation = Conversation.of(messages)
        if plan.schema is None:
            return self._text(conversation, plan, None, max_tokens, sampling, logprobs)
        forced = plan.arguments[plan.forced] if plan.forced is not None else None
        if forced is not None and not forced.model.model_fields:  # nothing to ask: no arguments
            return _forced_call(forced, None)
        if forced is not None:  # one tool that must be called: its arguments are the answer
            result = self.engine.classify(
                conversation,
                forced.model,
                instructions=instructions,
                rule=rule,
                abstain_below=abstain_below,
                sampling=sampling,
                logprobs=logprobs,
            )
            return _forced_call(forced, result)
        asked = joined(instructions, plan.instructions)
        scored = self.engine.classify(
            conversation,
            plan.schema,
            instructions=asked,
            rule=rule,
            allow_generation=False,
            calibration=options.get("calibration"),
            abstain_below=abstain_below,
        )
        decision = scored.fields["tool"]
        value = scored.value.model_dump(mode="json", by_alias=True)
        name = plan.tool_of(value[plan.key])
        if name is None:
            return self._text(conversation, plan, scored, max_tokens, sampling, logprobs)
        a = plan.arguments[name]
        fields = {
            p.split(".", 1)[1]: replace(f, path=p.split(".", 1)[1])
            for p, f in scored.fields.items()
            if p.startswith(f"{a.field}.")
        }
        nested = getattr(scored.value, a.field) if a.field else None
        closed = {n: getattr(nested, n) for n in a.closed} if nested is not None else {}
        generated = self._open_arguments(a, closed, instructions, conversation, sampling, logprobs)
        tokens, used = None, 0
        if generated is None:  # the scored arguments in their JSON form (an Enum as its value)
            scored_json = nested.model_dump(mode="json", by_alias=True) if nested is not None else {}
            arguments = _validated(a, scored_json)
        else:
            arguments = _without_nulls(a, generated.value.model_dump(mode="json", by_alias=True))
            fields.update({p: f for p, f in generated.fields.items() if f.source == "generated"})
            tokens, used = generated.token_logprobs, generated.diagnostics.generated_tokens
        prompt_tokens = scored.diagnostics.prompt_tokens
        return ToolCallResult(
            name,
            arguments,
            None,
            decision,
            fields,
            "tool_calls",
            prompt_tokens,
            used,
            scored,
            tokens,
            plan.text_value,
            new_call_id(),
            summed(scored, generated),
        )

    def _open_arguments(
        self,
        a: ToolArguments,
        closed: Mapping[str, Any],
        instructions: str | None,
        conversation: Conversation,
        sampling: Sampling | None,
        logprobs: int | None,
    ) -> PCDResult[Any] | None:
        """The chosen tool's open arguments generated with the scored ones pinned (None: it has
        none)."""
        if len(a.closed) == len(a.model.model_fields):
            return None
        description = f" ({a.tool.description.strip()})" if a.tool.description.strip() else ""
        asked = ARGUMENT_INSTRUCTIONS.format(name=a.tool.name, description=description)
        return self.engine.classify(
            conversation,
            pinned_arguments(a, closed) if closed else a.model,
            instructions=joined(instructions, asked),
            sampling=sampling,
            logprobs=logprobs,
        )

    def _text(
        self,
        conversation: Conversation,
        plan: ToolPlan,
        scored: PCDResult[Any] | None,
        max_tokens: int,
        sampling: Sampling | None,
        logprobs: int | None,
    ) -> ToolCallResult:
        generation = self.engine.generate(
            conversation,
            max_tokens=max_tokens,
            sampling=sampling,
            logprobs=logprobs,
            tools=plan.choice.allowed(plan.tools),
        )
        return ToolCallResult(
            None,
            None,
            generation.text,
            scored.fields["tool"] if scored is not None else None,
            {},
            generation.finish_reason,
            generation.prompt_tokens,
            generation.completion_tokens,
            scored,
            generation.logprobs,
            plan.text_value,
            timings_ms=summed(scored, generation),
        )


def _forced_call(a: ToolArguments, result: PCDResult[Any] | None) -> ToolCallResult:
    """A call that must name one tool is that tool's structured output: `classify` on its argument
    model with the caller's own instructions, what `with_structured_output` asks (`result`; None
    for a tool without arguments). There is no decision to score (nor to calibrate): the tool
    field is fixed."""
    name = a.tool.name
    decision = FieldResult("tool", name, {name: 1.0}, {name: 0.0}, 1.0, "fixed")
    if result is None:  # no model work: no prompt tokens processed
        return ToolCallResult(name, {}, None, decision, {}, "tool_calls", 0, 0, call_id=new_call_id())
    arguments = _without_nulls(a, result.value.model_dump(mode="json", by_alias=True))
    d = result.diagnostics
    return ToolCallResult(
        name,
        arguments,
        None,
        decision,
        dict(result.fields),
        "tool_calls",
        d.prompt_tokens,
        d.generated_tokens,
        result,
        result.token_logprobs,
        call_id=new_call_id(),
        timings_ms=summed(result),
    )


def summed(*answers: PCDResult[Any] | Generation | None) -> dict[str, float]:
    """The answers' timings added up by key (a scoring pass's `Diagnostics.timings_ms`, a
    generation's `timings_ms`)."""
    out: dict[str, float] = {}
    for answer in answers:
        if answer is None:
            continue
        timings = answer.diagnostics.timings_ms if isinstance(answer, PCDResult) else answer.timings_ms
        for key, ms in timings.items():
            out[key] = out.get(key, 0.0) + ms
    return out


def _validated(a: ToolArguments, arguments: dict[str, Any]) -> dict[str, Any]:
    """Scored arguments checked against the tool's own argument schema (optional ones left out
    where scored null)."""
    arguments = _without_nulls(a, arguments)
    try:
        a.model.model_validate(arguments)
    except Exception as error:
        message = f"the arguments of {a.tool.name!r} failed validation"
        raise StructuredOutputError(message, json.dumps(arguments), error) from error
    return arguments


def _without_nulls(a: ToolArguments, arguments: Mapping[str, Any]) -> dict[str, Any]:
    """The arguments less the optional ones answered null (left out, as a caller would)."""
    required = set(a.tool.parameters.get("required") or ())
    return {k: v for k, v in arguments.items() if v is not None or k in required}


__all__ = ["ToolCallResult", "ToolCaller"]
