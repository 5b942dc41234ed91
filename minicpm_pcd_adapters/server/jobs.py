"""What the server's endpoints share around the model worker: work cancelled when its client leaves,
engine errors as OpenAI error bodies, and server-sent events."""

from __future__ import annotations

import asyncio
import json
import logging
import threading
import time
from collections.abc import AsyncIterator, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

from fastapi import Request
from fastapi.responses import StreamingResponse

from minicpm_pcd_adapters.server.batching import QueueFull
from minicpm_pcd_adapters.server.errors import APIError
from minicpm_pcd_adapters.server.metrics import ServerMetrics
from pcd_engine import (
    GenerationChunk,
    InputError,
    PCDError,
    SchemaLimitError,
    StructuredOutputError,
    TokenizationError,
    UnsupportedSchemaError,
)

log = logging.getLogger("minicpm_pcd.server")


def engine_error(error: PCDError, input_param: str = "messages") -> APIError:
    """The HTTP error for an engine error: 500 for a model output that failed validation, else 400
    (an input error names `input_param`: "messages" in chat, "prompt" in completions)."""
    if isinstance(error, StructuredOutputError):
        return APIError(500, str(error), type="server_error", code="invalid_model_output")
    if isinstance(error, InputError):
        return APIError(400, str(error), param=input_param, code="invalid_input")
    if isinstance(error, (UnsupportedSchemaError, SchemaLimitError, TokenizationError)):
        return APIError(400, str(error), code="unsupported_schema")
    return APIError(400, str(error), code="invalid_request")


async def while_connected(request: Request, work: Any) -> Any:
    """`work`'s result; if the client disconnects first, the work is cancelled (a queued request is
    then dropped before it reaches the model)."""
    task = asyncio.ensure_future(work)

    async def watch() -> None:
        while not await request.is_disconnected():
            await asyncio.sleep(0.05)

    watcher = asyncio.ensure_future(watch())
    try:
        done, _ = await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watcher.cancel()
    if task not in done:
        task.cancel()
        raise APIError(499, "the client closed the connection", code="client_closed")
    return task.result()


@dataclass
class Observation:
    """What the request metrics record of one request: its kind and status, set as they are known."""

    kind: str = "other"
    status: int = 500


@contextmanager
def observed(metrics: ServerMetrics) -> Iterator[Observation]:
    """Count a request and time it (`pcd_requests_total{kind,status}`, the latency histogram), with the
    status of the APIError it raised, or 500 for any other error."""
    seen, started = Observation(), time.perf_counter()
    try:
        yield seen
    except APIError as error:
        seen.status = error.status
        raise
    finally:
        metrics.requests.labels(seen.kind, str(seen.status)).inc()
        metrics.latency.labels(seen.kind).observe(time.perf_counter() - started)


async def json_body(request: Request) -> Any:
    """The request's body read as JSON; APIError (400) when it is not JSON."""
    try:
        return json.loads(await request.body())
    except ValueError as error:
        raise APIError(400, f"the body is not valid JSON: {error}", code="invalid_json") from None


async def queued(work: Any, timeout_s: float) -> Any:
    """`work`'s result (a job given to the batcher), its refusals as HTTP errors: an engine error on
    the worker (400), a full queue (503), a request not answered within `timeout_s` (504)."""
    try:
        return await work
    except PCDError as error:  # a plain chat call's inputs, checked on the worker before generating
        raise engine_error(error) from None
    except QueueFull as error:
        message = f"the server is busy: {error}; retry later"
        raise APIError(503, message, type="server_error", code="overloaded") from None
    except asyncio.TimeoutError:  # a request still queued is dropped from its batch
        message = f"the request was not answered within {timeout_s} s"
        raise APIError(504, message, type="server_error", code="timeout") from None


async def drained(
    first: Any, pieces: asyncio.Queue[Any], leave: threading.Event
) -> AsyncIterator[tuple[int, GenerationChunk]]:
    """The (choice index, piece) items of a streamed generation, from its first item until the
    queue's None; an error mid-stream is logged and ends it (the status is sent already). `leave`
    is set at the end, so that generation stops if the client went first."""
    item = first
    try:
        while item is not None:
            if isinstance(item, Exception):
                log.error("generation failed mid-stream: %s", item)
                return
            yield item
            item = await pieces.get()
    finally:
        leave.set()


async def replayed(chunks: list[dict[str, Any]]) -> AsyncIterator[dict[str, Any]]:
    for chunk in chunks:
        yield chunk


def event_stream(chunks: AsyncIterator[dict[str, Any]]) -> StreamingResponse:
    async def lines() -> AsyncIterator[str]:
        async for chunk in chunks:
            yield f"data: {json.dumps(chunk, ensure_ascii=False)}\n\n"
        yield "data: [DONE]\n\n"

    return StreamingResponse(lines(), media_type="text/event-stream", headers={"Cache-Control": "no-cache"})
