"""The answers `pcd serve` writes, built from the models of `protocol.py` (the ones `/openapi.json`
publishes): completions and stream chunks, usage, structured answers with the `pcd` extension and
standard `logprobs`, and the same choices written as `/v1/completions` text. No web framework, no
model: `ResponseWriter.body` / `.chunk` give the JSON.
"""

from __future__ import annotations

import json
import math
import secrets
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, NamedTuple, cast

from minicpm_pcd_adapters.server import calls
from minicpm_pcd_adapters.server.constraints import CHOICE_FIELD
from minicpm_pcd_adapters.server.protocol import (
    AssistantMessage,
    CalibrationUsed,
    ChatCompletion,
    ChatCompletionChunk,
    Choice,
    ChunkChoice,
    Delta,
    FieldAnswer,
    FinishReason,
    FunctionCall,
    Logprobs,
    PCDExtension,
    PromptTokensDetails,
    StreamedToolCall,
    TextChoice,
    TextCompletion,
    TextLogprobs,
    ToolCall,
    ToolDecisionExtension,
    TopLogprob,
    Usage,
    dump,
)
from minicpm_pcd_adapters.server.protocol import TokenLogprob as LogprobEntry
from pcd_engine import FieldResult, Generation, PCDResult, TokenLogprob, ToolCallResult

LOWEST_LOGPROB = -9999.0  # what a probability of 0 is written as (JSON has no -inf)


@dataclass
class ResponseWriter:
    """One response: its id, creation time and model, then its choices (one per `n`). With `text`,
    written as a `/v1/completions` answer."""

    model: str
    text: bool = False
    id: str = ""
    created: int = field(default_factory=lambda: int(time.time()))

    def __post_init__(self) -> None:
        self.id = self.id or ("cmpl-" if self.text else "chatcmpl-") + secrets.token_hex(12)

    def body(self, choices: list[Choice], usage: Usage) -> dict[str, Any]:
        if self.text:
            texts = [_text_choice(c, c.message.content or "") for c in choices]
            return dump(TextCompletion(object="text_completion", choices=texts, usage=usage, **self._head()))
        return dump(ChatCompletion(object="chat.completion", choices=choices, usage=usage, **self._head()))

    def chunk(self, choices: list[ChunkChoice], usage: Usage | None = None) -> dict[str, Any]:
        """A stream chunk; `usage` only on the last one (`stream_options.include_usage`)."""
        extra: dict[str, Any] = {} if usage is None else {"usage": usage}  # left out, not null
        if self.text:
            texts = [_text_choice(c, c.delta.content or "") for c in choices]
            return dump(TextCompletion(object="text_completion", choices=texts, **self._head(), **extra))
        chunk = ChatCompletionChunk(object="chat.completion.chunk", choices=choices, **self._head(), **extra)
        return dump(chunk)

    def _head(self) -> dict[str, Any]:
        return {"id": self.id, "created": self.created, "model": self.model, "system_fingerprint": None}


class Answered(NamedTuple):
    """A call answered whole: its choices, its usage, and each engine answer's `timings_ms` (what
    Ollama's durations are read from)."""

    choices: list[Choice]
    usage: Usage
    timings_ms: list[dict[str, float]]


def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int = 0) -> Usage:
    return Usage(
        prompt_tokens=prompt_tokens,
        completion_tokens=completion_tokens,
        total_tokens=prompt_tokens + completion_tokens,
        prompt_tokens_details=PromptTokensDetails(cached_tokens=cached_tokens),
    )


def classified_message(
    call: calls.ClassifyCall, result: PCDResult[Any], index: int, calibration: CalibrationUsed | None = None
) -> Choice:
    """The assistant message (the object's JSON as `content`) and the `pcd` extension, which names
    the calibration applied (None: none)."""
    answer = result.to_json()
    if call.answer == "choice":  # vLLM's `choice`: the chosen string alone
        message = AssistantMessage(role="assistant", content=answer["value"][CHOICE_FIELD], refusal=None)
    elif call.answer == "enum":  # a root-enum schema: the chosen value as JSON (`"billing"`, `3`)
        content = json.dumps(answer["value"][CHOICE_FIELD], ensure_ascii=False)
        message = AssistantMessage(role="assistant", content=content, refusal=None)
    else:
        content = json.dumps(answer["value"], ensure_ascii=False)
        message = AssistantMessage(role="assistant", content=content, refusal=None)
    d = result.diagnostics
    extension = PCDExtension(
        fields={path: FieldAnswer(**f) for path, f in answer["fields"].items()},
        needs_review=result.needs_review,
        abstained_fields=result.abstained_fields,
        forward_calls=d.forward_calls,
        cached_tokens=d.cached_tokens,
        calibration=calibration,
    )
    if index % call.n:  # scored fields are decided whole, not sampled: say which choice they repeat
        extension.same_scores_as = index - index % call.n
    fields = list(result.fields.values())
    as_text = call.answer == "choice"
    logprobs = None
    if call.logprobs is not None:
        logprobs = scored_logprobs(fields, result.token_logprobs, call.logprobs, as_text)
    return Choice(index=index, message=message, finish_reason="stop", logprobs=logprobs, pcd=extension)


def tool_message(call: calls.ToolDecisionCall, result: ToolCallResult, index: int) -> Choice:
    """The choice of a tool decision: one `tool_calls` entry, or the text answer; `pcd` holds the
    decision's probabilities (every tool's, "" for the text answer) and the scored arguments."""
    message = AssistantMessage(role="assistant", content=result.text, refusal=None)
    if result.tool is not None:
        arguments = json.dumps(result.arguments or {}, ensure_ascii=False)
        function = FunctionCall(name=result.tool, arguments=arguments)
        assert result.call_id is not None  # a call always has its id
        message.tool_calls = [ToolCall(id=result.call_id, type="function", function=function)]
    decision = result.to_json()
    decided = [result.decision] if result.decision is not None else []
    fields = [*decided, *result.fields.values()]
    logprobs = None if call.logprobs is None else scored_logprobs(fields, result.logprobs, call.logprobs)
    return Choice(
        index=index,
        message=message,
        finish_reason=cast(FinishReason, result.finish_reason),
        logprobs=logprobs,
        pcd=ToolDecisionExtension(**decision),
    )


