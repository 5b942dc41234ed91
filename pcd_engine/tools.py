"""Tool calls: which tool to call, or a text answer, is one more closed field.

A call is a structured answer whose first field is closed. For a set of tools and a `tool_choice`, a
decision schema is built once (`ToolPlan`):

    {"tool": "get_weather" | "search" | "respond_to_user",    the last: a text answer ("auto" only)
     "get_weather": {"unit": "c" | "f"},             each tool's closed arguments, under its name
     ...}

and scored like any schema, in one packed pass after the conversation: the decision and the closed
arguments of every candidate tool, each argument's branch under its own tool's name. Calibrations,
heads and `abstain_below` apply to it as to any field (`engine.tools.schema(...)` is what
`engine.calibrate` fits). Then only the chosen tool's open arguments are generated under its JSON
schema (xgrammar), with the scored ones pinned, and the whole is validated against the tool's own
argument schema; a text answer is plain generation.

A template with a tool protocol (`ChatPrompt.supports_tools`) renders the tool definitions in the
system turn itself; elsewhere the decision schema's description lists them. Earlier calls in the
conversation are written in the wording the branches continue (`call_text`), tool results in the
template's `tool` role.

>>> caller = engine.tools  # doctest: +SKIP
>>> result = caller.call([{"role": "user", "content": "Weather in Paris?"}], [weather_tool])  # doctest: +SKIP
>>> result.tool, result.arguments, result.probabilities  # doctest: +SKIP
('get_weather', {'city': 'Paris'}, {'get_weather': 0.93, None: 0.07})
"""

from __future__ import annotations

import json
import re
import threading
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any, ClassVar, Literal

from pydantic import BaseModel, Field, create_model

from pcd_engine.calibration import Calibration
from pcd_engine.errors import InputError, PCDError, StructuredOutputError
from pcd_engine.generate import Sampling
from pcd_engine.output_types import output_type
from pcd_engine.prompt import Conversation
from pcd_engine.results import FieldResult, PCDResult, TokenLogprob
from pcd_engine.schema import compile_schema

if TYPE_CHECKING:
    from pcd_engine.engine import PCDEngine

TOOL_CHOICES = ("auto", "required", "none")
NAME = re.compile(r"^[A-Za-z0-9_.:-]{1,64}$")
DECISION_KEYS = ("tool", "tool_name", "function", "pcd_tool")  # the first no tool is named
# The decision's value for a text answer, the first that no tool is named. A word the model reads
# beside the tool names: on SmolLM2, null was chosen for 1 of 5 text answers, this for 5 of 5.
TEXT_ANSWERS = ("respond_to_user", "reply_to_user", "answer_in_text")
INSTRUCTIONS = (
    "Decide the assistant's next step in the conversation: call one of the tools{listed}{or_text}. "
    "Reply with one JSON object with the fields below, choosing each value only from the allowed ones. "
    "Fill the arguments of the tool you call; the other tools' arguments are ignored."
)
ARGUMENT_INSTRUCTIONS = (
    "The assistant calls the tool {name!r}{description}. Reply with one JSON object holding the "
    "arguments of the call, with the fields below."
)


@dataclass(frozen=True)
class Tool:
    """A function the model may call: its name, what it does, and its arguments' JSON schema;
    `model`, where the arguments are a Pydantic class, validates them (else one is built from
    `parameters`)."""

    name: str
    description: str = ""
    parameters: Mapping[str, Any] = field(default_factory=lambda: {"type": "object", "properties": {}})
    model: type[BaseModel] | None = field(default=None, compare=False)

    def openai(self) -> dict[str, Any]:
        """The tool as an OpenAI `tools` entry (what chat templates with a tool protocol read)."""
        function = {"name": self.name, "description": self.description, "parameters": dict(self.parameters)}
        return {"type": "function", "function": function}


