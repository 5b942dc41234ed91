"""Ollama's API on `pcd serve`: `POST /api/chat`, `POST /api/generate`, `GET /api/tags`,
`POST /api/show`, `GET /api/version`, so that the `ollama` client, LangChain's `ChatOllama` and
LlamaIndex's `Ollama` run unchanged against it (`base_url` / `host` at the server).

One more converter: an Ollama request becomes the same call a chat completion would
(`ollama_calls.py`). The call runs on the model worker as chat's does
(`CompletionEndpoints.run` / `.pieces`), and its answer is written in Ollama's shape: one JSON object,
or NDJSON lines (`stream` is true unless set to false, as in Ollama) ending with `"done": true`, the
token counts and the durations. The scored fields are in a `pcd` extension on the final object, as on
chat choices; `logprobs` / `top_logprobs` give Ollama's `logprobs` list (a scored field's entry is its value).

Errors are Ollama's body, `{"error": "..."}`.
"""

from __future__ import annotations

import json
import time
from collections.abc import AsyncIterator, Callable, Mapping, Sequence
from datetime import datetime, timezone
from typing import Any, Protocol

from fastapi import Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from minicpm_pcd_adapters.server.answers import Answered, usage
from minicpm_pcd_adapters.server.calls import (
    ClassifyCall,
    GenerateCall,
    RequestCall,
    call_kind,
)
from minicpm_pcd_adapters.server.errors import read_body
from minicpm_pcd_adapters.server.jobs import drained, json_body, observed, replayed
from minicpm_pcd_adapters.server.metrics import ServerMetrics
from minicpm_pcd_adapters.server.ollama_calls import OllamaReader, OllamaShowRequest
from minicpm_pcd_adapters.server.protocol import Choice, Usage
from minicpm_pcd_adapters.server.thinking import OPEN, ThinkingStream
from pcd_engine import PCDEngine, __version__

# -- writing the answer ------------------------------------------------------------------------------


class OllamaWriter:
    """One answer in Ollama's shape: `message` (chat) or `response` (generate), the final object with
    `done`, the reason, the durations (nanoseconds) and the token counts."""

    def __init__(self, model: str, chat: bool, thinking: ThinkingStream | None = None) -> None:
        self.model, self.chat, self.started = model, chat, time.perf_counter_ns()
        self.thinking = thinking  # the request thinks: generated text is cut into thinking and answer

    def split(self, text: str, final: bool) -> tuple[str, str]:
        """(thinking, answer) new in a generated piece; all answer unless the request thinks."""
        return self.thinking.feed(text, final) if self.thinking is not None else ("", text)

    def piece(
        self,
        text: str,
        logprobs: list[dict[str, Any]] | None = None,
        calls: Any = None,
        thinking: str = "",
    ) -> dict[str, Any]:
        out = self._head()
        if self.chat:
            out["message"] = {"role": "assistant", "content": text}
            if thinking:
                out["message"]["thinking"] = thinking
            if calls:
                out["message"]["tool_calls"] = calls
        else:
            out["response"] = text
            if thinking:
                out["thinking"] = thinking
        if logprobs:
            out["logprobs"] = logprobs
        out["done"] = False
        return out

    def done(
        self,
        reason: str,
        tokens: Usage | None,
        extension: dict[str, Any] | None = None,
        timings_ms: Sequence[Mapping[str, float]] = (),
    ) -> dict[str, Any]:
        """The final object. `timings_ms` are the engine answers' timings: their prompt phases
        (prefill, and scoring's packed forward call) are `prompt_eval_duration`, their generated
        tokens' `eval_duration`."""
        out = self.piece("")
        out.update(done=True, done_reason=reason, total_duration=time.perf_counter_ns() - self.started)
        out["load_duration"] = 0
        if tokens is not None:
            out.update(prompt_eval_count=tokens.prompt_tokens, eval_count=tokens.completion_tokens)
            out["prompt_eval_duration"] = _nanoseconds(timings_ms, PROMPT_PHASES)
            out["eval_duration"] = _nanoseconds(timings_ms, EVAL_PHASES)
        if extension is not None:
            out["pcd"] = extension
        return out

    def whole(self, answered: Answered) -> dict[str, Any]:
        """A non-streamed answer: the choice's text (or tool calls) and the final fields in one."""
        (choice,) = answered.choices
        out = self.done(_reason(choice), answered.usage, _extension(choice), answered.timings_ms)
        out.update(self.whole_piece(choice))
        return out

    def whole_piece(self, choice: Choice) -> dict[str, Any]:
        """The piece holding a whole choice: its text (cut into thinking and answer when the request
        thinks), tool calls and logprobs."""
        thinking, text = self.split(choice.message.content or "", final=True)
        piece = self.piece(text, _logprobs_of(choice), _calls_of(choice), thinking)
        return {k: v for k, v in piece.items() if k in ("message", "response", "thinking", "logprobs")}

    def _head(self) -> dict[str, Any]:
        created = datetime.now(timezone.utc).isoformat().replace("+00:00", "Z")
        return {"model": self.model, "created_at": created}


