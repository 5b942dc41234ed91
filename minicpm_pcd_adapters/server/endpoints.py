"""The OpenAI-compatible routes' work: `POST /v1/chat/completions` and `POST /v1/completions` read into
calls (`calls.py`, `text_completions.py`), each run on the model worker through the batcher
(`CompletionEndpoints.run`, or `.pieces` for a streamed generation) and written as completions, chunks
or replayed events. The other doors (`/classify`, Ollama's API) run their calls through the same
`run` / `pieces`; `ClassifyRunner` is the batcher's job for classify calls."""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import threading
from collections.abc import AsyncIterator, Hashable
from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse, Response

from minicpm_pcd_adapters.server.answers import (
    Answered,
    ResponseWriter,
    choice_delta,
    classified_message,
    classified_usage,
    delta_chunks,
    generated_choice,
    token_logprobs,
    tool_message,
    usage,
)
from minicpm_pcd_adapters.server.batching import Batcher
from minicpm_pcd_adapters.server.calibrations import Calibrations
from minicpm_pcd_adapters.server.calls import (
    ClassifyCall,
    GenerateCall,
    RequestCall,
    RequestLimits,
    ToolDecisionCall,
    call_kind,
    nth_sampling,
    parse_request,
)
from minicpm_pcd_adapters.server.errors import APIError
from minicpm_pcd_adapters.server.jobs import (
    drained,
    engine_error,
    event_stream,
    json_body,
    observed,
    queued,
    replayed,
    while_connected,
)
from minicpm_pcd_adapters.server.metrics import ServerMetrics
from minicpm_pcd_adapters.server.protocol import (
    Choice,
    Delta,
    Usage,
)
from minicpm_pcd_adapters.server.settings import ServerSettings
from minicpm_pcd_adapters.server.template import ChatTemplate
from minicpm_pcd_adapters.server.text_completions import parse_completion
from pcd_engine import (
    Generation,
    InputError,
    PCDEngine,
    PCDError,
    PCDResult,
)

log = logging.getLogger("minicpm_pcd.server")


class ClassifyRunner:
    """One batcher job: every classify request of a group answered by one `classify_batch`."""

    def __init__(self, engine: PCDEngine, calibrations: Calibrations) -> None:
        self.engine, self.calibrations = engine, calibrations

    def __call__(self, key: Hashable, calls: list[ClassifyCall]) -> list[list[PCDResult[Any] | PCDError]]:
        first = calls[0]
        inputs = [item for call in calls for item in call.inputs()]
        results = self.engine.rendered_with(dict(first.switches)).classify_batch(
            inputs,
            first.schema,
            sampling=first.sampling,
            abstain_below=first.abstain_below,
            calibration=self.calibrations.by_name.get(first.calibration or ""),
            logprobs=first.logprobs,
            return_exceptions=True,
        )
        out, start = [], 0
        for call in calls:
            count = len(call.inputs())
            out.append(results[start : start + count])
            start += count
        return out