def as_tool(spec: Any) -> Tool:
    """A Tool from a Tool, a Pydantic class (its name, docstring and fields), an OpenAI `tools`
    entry (`{"type": "function", "function": {...}}`) or a bare function definition (`{"name",
    "description", "parameters"}`); InputError otherwise."""
    if isinstance(spec, Tool):
        tool = spec
    elif isinstance(spec, type) and issubclass(spec, BaseModel):
        parameters = spec.model_json_schema()
        parameters.pop("title", None)
        description = str(parameters.pop("description", "") or "")
        tool = Tool(spec.__name__, description, parameters, spec)
    else:
        if not isinstance(spec, Mapping):
            raise InputError(f"a tool must be a dict or a Tool, got {type(spec).__name__}")
        if spec.get("type", "function") != "function":
            raise InputError(f"tools of type {spec.get('type')!r} are not supported; only 'function'")
        function = spec.get("function", spec)
        if not isinstance(function, Mapping) or not isinstance(function.get("name"), str):
            raise InputError("a tool needs a 'name' (in 'function' for OpenAI tools entries)")
        parameters = function.get("parameters") or {"type": "object", "properties": {}}
        tool = Tool(function["name"], str(function.get("description") or ""), parameters)
    if not NAME.match(tool.name):
        raise InputError(f"tool name {tool.name!r} must be 1-64 letters, digits, '_', '-', '.' or ':'")
    if not isinstance(tool.parameters, Mapping) or tool.parameters.get("type", "object") != "object":
        raise InputError(f"tool {tool.name!r}: parameters must be a JSON schema of type 'object'")
    return tool


def as_tools(specs: Sequence[Any]) -> tuple[Tool, ...]:
    if isinstance(specs, (str, bytes, Mapping)) or not isinstance(specs, Sequence):
        raise InputError("tools must be a list of tool definitions")
    tools = tuple(as_tool(s) for s in specs)
    names = [t.name for t in tools]
    if len(set(names)) != len(names):
        raise InputError(f"tool names must be unique, got {names}")
    return tools


@dataclass(frozen=True)
class ToolChoice:
    """`mode`: "auto" (a tool or a text answer), "required" (some tool), "none" (text only) or
    "named" (that tool, `name`)."""

    mode: str
    name: str | None = None

    @classmethod
    def parse(cls, value: Any, tools: Sequence[Tool]) -> ToolChoice:
        """From OpenAI's and LangChain's forms: None/"auto", "none", "required"/"any"/True, a tool's
        name, `{"type": "function", "function": {"name": ...}}` or `{"name": ...}`."""
        names = [t.name for t in tools]
        if value is None or value == "auto":
            return cls("auto" if tools else "none")
        if value in ("required", "any") or value is True:
            chosen = cls("required")
        elif value == "none" or value is False:
            return cls("none")
        elif isinstance(value, str):
            chosen = cls("named", value)
        elif isinstance(value, Mapping):
            function = value.get("function", value)
            name = function.get("name") if isinstance(function, Mapping) else None
            if not isinstance(name, str):
                raise InputError(f"tool_choice {value!r} names no function")
            chosen = cls("named", name)
        else:
            raise InputError(f"tool_choice must be 'auto', 'none', 'required' or a tool, got {value!r}")
        if not tools:
            raise InputError(f"tool_choice {value!r} asks for a tool call, but no tools were given")
        if chosen.name is not None and chosen.name not in names:
            raise InputError(f"tool_choice names {chosen.name!r}, which is not among the tools {names}")
        return chosen

    def allowed(self, tools: Sequence[Tool]) -> tuple[Tool, ...]:
        if self.mode == "none":
            return ()
        return tuple(t for t in tools if self.name is None or t.name == self.name)


@dataclass(frozen=True)
class ToolArguments:
    """A tool's argument model, split into the arguments scored in the decision pass (closed: every
    leaf under a top-level argument is a closed choice) and those generated after it."""

    tool: Tool
    model: type[BaseModel]
    closed: tuple[str, ...]  # top-level field names of `model`
    field: str | None  # the decision model's field holding them (None: nothing to score)

    def keys(self) -> dict[str, str]:
        """Field name -> JSON key of the closed arguments."""
        fields = self.model.model_fields
        return {n: a if isinstance(a := fields[n].alias, str) else n for n in self.closed}


class ToolDecision(BaseModel):
    """Base of the decision models: they carry their tools for templates with a tool protocol."""

    pcd_tools: ClassVar[tuple[dict[str, Any], ...]] = ()


@dataclass(frozen=True)
class ToolPlan:
    """What a (tools, tool_choice) pair needs, built once: the decision schema and each allowed
    tool's arguments."""

    tools: tuple[Tool, ...]
    choice: ToolChoice
    key: str  # the decision's JSON key
    schema: type[BaseModel] | None  # None under tool_choice "none"
    arguments: dict[str, ToolArguments]
    instructions: str = ""  # the decision's system instructions
    text_value: str | None = None  # the decision's value for a text answer (None: not allowed)

    @property
    def forced(self) -> str | None:
        """The one tool a call must name ("required" with one tool, or a named choice)."""
        if self.choice.mode == "named" or (self.choice.mode == "required" and len(self.arguments) == 1):
            return next(iter(self.arguments))
        return None

    def tool_of(self, value: str) -> str | None:
        """The tool a decision value names (None: the text answer)."""
        return None if value == self.text_value else value

    def call_text(self, name: str, arguments: Mapping[str, Any]) -> str:
        """An earlier call as the assistant's turn, in the wording the decision's branches continue."""
        return json.dumps({self.key: name, name: dict(arguments)}, ensure_ascii=False)