PROMPT_PHASES = ("prefill", "forward", "score", "rescore")  # keys of the engine's timings_ms
EVAL_PHASES = ("decode", "generate", "retry")


def _nanoseconds(timings_ms: Sequence[Mapping[str, float]], phases: Sequence[str]) -> int:
    return round(sum(t.get(phase, 0.0) for t in timings_ms for phase in phases) * 1e6)


def _reason(choice: Choice) -> str:
    return "length" if choice.finish_reason == "length" else "stop"


def _extension(choice: Choice) -> dict[str, Any] | None:
    if choice.pcd is None:
        return None
    return choice.pcd.model_dump(mode="json", by_alias=True, exclude_unset=True)


def _calls_of(choice: Choice) -> list[dict[str, Any]] | None:
    calls = choice.message.tool_calls or []
    return [
        {"id": c.id, "function": {"name": c.function.name, "arguments": json.loads(c.function.arguments)}}
        for c in calls
    ] or None


def _logprobs_of(choice: Choice) -> list[dict[str, Any]] | None:
    if choice.logprobs is None or choice.logprobs.content is None:
        return None
    return [
        _logprob(e.token, e.logprob, [_logprob(t.token, t.logprob) for t in e.top_logprobs])
        for e in choice.logprobs.content
    ]


def _logprob(token: str, logprob: float, top: list[dict[str, Any]] | None = None) -> dict[str, Any]:
    out: dict[str, Any] = {"token": token, "logprob": logprob}
    if top is not None:
        out["top_logprobs"] = top
    return out


# -- the endpoints -----------------------------------------------------------------------------------


class CallRunner(Protocol):
    """What the Ollama door needs of the server's chat endpoints (`endpoints.CompletionEndpoints`)."""

    async def run(self, call: RequestCall, request: Request) -> Answered: ...
    async def pieces(self, call: GenerateCall) -> Any: ...


