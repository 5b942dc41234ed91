"""Classify a file line by line, streaming and resumable: what `pcd classify` runs.

Inputs are read lazily and answered in chunks of `batch_size` through `classify_batch`; each chunk's
records are written and flushed as it completes, so memory stays flat in the input's size and an
interruption loses at most the chunk in flight. Every input line gets exactly one output record with
its line number (and its `id`, for a JSONL object that has one): the answer, or an error record.
With `resume`, lines already answered in the output are skipped; a torn last line (the process was
killed while writing it) is cut off and its input answered again. Commands whose output must stay a
clean file (`suggest`, `label`) put their error records beside it (`write_errors`).
"""

from __future__ import annotations

import json
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from itertools import islice
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

from pcd_engine import PCDError

if TYPE_CHECKING:
    from pcd_engine import PCDEngine

JSON_SUFFIXES = {".jsonl", ".ndjson", ".json"}
T = TypeVar("T")


@dataclass
class Summary:
    written: int = 0  # records written by this run
    errors: int = 0  # of which error records
    needs_review: int = 0  # answers with abstained fields
    skipped: int = 0  # lines answered by an earlier run (resume)
    stopped: bool = False  # a stop was requested before the input ended


def iter_inputs(path: Path, text_key: str) -> Iterator[dict[str, Any]]:
    """One record per line, lazily: {"line", "text"} or {"line", "error"}; an `id` key is carried."""
    as_json = path.suffix.lower() in JSON_SUFFIXES
    with path.open(encoding="utf-8", errors="surrogateescape") as handle:
        for number, line in enumerate(handle, start=1):
            record: dict[str, Any] = {"line": number}
            try:
                text, extra = parse_line(line.rstrip("\r\n"), as_json, text_key)
                record.update(extra, text=text)
            except ValueError as error:
                record["error"] = {"type": "InputError", "message": str(error)}
            yield record


def parse_line(line: str, as_json: bool, text_key: str) -> tuple[str, dict[str, Any]]:
    if not line.strip():
        raise ValueError("empty line")
    if not as_json:
        return line, {}
    try:
        value = json.loads(line)
    except json.JSONDecodeError as error:
        raise ValueError(f"malformed JSON: {error}") from None
    if isinstance(value, str):
        return value, {}
    if isinstance(value, dict) and isinstance(value.get(text_key), str):
        return value[text_key], ({"id": value["id"]} if "id" in value else {})
    raise ValueError(f"expected a JSON string or an object with a string {text_key!r}")


def count_lines(path: Path) -> int:
    with path.open("rb") as handle:
        return sum(chunk.count(b"\n") for chunk in iter(lambda: handle.read(1 << 20), b"")) + _unterminated(
            path
        )


def _unterminated(path: Path) -> int:
    """1 if the file's last line has no newline (it is still a line), else 0."""
    size = path.stat().st_size
    if size == 0:
        return 0
    with path.open("rb") as handle:
        handle.seek(size - 1)
        return int(handle.read(1) != b"\n")


def answered_lines(output: Path) -> set[int]:
    """Line numbers already answered in `output`; a torn last record is cut off the file."""
    return set(whole_records(output, lambda record: int(record["line"])))


def whole_records(output: Path, read: Callable[[Any], T]) -> list[T]:
    """`read` of each whole record of the JSONL file `output`, from its start up to the first torn
    or foreign one (a line without its newline, not JSON, or one `read` refuses with ValueError,
    KeyError or TypeError), which is cut off the file with everything after it: a resumed run
    answers those lines again."""
    if not output.exists():
        return []
    done: list[T] = []
    keep = 0  # bytes of whole, readable records
    with output.open("rb") as handle:
        for raw in handle:
            try:
                if not raw.endswith(b"\n"):
                    raise ValueError("torn")
                done.append(read(json.loads(raw)))
            except (ValueError, KeyError, TypeError):
                break  # a torn or foreign line: everything from here is redone
            keep += len(raw)
    if keep < output.stat().st_size:
        with output.open("r+b") as handle:
            handle.truncate(keep)
    return done


def errors_path(output: Path) -> Path:
    """Where a command whose output stays a clean file (`suggest`, `label`) writes its error records."""
    return output.with_name(output.stem + ".errors.jsonl")


def write_errors(output: Path, errors: list[dict[str, Any]]) -> Path:
    """Write `errors` (records with a `line`) in line order beside `output`, or remove an earlier
    run's file when there are none; returns its path."""
    side = errors_path(output)
    if errors:
        with side.open("w", encoding="utf-8") as handle:
            for e in sorted(errors, key=lambda e: e["line"]):
                handle.write(json.dumps(e, ensure_ascii=False) + "\n")
    elif side.exists():
        side.unlink()  # from an earlier run
    return side


def classify_file(
    engine: PCDEngine,
    schema: Any,
    source: Path,
    output: Path,
    *,
    text_key: str = "text",
    batch_size: int = 32,
    resume: bool = False,
    stop: threading.Event | None = None,
    progress: Callable[[int], None] | None = None,
    **options: Any,
) -> Summary:
    """Answer every line of `source` into `output` (JSONL), a chunk at a time; `options` go to
    `classify_batch`. Stops after the current chunk once `stop` is set."""
    done = answered_lines(output) if resume else set()
    summary = Summary(skipped=len(done))
    if progress is not None and done:
        progress(len(done))  # the bar counts every line, the earlier run's too
    pending = (r for r in iter_inputs(source, text_key) if r["line"] not in done)
    with output.open("a" if resume else "w", encoding="utf-8", errors="surrogateescape") as handle:
        while not (stop is not None and stop.is_set()):
            chunk = list(islice(pending, batch_size))
            if not chunk:
                return summary
            answer_chunk(engine, schema, chunk, options)
            for record in chunk:
                handle.write(json.dumps(record, ensure_ascii=False) + "\n")
                summary.errors += "error" in record
                summary.needs_review += bool(record.get("needs_review"))
            handle.flush()
            summary.written += len(chunk)
            if progress is not None:
                progress(len(chunk))
    summary.stopped = next(pending, None) is not None
    return summary


def answer_chunk(
    engine: PCDEngine, schema: Any, chunk: list[dict[str, Any]], options: dict[str, Any]
) -> None:
    """Fill each record of the chunk with its answer or error, in place (its text removed)."""
    todo = [r for r in chunk if "error" not in r]
    results = engine.classify_batch([r["text"] for r in todo], schema, return_exceptions=True, **options)
    for record, result in zip(todo, results, strict=True):
        if isinstance(result, PCDError):
            record["error"] = {"type": type(result).__name__, "message": str(result)}
        else:
            record.update(result.to_json())
    for record in chunk:
        record.pop("text", None)