def build_tool_plan(tools: Sequence[Tool], choice: ToolChoice, in_template: bool) -> ToolPlan:
    taken = {t.name for t in tools}
    key = next(k for k in DECISION_KEYS if k not in taken)
    allowed = choice.allowed(tools)
    arguments = {t.name: _arguments(t, n) for n, t in enumerate(allowed)}
    if not allowed:
        return ToolPlan(tuple(tools), choice, key, None, arguments)
    text = next(v for v in TEXT_ANSWERS if v not in taken) if choice.mode == "auto" else None
    values: Any = Literal.__getitem__((*(t.name for t in allowed), *([text] if text else [])))  # type: ignore[attr-defined]
    said = f", or {text!r} to answer the user in text" if text else ""
    fields: dict[str, Any] = {"tool": (values, Field(alias=key, description=f"The tool to call{said}."))}
    for a in arguments.values():
        if a.field is not None:
            source = a.model.model_fields
            closed = {n: (source[n].annotation, source[n]) for n in a.closed}
            nested = create_model(f"Arguments{a.field}", **closed)  # type: ignore[call-overload]
            fields[a.field] = (nested, Field(alias=a.tool.name, description=None))
    listed = "" if in_template else " listed below"
    or_text = f', or answer the user in text ("{key}": "{text}")' if text else ""
    doc = None if in_template else "Tools:\n" + "\n".join(_tool_line(t) for t in allowed)
    schema = create_model("ToolCall", __base__=ToolDecision, __doc__=doc, **fields)
    schema.pcd_tools = tuple(t.openai() for t in allowed)
    instructions = INSTRUCTIONS.format(listed=listed, or_text=or_text)
    return ToolPlan(tuple(tools), choice, key, schema, arguments, instructions, text)


def _arguments(tool: Tool, index: int) -> ToolArguments:
    try:
        model = tool.model or output_type(dict(tool.parameters)).model
        if not model.model_fields:  # a tool without arguments
            return ToolArguments(tool, model, (), None)
        compiled = compile_schema(model, allow_open=True)
    except PCDError as error:
        raise InputError(f"tool {tool.name!r}: its parameters cannot be used: {error}") from error
    opened = {f.path.split(".")[0] for f in compiled.open_fields}
    scored = {f.path.split(".")[0] for f in compiled.fields}
    closed = tuple(n for n in model.model_fields if n in scored and n not in opened)
    return ToolArguments(tool, model, closed, f"tool_{index}" if closed else None)


def _tool_line(tool: Tool) -> str:
    line = f"- {tool.name}" + (f": {tool.description.strip()}" if tool.description.strip() else "")
    properties = tool.parameters.get("properties") or {}
    if properties:
        line += " Arguments: " + json.dumps(properties, ensure_ascii=False)
    return line


def pinned_arguments(a: ToolArguments, closed: Mapping[str, Any]) -> type[BaseModel]:
    """The tool's argument model with the scored arguments fixed to their values (single-value
    fields are not scored again): what the open arguments are generated under."""
    fields: dict[str, Any] = {}
    for name, value in closed.items():
        info = a.model.model_fields[name]
        fixed: Any = Literal.__getitem__(value)  # type: ignore[attr-defined]
        fields[name] = (fixed, Field(value, alias=info.alias, description=info.description))
    return create_model(f"Call{a.field}", __base__=a.model, __doc__=None, **fields)  # type: ignore[call-overload]