class OllamaEndpoints:
    """The Ollama routes: each request read by `OllamaReader`, run by the chat endpoints, written by
    `OllamaWriter`."""

    def __init__(
        self,
        runner: CallRunner,
        reader: OllamaReader,
        engine: PCDEngine,
        metrics: ServerMetrics,
        created: int,
    ) -> None:
        self.runner, self.reader, self.engine, self.metrics = runner, reader, engine, metrics
        self.modified = datetime.fromtimestamp(created, timezone.utc).isoformat().replace("+00:00", "Z")

    async def chat(self, request: Request) -> Response:
        return await self._answer(request, self.reader.chat, chat=True)

    async def generate(self, request: Request) -> Response:
        return await self._answer(request, self.reader.generate, chat=False)

    async def _answer(
        self, request: Request, read: Callable[[Any], RequestCall | None], chat: bool
    ) -> Response:
        with observed(self.metrics) as seen:
            call = read(await json_body(request))
            if call is not None:
                seen.kind = call_kind(call)
            writer = OllamaWriter(self.reader.model, chat, self._thinking(call))
            response = await self._respond(call, writer, request)
            seen.status = response.status_code
            return response

    def _thinking(self, call: RequestCall | None) -> ThinkingStream | None:
        """A stream that cuts generated text into thinking and answer, when the call's prompt is
        rendered with thinking on; scored answers and raw prompts have no thinking."""
        if (
            call is None
            or isinstance(call, ClassifyCall)
            or (isinstance(call, GenerateCall) and call.prompts)
        ):
            return None
        prompt = self.engine.rendered_with(dict(call.switches)).prompt
        if not (
            prompt.template_kwargs.get("enable_thinking") and self.reader.template.reads("enable_thinking")
        ):
            return None
        return ThinkingStream(opened=prompt.decode(prompt.tail).rstrip().endswith(OPEN))

    async def _respond(self, call: RequestCall | None, writer: OllamaWriter, request: Request) -> Response:
        if call is None:  # an empty prompt: Ollama loads the model and answers at once
            return JSONResponse(writer.done("load", None) | {"response": ""})
        if isinstance(call, GenerateCall) and call.stream:
            first, pieces, leave = await self.runner.pieces(call)
            return _ndjson(self._streamed(writer, first, pieces, leave))
        answered = await self.runner.run(call, request)
        if not call.stream:
            return JSONResponse(writer.whole(answered))
        (choice,) = answered.choices
        lines = [
            writer.piece("") | writer.whole_piece(choice),
            writer.done(_reason(choice), answered.usage, _extension(choice), answered.timings_ms),
        ]
        return _ndjson(replayed(lines))

    async def _streamed(
        self, writer: OllamaWriter, first: Any, pieces: Any, leave: Any
    ) -> AsyncIterator[dict[str, Any]]:
        prompt_tokens = completion_tokens = 0
        try:
            async for _, piece in drained(first, pieces, leave):
                logprobs = [
                    _logprob(t.token, t.logprob, [_logprob(x, p) for x, p in t.top])
                    for t in piece.logprobs or ()
                ]
                thinking, text = writer.split(piece.text, final=piece.finish_reason is not None)
                if text or thinking or logprobs:
                    yield writer.piece(text, logprobs, thinking=thinking)
                if piece.finish_reason is not None:
                    prompt_tokens, completion_tokens = piece.prompt_tokens or 0, piece.completion_tokens or 0
                    reason = "length" if piece.finish_reason == "length" else "stop"
                    tokens = usage(prompt_tokens, completion_tokens)
                    yield writer.done(reason, tokens, timings_ms=[piece.timings_ms or {}])
        finally:
            self.metrics.on_tokens(prompt_tokens, completion_tokens)

    async def tags(self) -> dict[str, Any]:
        return {"models": [self._card(name) for name in self.reader.names()[-1:]]}

    async def show(self, request: Request) -> dict[str, Any]:
        asked = read_body(OllamaShowRequest, await json_body(request))
        self.reader.check_model(asked.model or asked.name or "")
        config = getattr(self.engine.model, "config", None)
        family = str(getattr(config, "model_type", "unknown"))
        template = str(getattr(self.engine.tokenizer, "chat_template", None) or "")
        thinks = self.reader.template.reads("enable_thinking")
        return {
            "modelfile": f"# served by minicpm-pcd {__version__}",
            "parameters": "",
            "template": template,
            "details": self._details(family),
            "model_info": {
                "general.architecture": family,
                f"{family}.context_length": self.engine.limits.max_prompt_tokens,
            },
            "capabilities": ["completion", "tools", *(["thinking"] if thinks else [])],
            "modified_at": self.modified,
        }

    async def version(self) -> dict[str, str]:
        return {"version": __version__}

    def _card(self, name: str) -> dict[str, Any]:
        config = getattr(self.engine.model, "config", None)
        return {
            "name": name,
            "model": name,
            "modified_at": self.modified,
            "size": sum(p.numel() * p.element_size() for p in self.engine.model.parameters()),
            "digest": "",
            "details": self._details(str(getattr(config, "model_type", "unknown"))),
        }

    def _details(self, family: str) -> dict[str, Any]:
        return {
            "parent_model": "",
            "format": "safetensors",
            "family": family,
            "families": [family],
            "parameter_size": f"{sum(p.numel() for p in self.engine.model.parameters()) / 1e6:.0f}M",
            "quantization_level": self.engine.precision,
        }


def _ndjson(lines: AsyncIterator[dict[str, Any]]) -> StreamingResponse:
    async def text() -> AsyncIterator[str]:
        async for line in lines:
            yield json.dumps(line, ensure_ascii=False) + "\n"

    return StreamingResponse(text(), media_type="application/x-ndjson")
