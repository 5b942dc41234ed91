"""OpenAI batch files answered by the server's own app, in process: what `pcd run-batch` runs (the
format vLLM's `run-batch` reads).

Each input line is a request, `{"custom_id", "method": "POST", "url", "body"}`, for
`/v1/chat/completions`, `/v1/completions` or `/v1/classify` (and `/classify`). The lines are sent to
the ASGI app of `pcd serve` through httpx's in-process transport (no socket, no port), `concurrency`
at a time, so the server's batcher groups scored requests with the same schema across lines into one
`classify_batch`, exactly as it groups concurrent HTTP clients; every answer is what `pcd serve` would
send. Every input line gets one output line, in input order, in OpenAI's batch output shape:

    {"id": "batch_req_...", "custom_id": "...", "response": {"status_code": 200, "request_id": "...",
     "body": {...}}, "error": null}

A request the server refuses keeps its status and error body in `response` (as OpenAI's batches do); a
line that is not a request at all (not JSON, no `body`, another `url` or method, or a `custom_id` an
earlier line holds, which OpenAI refuses) gets `response: null` and an `error` naming the line, and the
run goes on, and no `custom_id` names two answers. Lines are answered in windows of `concurrency`;
each window's records are written and flushed in input order as it completes, so `resume` skips the
lines already answered (counting whole records; a torn last one is cut off) and an interruption loses
at most the window in flight.
"""

from __future__ import annotations

import asyncio
import json
import secrets
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from itertools import islice
from pathlib import Path
from typing import Any

import httpx

from minicpm_pcd_adapters.files import whole_records

URLS = ("/v1/chat/completions", "/v1/completions", "/v1/classify", "/classify")


@dataclass
class BatchSummary:
    written: int = 0  # records written by this run
    failed: int = 0  # of which with an error, or a status other than 200
    skipped: int = 0  # lines answered by an earlier run (resume)
    stopped: bool = False  # a stop was requested before the input ended


def repeated_ids(source: Path) -> dict[int, int]:
    """Lines (numbered from 1) whose `custom_id` an earlier line holds, each with that first line:
    read once over the whole file, so that every part of a `--ray` run agrees."""
    first: dict[str, int] = {}
    repeated = {}
    with source.open(encoding="utf-8") as lines:
        for number, line in enumerate(lines, start=1):
            try:
                custom_id = json.loads(line).get("custom_id")
            except (ValueError, AttributeError):
                continue  # not a request: its own error record says so
            if isinstance(custom_id, str) and custom_id:
                repeated_line = first.setdefault(custom_id, number)
                if repeated_line != number:
                    repeated[number] = repeated_line
    return repeated


def answered_records(output: Path) -> int:
    """How many whole batch records (objects with a `custom_id`) `output` holds from its start; a
    torn or foreign line and everything after it is cut off the file (`files.whole_records`)."""
    return len(whole_records(output, lambda record: record["custom_id"]))


def run_batch_file(
    app: Any,
    source: Path,
    output: Path,
    *,
    headers: dict[str, str] | None = None,
    concurrency: int = 64,
    resume: bool = False,
    stop: threading.Event | None = None,
    progress: Callable[[int], None] | None = None,
    lines: tuple[int, int] | None = None,
    repeated: dict[int, int] | None = None,
) -> BatchSummary:
    """Answer every line of `source` with `app` (the server's ASGI app) into `output`; with `lines`
    (start, end), only the lines from index `start` (0-based) up to `end`, excluded: one part of the
    file (`pcd run-batch --ray`). `repeated`: `repeated_ids(source)`, when the caller has it."""
    part = lines or (0, None)
    repeats = repeated if repeated is not None else repeated_ids(source)
    return asyncio.run(
        _run(app, source, output, headers or {}, concurrency, resume, stop, progress, part, repeats)
    )


async def _run(
    app: Any,
    source: Path,
    output: Path,
    headers: dict[str, str],
    concurrency: int,
    resume: bool,
    stop: threading.Event | None,
    progress: Callable[[int], None] | None,
    part: tuple[int, int | None],
    repeated: dict[int, int],
) -> BatchSummary:
    summary = BatchSummary(skipped=answered_records(output) if resume else 0)
    if progress is not None and summary.skipped:
        progress(summary.skipped)
    transport = httpx.ASGITransport(app=app)
    async with (
        app.router.lifespan_context(app),  # the server's start-up and shut-down, as uvicorn runs them
        httpx.AsyncClient(
            transport=transport, base_url="http://batch", headers=headers, timeout=None
        ) as client,
    ):
        with (
            source.open(encoding="utf-8") as lines,
            output.open("a" if resume else "w", encoding="utf-8") as out,
        ):
            start, end = part[0] + summary.skipped, part[1]
            numbered: Iterator[tuple[int, str]] = islice(enumerate(lines, start=1), start, end)
            while window := list(islice(numbered, concurrency)):
                if stop is not None and stop.is_set():
                    summary.stopped = True
                    break
                records = await asyncio.gather(
                    *(_answer(client, number, line, repeated.get(number)) for number, line in window)
                )
                for record in records:
                    out.write(json.dumps(record, ensure_ascii=False) + "\n")
                    summary.written += 1
                    response = record["response"]
                    summary.failed += record["error"] is not None or response["status_code"] != 200
                out.flush()
                if progress is not None:
                    progress(len(window))
    return summary


async def _answer(client: httpx.AsyncClient, number: int, line: str, first: int | None) -> dict[str, Any]:
    """One line's record: the server's answer to its request, or an error naming the line (`first`:
    the earlier line that holds its `custom_id`)."""
    custom_id = None
    try:
        request = json.loads(line)
        if not isinstance(request, dict):
            raise ValueError("a batch line must be a JSON object")
        custom_id = request.get("custom_id")
        if not isinstance(custom_id, str) or not custom_id:
            raise ValueError("custom_id must be a non-empty string")
        if request.get("method", "POST") != "POST":
            raise ValueError(f"method must be POST, got {request.get('method')!r}")
        url = request.get("url")
        if url not in URLS:
            raise ValueError(f"url must be one of {', '.join(URLS)}, got {url!r}")
        if not isinstance(request.get("body"), dict):
            raise ValueError("body must be a JSON object (the request's body)")
        if request["body"].get("stream"):
            raise ValueError("stream is not supported in a batch file: each answer is written whole")
        if first is not None:
            raise LookupError(f"custom_id {custom_id!r} is already used by line {first}: they must be unique")
    except (ValueError, LookupError) as error:
        code = "invalid_json" if isinstance(error, json.JSONDecodeError) else "invalid_request"
        code = "duplicate_custom_id" if isinstance(error, LookupError) else code
        message = f"line {number}: {error}"
        return _record(custom_id, None, {"code": code, "message": message, "line": number})
    answer = await client.post(url, json=request["body"])
    response = {"status_code": answer.status_code, "request_id": secrets.token_hex(12), "body": answer.json()}
    return _record(custom_id, response, None)


def _record(
    custom_id: str | None, response: dict[str, Any] | None, error: dict[str, Any] | None
) -> dict[str, Any]:
    return {
        "id": "batch_req_" + secrets.token_hex(12),
        "custom_id": custom_id,
        "response": response,
        "error": error,
    }