@dataclass(frozen=True)
class ToolCallResult:
    """The answer of `engine.tools.call`: a tool call (`tool`, `arguments`) or a text answer
    (`tool` None, `text`).

    `decision` is the scored tool field (its values are the tool names and, where a text answer was
    allowed, `text_value`; None under tool_choice "none"); `probabilities` the same keyed by tool
    name, None for the text answer; `fields` the chosen tool's arguments by their own paths
    (scored ones with probabilities, generated ones without). `scoring` is the decision pass's whole
    result (diagnostics included); `logprobs` the generated tokens of the text or the open arguments,
    with `logprobs=`."""

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

    @property
    def probabilities(self) -> dict[str | None, float]:
        """Every allowed tool's probability (None: the text answer)."""
        if self.decision is None:
            return {None: 1.0}
        return {None if v == self.text_value else str(v): p for v, p in self.decision.probabilities.items()}

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
            "decision": self.decision.to_json() if self.decision is not None else None,
            "arguments": {path: f.to_json() for path, f in self.fields.items()},
            "abstained_fields": self.abstained_fields,
            "needs_review": self.needs_review,
        }
        if self.scoring is not None:
            d = self.scoring.diagnostics
            out.update(forward_calls=d.forward_calls, cached_tokens=d.cached_tokens)
        return out


Message = Mapping[str, Any] | tuple[str, str]


class ToolCaller:
    """Tool calls on an engine, by composition (it uses the engine's public `classify` and
    `generate`); `engine.tools` is one.

    >>> engine.tools.call(messages, tools, tool_choice="required")  # doctest: +SKIP
    """

    def __init__(self, engine: PCDEngine) -> None:
        self.engine = engine
        self._plans: dict[str, ToolPlan] = {}
        self._lock = threading.Lock()

    def plan(self, tools: Sequence[Any], tool_choice: Any = "auto") -> ToolPlan:
        """The cached ToolPlan of these tools and this choice (InputError for bad ones)."""
        parsed = as_tools(tools)
        choice = ToolChoice.parse(tool_choice, parsed)
        key = json.dumps([[t.openai() for t in parsed], choice.mode, choice.name], sort_keys=True)
        with self._lock:
            found = self._plans.get(key)
        if found is None:
            found = build_tool_plan(parsed, choice, self.engine.prompt.supports_tools)
            with self._lock:
                found = self._plans.setdefault(key, found)
        return found

    def schema(self, tools: Sequence[Any], tool_choice: Any = "auto") -> type[BaseModel]:
        """The decision schema (what `engine.calibrate` fits and `classify` scores for these tools):
        labels are `{"tool": name}` (null: a text answer), optionally with closed arguments."""
        plan = self.plan(tools, tool_choice)
        if plan.schema is None:
            raise InputError('tool_choice "none" has no decision to score')
        return plan.schema

    def conversation(self, messages: Sequence[Message], plan: ToolPlan) -> tuple[str | None, Conversation]:
        """(system text, the other turns): calls written as `plan.call_text`, results as `tool`
        turns. Messages are role/content dicts (an assistant's may hold `tool_calls`, each a
        `{"name", "arguments"}` dict or an OpenAI `{"function": {...}}` entry) or pairs."""
        if isinstance(messages, (str, bytes)) or not isinstance(messages, Sequence) or not messages:
            raise InputError("messages must be a non-empty list of {'role': ..., 'content': ...} items")
        system, turns = [], []
        for index, message in enumerate(messages):
            role, content, calls = _message(message, index)
            if calls:
                written = [plan.call_text(*_call(c, index)) for c in calls]
                content = "\n".join([content, *written] if content else written)
            if role == "system":
                system.append(content)
            else:
                turns.append((role, content))
        if not turns:
            raise InputError("messages hold only system text; add the user's message")
        return ("\n\n".join(system) or None), Conversation(tuple(turns))

    def call(
        self,
        messages: Sequence[Message],
        tools: Sequence[Any],
        *,
        tool_choice: Any = "auto",
        instructions: str | None = None,
        calibration: Calibration | None = None,
        abstain_below: float | None = None,
        max_tokens: int = 512,
        sampling: Sampling | None = None,
        logprobs: int | None = None,
    ) -> ToolCallResult:
        """Decide the next step of a conversation: a call of one of `tools` (OpenAI entries, bare
        function dicts or `Tool`s) or a text answer, as `tool_choice` allows. The decision and every
        candidate tool's closed arguments are scored in one packed pass; the chosen tool's open
        arguments are then generated under its schema; a text answer is generated as plain chat.
        `instructions` go before the tool instructions (the messages' system text before both);
        `calibration` (fitted on `schema(tools, tool_choice)`) and `abstain_below` apply to the
        decision and the scored arguments. A choice that leaves one tool ("required" with one
        tool, or a tool's name) is that tool's structured output: `classify` on its arguments."""
        plan = self.plan(tools, tool_choice)
        system, conversation = self.conversation(messages, plan)
        if plan.schema is None:
            return self._text(system, conversation, plan, None, max_tokens, sampling, logprobs)
        own = [t for t in (system, instructions) if t]
        forced = plan.arguments[plan.forced] if plan.forced is not None else None
        if forced is not None and not forced.model.model_fields:  # nothing to ask: no arguments
            return _forced_call(forced, None)
        if forced is not None:  # one tool that must be called: its arguments are the answer
            result = self.engine.classify(
                conversation,
                forced.model,
                instructions="\n\n".join(own) or None,
                abstain_below=abstain_below,
                sampling=sampling,
                logprobs=logprobs,
            )
            return _forced_call(forced, result)
        asked = "\n\n".join([*own, plan.instructions])
        scored = self.engine.classify(
            conversation,
            plan.schema,
            instructions=asked,
            allow_generation=False,
            calibration=calibration,
            abstain_below=abstain_below,
        )
        decision = scored.fields["tool"]
        value = scored.value.model_dump(mode="json", by_alias=True)
        name = plan.tool_of(value[plan.key])
        if name is None:
            return self._text(system, conversation, plan, scored, max_tokens, sampling, logprobs)
        a = plan.arguments[name]
        fields = {
            p.split(".", 1)[1]: replace(f, path=p.split(".", 1)[1])
            for p, f in scored.fields.items()
            if p.startswith(f"{a.field}.")
        }
        closed = {n: getattr(getattr(scored.value, a.field), n) for n in a.closed} if a.field else {}
        generated = self._open_arguments(a, closed, own, conversation, sampling, logprobs)
        tokens, used = None, 0
        if generated is None:
            arguments = _validated(a, {a.keys()[n]: v for n, v in closed.items()})
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
        )

    def _open_arguments(
        self,
        a: ToolArguments,
        closed: Mapping[str, Any],
        own: Sequence[str],
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
            instructions="\n\n".join([*own, asked]),
            sampling=sampling,
            logprobs=logprobs,
        )

    def _text(
        self,
        system: str | None,
        conversation: Conversation,
        plan: ToolPlan,
        scored: PCDResult[Any] | None,
        max_tokens: int,
        sampling: Sampling | None,
        logprobs: int | None,
    ) -> ToolCallResult:
        turns = [("system", system)] if system else []
        generation = self.engine.generate(
            [*turns, *conversation.messages], max_tokens=max_tokens, sampling=sampling, logprobs=logprobs
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
        )