def scored_logprobs(
    fields: Sequence[FieldResult], generated: Sequence[TokenLogprob] | None, top: int, as_text: bool = False
) -> Logprobs:
    """OpenAI's `choice.logprobs` for a structured answer or a tool decision. First, per scored
    field in answer order, one entry whose `token` is the chosen value as written in the JSON answer
    and whose `logprob` is the log of its (calibrated) probability; `top_logprobs` lists the field's
    `top` most probable values, most probable first. Then the generated tokens (the open fields'
    JSON text after the scored values, or a text answer), each with the model's log-probability and
    its `top` alternatives. `as_text`: string values written as themselves (a `choice` answer), not
    as JSON."""

    def entry(value: Any, p: float) -> TopLogprob:
        written = value if as_text and isinstance(value, str) else json.dumps(value, ensure_ascii=False)
        return _entry(written, math.log(p) if p > 0 else LOWEST_LOGPROB)

    content = []
    for f in fields:
        if f.source != "scored":
            continue
        ranked = sorted(f.probabilities.items(), key=lambda kv: -kv[1])[:top]
        chosen = entry(f.value, f.probabilities[f.value])
        content.append(_with_top(chosen, [entry(v, p) for v, p in ranked]))
    return Logprobs(content=content + (token_logprobs(generated or (), top).content or []), refusal=None)


def token_logprobs(tokens: Sequence[TokenLogprob], top: int) -> Logprobs:
    """OpenAI's `logprobs` object for generated tokens, with at most `top` alternatives each."""
    content = [
        _with_top(_entry(t.token, t.logprob), [_entry(text, p) for text, p in t.top[:top]]) for t in tokens
    ]
    return Logprobs(content=content, refusal=None)


def _entry(token: str, logprob: float) -> TopLogprob:
    return TopLogprob(token=token, logprob=max(logprob, LOWEST_LOGPROB), bytes=list(token.encode()))


def _with_top(entry: TopLogprob, top: list[TopLogprob]) -> LogprobEntry:
    return LogprobEntry(**entry.model_dump(), top_logprobs=top)


def classified_usage(results: list[PCDResult[Any]], n: int = 1) -> Usage:
    """Usage of answers given `n` per input: each input's prompt counted once."""
    d = [r.diagnostics for r in results]
    prompt, cached = sum(x.prompt_tokens for x in d[::n]), sum(x.cached_tokens for x in d[::n])
    return usage(prompt, sum(x.generated_tokens for x in d), cached)


def generated_choice(answer: Generation, index: int, top: int | None = None) -> Choice:
    """A plain chat choice; with `top` (not None), its tokens' `logprobs` with `top` alternatives."""
    message = AssistantMessage(role="assistant", content=answer.text, refusal=None)
    logprobs = None if answer.logprobs is None or top is None else token_logprobs(answer.logprobs, top)
    finish = cast(FinishReason, answer.finish_reason)
    return Choice(index=index, message=message, finish_reason=finish, logprobs=logprobs)


def choice_delta(
    index: int, delta: Delta, finish_reason: str | None = None, logprobs: Logprobs | None = None
) -> ChunkChoice:
    """One choice of a stream chunk."""
    finish = cast(FinishReason | None, finish_reason)
    return ChunkChoice(index=index, delta=delta, finish_reason=finish, logprobs=logprobs)


def delta_chunks(answer: Choice) -> list[ChunkChoice]:
    """A whole answer as stream choices: the role, then the content or the tool call (with the
    answer's `logprobs`), then the finish reason with the `pcd` extension."""
    message, index = answer.message, answer.index
    if message.tool_calls:
        delta = Delta(tool_calls=[StreamedToolCall(index=0, **message.tool_calls[0].model_dump())])
    else:
        delta = Delta(content=message.content)
    end = choice_delta(index, Delta(), answer.finish_reason)
    if "pcd" in answer.model_fields_set:
        end.pcd = answer.pcd
    return [
        choice_delta(index, Delta(role="assistant", content="")),
        choice_delta(index, delta, logprobs=answer.logprobs),
        end,
    ]


def _text_choice(choice: Choice | ChunkChoice, text: str) -> TextChoice:
    """A chat-shaped choice written as a text completion's: its text, Completions-style logprobs."""
    out = TextChoice(
        index=choice.index,
        text=text,
        logprobs=_text_logprobs(choice.logprobs),
        finish_reason=choice.finish_reason,  # type: ignore[arg-type]  # never tool_calls here
    )
    if "pcd" in choice.model_fields_set:
        out.pcd = choice.pcd  # type: ignore[assignment]  # a structured answer's
    return out


def _text_logprobs(logprobs: Logprobs | None) -> TextLogprobs | None:
    """Chat `logprobs` (`content` entries) in the Completions form, offsets into the answer's text."""
    if logprobs is None:
        return None
    entries = logprobs.content or []
    offsets, at = [], 0
    for entry in entries:
        offsets.append(at)
        at += len(entry.token)
    return TextLogprobs(
        tokens=[e.token for e in entries],
        token_logprobs=[e.logprob for e in entries],
        top_logprobs=[{t.token: t.logprob for t in e.top_logprobs} for e in entries],
        text_offset=offsets,
    )
