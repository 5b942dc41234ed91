"""Files and folders classified on a Ray cluster, one output shard per input file: `pcd classify --ray`.

Inputs are JSONL (`.jsonl`, `.ndjson`, `.json`: an object with the text key, or a string, per line),
plain text (any other suffix: a text per line) or Parquet (`.parquet`: the text column); a folder means
every such file in it, recursively. Each input file becomes `OUTPUT/<relative path>.<format>`
(Parquet or JSONL), written whole under a temporary name and renamed when complete, so a rerun skips
the shards already done and redoes a shard that was interrupted. Line files keep their `line` numbers
(1-based, blank and unreadable lines become error rows); Parquet rows get their `row` index (0-based).
The dataset keeps its order (`preserve_order`), which is what makes those numbers right.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping
from contextlib import nullcontext
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from minicpm_pcd_adapters.files import JSON_SUFFIXES, count_lines, parse_line
from minicpm_pcd_adapters.ray.data import classify_dataset

SUFFIXES = (*sorted(JSON_SUFFIXES), ".txt", ".parquet")
FORMATS = ("parquet", "jsonl")


@dataclass
class ShardSummary:
    shards: int = 0  # input files
    skipped: int = 0  # shards complete from an earlier run
    rows: int = 0  # rows written by this run
    errors: int = 0  # of which error rows


def input_files(source: Path) -> list[Path]:
    """The files to classify: `source` itself, or every input file under a folder (sorted)."""
    if source.is_file():
        return [source]
    if not source.is_dir():
        raise FileNotFoundError(f"--input {source}: no such file or folder")
    found = sorted(p for p in source.rglob("*") if p.is_file() and p.suffix.lower() in SUFFIXES)
    if not found:
        raise FileNotFoundError(f"--input {source}: no {', '.join(SUFFIXES)} files in it")
    return found


def rows_in(path: Path) -> int:
    if path.suffix.lower() == ".parquet":
        import pyarrow.parquet as pq

        return int(pq.ParquetFile(path).metadata.num_rows)
    return count_lines(path)


def shard_dataset(path: Path, text_key: str) -> tuple[Any, str, str]:
    """(dataset, text column, number column name) of one input file."""
    import ray.data

    if path.suffix.lower() == ".parquet":
        return ray.data.read_parquet(str(path)), text_key, "row"
    as_json = path.suffix.lower() in JSON_SUFFIXES
    lines = ray.data.read_text(str(path), drop_empty_lines=False)
    return lines.map_batches(_LineParser(as_json, text_key), batch_format="pandas"), "text", "line"


class _LineParser:
    """Raw lines -> `text` (None for a bad line), `id` (JSONL objects that have one), `pcd_error`."""

    def __init__(self, as_json: bool, text_key: str) -> None:
        self.as_json, self.text_key = as_json, text_key

    def __call__(self, batch: Any) -> Any:
        texts: list[str | None] = []
        ids: list[str | None] = []
        errors: list[str | None] = []
        for line in batch["text"].tolist():
            try:
                text, extra = parse_line(line, self.as_json, self.text_key)
                texts.append(text)
                ids.append(json.dumps(extra["id"]) if "id" in extra else None)
                errors.append(None)
            except ValueError as error:
                texts.append(None)
                ids.append(None)
                errors.append(str(error))
        out = batch.copy()
        out["text"], out["pcd_error"] = texts, errors
        if self.as_json:
            out["id"] = ids  # as JSON, whatever its type in the input
        return out


def classify_files(
    source: Path,
    output: Path,
    schema: Any,
    *,
    model: str,
    output_format: str = "parquet",
    text_key: str = "text",
    actors: int = 1,
    batch_size: int = 32,
    num_gpus: float = 0,
    engine_options: Mapping[str, Any] | None = None,
    progress: Callable[[int], None] | None = None,
    **classify_options: Any,
) -> ShardSummary:
    """Classify every input file into its output shard (see the module docstring); `progress(n)` is
    called as rows are written (and with each skipped shard's rows)."""
    import ray.data

    if output_format not in FORMATS:
        raise ValueError(f"output format must be one of {FORMATS}, got {output_format!r}")
    ray.data.DataContext.get_current().execution_options.preserve_order = True
    files = input_files(source)
    summary = ShardSummary(shards=len(files))
    for path in files:
        relative = path.relative_to(source) if source.is_dir() else Path(path.name)
        target = output / relative.with_suffix(relative.suffix + "." + output_format)
        if target.exists():
            summary.skipped += 1
            if progress is not None:
                progress(rows_in(path))
            continue
        ds, text_column, number = shard_dataset(path, text_key)
        answers = classify_dataset(
            ds,
            schema,
            model=model,
            text_column=text_column,
            batch_size=batch_size,
            actors=actors,
            num_gpus=num_gpus,
            engine_options=engine_options,
            **classify_options,
        )
        target.parent.mkdir(parents=True, exist_ok=True)
        partial = target.with_name(target.name + ".partial")
        written, errors = _write(answers, partial, output_format, number, progress)
        partial.replace(target)  # complete: a rerun skips it
        summary.rows += written
        summary.errors += errors
    return summary


def _write(
    answers: Any, path: Path, output_format: str, number: str, progress: Callable[[int], None] | None
) -> tuple[int, int]:
    import pyarrow as pa
    import pyarrow.parquet as pq

    tables, written, errors = [], 0, 0
    first = 1 if number == "line" else 0
    with path.open("w", encoding="utf-8") if output_format == "jsonl" else nullcontext() as handle:
        for batch in answers.iter_batches(batch_format="pyarrow", batch_size=None):
            numbers = pa.array(range(first + written, first + written + batch.num_rows))
            batch = batch.add_column(0, number, numbers)
            errors += sum(1 for e in batch.column("pcd_error").to_pylist() if e is not None)
            written += batch.num_rows
            if handle is not None:
                for row in batch.to_pylist():
                    handle.write(json.dumps(row, ensure_ascii=False, default=str) + "\n")
                handle.flush()
            else:
                tables.append(batch)
            if progress is not None:
                progress(batch.num_rows)
    if output_format == "parquet":
        table = pa.concat_tables(tables, promote_options="permissive") if tables else pa.table({number: []})
        pq.write_table(table, path)
    return written, errors