class CompletionEndpoints:
    """`POST /v1/chat/completions` and `POST /v1/completions`: a checked call, answered through the
    batcher, as JSON or events. Both protocols read into the same calls (a completion's prompts are
    raw inputs), and their answers differ only in how they are written (`ResponseWriter(text=...)`)."""

    def __init__(
        self,
        engine: PCDEngine,
        settings: ServerSettings,
        batcher: Batcher,
        metrics: ServerMetrics,
        calibrations: Calibrations,
    ) -> None:
        self.engine, self.settings, self.batcher, self.metrics = engine, settings, batcher, metrics
        self.calibrations = calibrations
        self.limits = RequestLimits(
            max_text_chars=settings.max_text_chars, max_completion_tokens=settings.max_completion_tokens
        )
        self.template = ChatTemplate.of(engine)

    async def answer(self, request: Request) -> Response:
        """`POST /v1/chat/completions`."""
        return await self._answer(
            request, lambda body: parse_request(body, self.limits, self.settings.max_tokens, self.template)
        )

    async def answer_text(self, request: Request) -> Response:
        """`POST /v1/completions`: prompts continued as written."""
        return await self._answer(request, lambda body: parse_completion(body, self.limits))

    async def _answer(self, request: Request, parse: Any) -> Response:
        with observed(self.metrics) as seen:
            call = parse(await json_body(request))
            seen.kind = call_kind(call)
            if call.model != self.settings.model_name:
                served = self.settings.model_name
                message = f"the model {call.model!r} does not exist; this server serves {served!r}"
                raise APIError(404, message, param="model", code="model_not_found")
            if isinstance(call, GenerateCall) and call.stream:
                first, pieces, leave = await self.pieces(call)
                response: Response = event_stream(_generated_chunks(call, first, pieces, leave, self.metrics))
            else:
                answered = await self.run(call, request)
                response = _answered(call, answered.choices, answered.usage)
            seen.status = response.status_code
            return response

    async def run(self, call: RequestCall, request: Request) -> Answered:
        """A call answered whole, on the model worker: its choices (in OpenAI's shape, which the
        other protocols' writers read), usage and timings. Schema and grammar errors are 400s before any
        model work."""
        if isinstance(call, ClassifyCall):
            return await self._classify(call, request)
        if isinstance(call, ToolDecisionCall):
            return await self._tool_call(call, request)
        if call.grammar is not None:  # compiled before queuing
            await self._check_grammar(call)
        return await self._generate(call, request)

    async def pieces(self, call: GenerateCall) -> tuple[Any, asyncio.Queue[Any], threading.Event]:
        """A generation streamed: its first piece, the queue the rest arrive on (None ends it) and
        the event that stops generation when the client has gone (`_generated_chunks` reads them)."""
        if call.grammar is not None:
            await self._check_grammar(call)
        return await self._stream_generation(call)

    async def _classify(self, call: ClassifyCall, request: Request) -> Answered:
        try:  # schema errors before any model work (the plan is cached per schema)
            engine = self.engine.rendered_with(dict(call.switches))
            plan = await asyncio.to_thread(
                engine.plan, call.schema, instructions=call.system, layout=call.layout
            )
        except PCDError as error:
            raise APIError(400, str(error), param=call.schema_param, code="unsupported_schema") from None
        call = dataclasses.replace(call, calibration=self.calibrations.match(plan, call.switches))
        submitted = self.batcher.submit(call.batch_key(), call, self.settings.request_timeout_s)
        results = await while_connected(request, self._queued(submitted))
        for result in results:
            if isinstance(result, PCDError):
                raise engine_error(result, "prompt" if call.prompts else "messages")
        used = self.calibrations.describe(call.calibration)
        answers = [classified_message(call, r, i, used) for i, r in enumerate(results)]
        tokens = classified_usage(results, call.n)
        self.metrics.on_answers(call.schema, results)
        self.metrics.on_tokens(tokens.prompt_tokens, tokens.completion_tokens)
        return Answered(answers, tokens, [r.diagnostics.timings_ms for r in results])

    async def _check_grammar(self, call: GenerateCall) -> None:
        assert call.grammar is not None
        try:
            await asyncio.to_thread(self.engine.check_grammar, call.grammar)
        except InputError as error:
            message = f"{call.grammar_param}: {error}"
            raise APIError(400, message, param=call.grammar_param, code="invalid_grammar") from None

    async def _tool_call(self, call: ToolDecisionCall, request: Request) -> Answered:
        """A tool decision (or text answer, or the one tool a choice names) per choice, on the model
        worker; the tools' parameters are checked first, before any model work."""
        engine = self.engine.rendered_with(dict(call.switches))
        try:
            await asyncio.to_thread(engine.tools.plan, call.tools, call.tool_choice)
        except PCDError as error:
            raise APIError(400, str(error), param=call.schema_param, code="unsupported_schema") from None

        def decide() -> list[Any]:
            return [
                engine.tools.call(
                    call.conversation,
                    call.tools,
                    tool_choice=call.tool_choice,
                    abstain_below=call.abstain_below,
                    max_tokens=call.max_tokens,
                    sampling=nth_sampling(call.sampling, index),
                    logprobs=call.logprobs,
                )
                for index in range(call.n)
            ]

        results = await while_connected(request, self._queued(self.batcher.exclusive(decide)))
        answers = [tool_message(call, r, i) for i, r in enumerate(results)]
        tokens = usage(results[0].prompt_tokens, sum(r.completion_tokens for r in results))
        self.metrics.on_tokens(tokens.prompt_tokens, tokens.completion_tokens)
        return Answered(answers, tokens, [r.timings_ms for r in results])

    async def _generate(self, call: GenerateCall, request: Request) -> Answered:
        engine = self.engine.rendered_with(dict(call.switches))

        def generations() -> list[Generation]:
            return [
                engine.generate(item, sampling=sampling, **_options(call)) for item, sampling in call.runs()
            ]

        answers = await while_connected(request, self._queued(self.batcher.exclusive(generations)))
        choices = [generated_choice(a, i, call.logprobs) for i, a in enumerate(answers)]
        prompt_tokens = sum(a.prompt_tokens for a in answers[:: call.n])
        total = usage(prompt_tokens, sum(a.completion_tokens for a in answers))
        self.metrics.on_tokens(total.prompt_tokens, total.completion_tokens)
        return Answered(choices, total, [a.timings_ms for a in answers])

    async def _stream_generation(self, call: GenerateCall) -> tuple[Any, asyncio.Queue[Any], threading.Event]:
        """Pieces go from the model worker to the event loop through a queue; the HTTP status is
        sent only once the first piece (or the call's error) is known."""
        loop = asyncio.get_running_loop()
        pieces: asyncio.Queue[Any] = asyncio.Queue()
        leave = threading.Event()  # set when the client has gone: generation stops at its next token
        engine = self.engine.rendered_with(dict(call.switches))

        def work() -> None:
            def put(item: Any) -> None:
                loop.call_soon_threadsafe(pieces.put_nowait, item)

            try:
                for index, (item, sampling) in enumerate(call.runs()):
                    if leave.is_set():
                        return
                    stream = engine.stream(item, sampling=sampling, **_options(call))
                    try:
                        for piece in stream:
                            put((index, piece))
                            if leave.is_set():
                                return
                    finally:
                        stream.close()
            except Exception as error:  # before the first piece it becomes the HTTP error
                put(error)
            finally:
                put(None)

        job = asyncio.ensure_future(self._queued(self.batcher.exclusive(work)))
        getter = asyncio.ensure_future(pieces.get())
        await asyncio.wait({job, getter}, return_when=asyncio.FIRST_COMPLETED)
        if job.done() and job.exception() is not None:  # refused before it ran (503, 504)
            getter.cancel()
            raise job.exception()  # type: ignore[misc]
        first = await getter
        if isinstance(first, Exception):
            await job
            param = "prompt" if call.prompts else "messages"
            raise engine_error(first, param) if isinstance(first, PCDError) else first
        return first, pieces, leave

    async def _queued(self, work: Any) -> Any:
        return await queued(work, self.settings.request_timeout_s)