def _forced_call(a: ToolArguments, result: PCDResult[Any] | None) -> ToolCallResult:
    """A call that must name one tool is that tool's structured output: `classify` on its argument
    model with the caller's own instructions, what `with_structured_output` asks (`result`; None
    for a tool without arguments). There is no decision to score (nor to calibrate): the tool
    field is fixed."""
    name = a.tool.name
    decision = FieldResult("tool", name, {name: 1.0}, {name: 0.0}, 1.0, "fixed")
    if result is None:  # no model work: no prompt tokens processed
        return ToolCallResult(name, {}, None, decision, {}, "tool_calls", 0, 0)
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
    )


def _message(message: Any, index: int) -> tuple[str, str, list[Any]]:
    if isinstance(message, tuple) and len(message) == 2:
        role, content, calls = message[0], message[1], []
    elif isinstance(message, Mapping):
        role, content = message.get("role"), message.get("content")
        calls = list(message.get("tool_calls") or [])
    else:
        raise InputError(f"message #{index} must be a dict with 'role' and 'content' or a pair")
    content = "" if content is None and (calls or role == "assistant") else content
    if not isinstance(role, str) or not isinstance(content, str):
        raise InputError(f"message #{index}: role and content must be strings")
    return role, content, calls


def _call(call: Any, index: int) -> tuple[str, dict[str, Any]]:
    """(name, arguments) of an earlier call: `{"name", "arguments"}` or OpenAI's
    `{"function": {"name", "arguments": "<json>"}}`."""
    function = call.get("function", call) if isinstance(call, Mapping) else None
    if not isinstance(function, Mapping) or not isinstance(function.get("name"), str):
        raise InputError(f"message #{index}: a tool call needs a name")
    arguments = function.get("arguments") or {}
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments)
        except json.JSONDecodeError as error:
            raise InputError(f"message #{index}: tool call arguments are not JSON: {error}") from None
    if not isinstance(arguments, Mapping):
        raise InputError(f"message #{index}: tool call arguments must be an object")
    return function["name"], dict(arguments)


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


__all__ = [
    "TOOL_CHOICES",
    "Tool",
    "ToolCallResult",
    "ToolCaller",
    "ToolChoice",
    "ToolPlan",
    "as_tool",
    "as_tools",
]