async def _generated_chunks(
    call: GenerateCall,
    first: Any,
    pieces: asyncio.Queue[Any],
    leave: threading.Event,
    metrics: ServerMetrics,
) -> AsyncIterator[dict[str, Any]]:
    """The chunks of a streamed generation: per choice its role, its text pieces, its finish."""
    completion = ResponseWriter(call.model, bool(call.prompts))
    prompt_tokens, completion_tokens, opened = 0, 0, set()
    try:
        async for index, piece in drained(first, pieces, leave):
            if index not in opened:
                opened.add(index)
                yield completion.chunk([choice_delta(index, Delta(role="assistant", content=""))])
            if piece.text or piece.logprobs:
                logprobs = None
                if piece.logprobs is not None:
                    logprobs = token_logprobs(piece.logprobs, call.logprobs or 0)
                yield completion.chunk([choice_delta(index, Delta(content=piece.text), logprobs=logprobs)])
            if piece.finish_reason is not None:
                if index % call.n == 0:  # each prompt counted once
                    prompt_tokens += piece.prompt_tokens or 0
                completion_tokens += piece.completion_tokens or 0
                yield completion.chunk([choice_delta(index, Delta(), piece.finish_reason)])
        if call.include_usage:
            yield completion.chunk([], usage(prompt_tokens, completion_tokens))
    finally:
        metrics.on_tokens(prompt_tokens, completion_tokens)


def _answered(call: RequestCall, answers: list[Choice], tokens: Usage) -> Response:
    """Whole answers as one completion, or replayed as stream events: a structured answer or a
    decision is known only when whole, so each choice is one content (or tool call) chunk."""
    completion = ResponseWriter(call.model, not isinstance(call, ToolDecisionCall) and bool(call.prompts))
    if not call.stream:
        return JSONResponse(completion.body(answers, tokens))
    chunks = [completion.chunk([choice]) for answer in answers for choice in delta_chunks(answer)]
    if call.include_usage:
        chunks.append(completion.chunk([], tokens))
    return event_stream(replayed(chunks))


def _options(call: GenerateCall) -> dict[str, Any]:
    """The engine's `generate` / `stream` options of a generation call (all but input and sampling)."""
    return {
        "max_tokens": call.max_tokens,
        "stop": call.stop,
        "json_object": call.json_object,
        "grammar": call.grammar,
        "logprobs": call.logprobs,
    }
