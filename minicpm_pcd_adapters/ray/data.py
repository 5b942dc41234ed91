"""Classify a Ray Dataset: one engine per actor, `classify_batch` on every block (the `[ray]` extra).

`classify_dataset(ds, Schema, model=...)` maps the dataset's batches through an actor pool
(`ray.data.ActorPoolStrategy`): each actor loads the engine once and answers its batches with
`classify_batch(..., return_exceptions=True)`, so a bad row becomes an error row and never fails the
job. Output rows keep every input column and add:

    pcd_object        the answer as JSON (None for an error row)
    pcd.<path>        each field's value (scored or generated; lists and objects as JSON)
    pcd.<path>.confidence   each scored field's probability (None for generated fields)
    pcd_needs_review  True when a field abstained
    pcd_error_type, pcd_error   the error's type and message (None when answered)

A row that arrives with a `pcd_error` already set (the CLI's unreadable lines) is passed through as an
error row. Actors that die are restarted by Ray and their batches retried (`max_restarts`,
`max_task_retries`), so every input appears in the output exactly once.

The schema crosses process boundaries: a Pydantic class (pickled by Ray; a class that cannot be
pickled raises UnsupportedSchemaError before the job starts, asking for its import path instead), an
import path `"module:Class"` / `"path/file.py:Class"`, or a JSON-schema dict.

    >>> ds = ray.data.read_parquet("tickets/")  # doctest: +SKIP
    >>> out = classify_dataset(  # doctest: +SKIP
    ...     ds, Ticket, model="openbmb/MiniCPM5-2B", actors=4, num_gpus=1, batch_size=64
    ... )
    >>> out.write_parquet("answers/")  # doctest: +SKIP
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from typing import Any

from pcd_engine import Calibration, Limits, PCDError, UnsupportedSchemaError, compile_schema, output_type

PREFIX = "pcd."
# An actor that dies is restarted this many times and its batches retried as often (Ray Data's own
# default is forever, which loops on a crash that repeats, e.g. running out of memory at load). Ray
# 2.64 drops these as keyword arguments of map_batches: the [ray] extra pins below it until Ray Data
# names them.
RESTARTS = 3


def classify_dataset(
    ds: Any,
    schema: Any,
    *,
    model: str = "minicpm5-2b",
    text_column: str = "text",
    batch_size: int | None = 32,
    actors: int = 1,
    num_gpus: float = 0,
    num_cpus: float | None = None,
    engine_options: Mapping[str, Any] | None = None,
    **classify_options: Any,
) -> Any:
    """A lazy `ray.data.Dataset` of answers to `ds[text_column]` (see the module docstring).

    `model`: as `pcd classify --model` (a short name, hub id, folder or .gguf file); `engine_options`
    go to the engine's loader (`device`, `dtype`, `rule`, ...); `classify_options` to every
    `classify_batch` (`instructions`, `calibration`, `abstain_below`, `examples`, ...; `calibration`
    may be a file path, which each actor loads with its heads' weights). `actors`
    engines run at once, each with `num_gpus` GPUs (GPU actors need an explicit `batch_size`).
    """
    import ray.data

    if num_gpus and batch_size is None:
        raise ValueError("GPU actors need an explicit batch_size (see benchmarks/gpu.py for sizes)")
    if actors < 1:
        raise ValueError(f"actors must be at least 1, got {actors}")
    portable = portable_schema(schema)
    columns = result_columns(resolve_schema(portable))
    remote_args: dict[str, Any] = {"max_restarts": RESTARTS, "max_task_retries": RESTARTS}
    if num_cpus is not None:
        remote_args["num_cpus"] = num_cpus
    return ds.map_batches(
        Classifier,
        fn_constructor_kwargs={
            "model": model,
            "schema": portable,
            "text_column": text_column,
            "columns": columns,
            "engine_options": dict(engine_options or {}),
            "classify_options": classify_options,
        },
        batch_size=batch_size,
        batch_format="pandas",
        compute=ray.data.ActorPoolStrategy(size=actors),
        num_gpus=num_gpus,
        **remote_args,
    )


def portable_schema(schema: Any) -> Any:
    """The schema as it travels to the actors; schema errors here, before any job starts."""
    if isinstance(schema, str):
        return schema
    output_type(schema)  # UnsupportedSchemaError for anything that is not a schema
    if isinstance(schema, type):
        from ray import cloudpickle

        try:
            cloudpickle.dumps(schema)
        except Exception as error:
            raise UnsupportedSchemaError(
                "<root>",
                schema,
                f"it cannot be pickled for Ray's workers ({error}); pass its import path "
                "'module:Class' or its JSON schema (Class.model_json_schema()) instead",
            ) from error
    return schema


def resolve_schema(schema: Any) -> Any:
    """An import path made into its class; classes and dicts as they are."""
    if isinstance(schema, str):
        from minicpm_pcd_adapters.by_name import load_schema

        return load_schema(schema)
    return schema


def result_columns(schema: Any) -> list[str]:
    """The field paths that get a column, fixed by the schema so that every block has the same ones."""
    compiled = compile_schema(output_type(schema).model, Limits(), allow_open=True)
    scored = [d.path for d in compiled.decisions]
    generated = [f.path for f in compiled.open_fields]
    return scored + [p for p in generated if p not in scored]


class Classifier:
    """The actor: loads the engine once, then answers batches (pandas DataFrames)."""

    def __init__(
        self,
        model: str,
        schema: Any,
        text_column: str,
        columns: list[str],
        engine_options: dict[str, Any],
        classify_options: dict[str, Any],
    ) -> None:
        from minicpm_pcd_adapters.by_name import load_engine

        self.engine = load_engine(model, **engine_options)
        self.schema = resolve_schema(schema)
        calibration = classify_options.get("calibration")
        if isinstance(calibration, str | os.PathLike):  # a path: each actor loads it (and its heads)
            classify_options = {**classify_options, "calibration": Calibration.load(os.fspath(calibration))}
        self.text_column, self.columns, self.options = text_column, columns, classify_options

    def __call__(self, batch: Any) -> Any:
        out = batch.copy()
        texts: list[Any] = (
            batch[self.text_column].tolist() if self.text_column in batch else [None] * len(batch)
        )
        prior: list[Any] = batch["pcd_error"].tolist() if "pcd_error" in batch else [None] * len(batch)
        prior = [None if _missing(error) else str(error) for error in prior]
        todo = [i for i, error in enumerate(prior) if error is None]
        results: list[Any] = [None] * len(batch)
        answers = self.engine.classify_batch(
            [texts[i] for i in todo], self.schema, return_exceptions=True, **self.options
        )
        for i, answer in zip(todo, answers, strict=True):
            results[i] = answer
        rows = [self._row(result, prior_error) for result, prior_error in zip(results, prior, strict=True)]
        names: list[str] = list(rows[0] if rows else self._row(None, ""))
        for name in names:
            out[name] = [row[name] for row in rows]
        return out

    def _row(self, result: Any, prior_error: Any) -> dict[str, Any]:
        row: dict[str, Any] = {"pcd_object": None, "pcd_needs_review": None}
        for path in self.columns:
            row[PREFIX + path] = None
            row[PREFIX + path + ".confidence"] = None
        row["pcd_error_type"], row["pcd_error"] = None, None
        if result is None:
            row["pcd_error_type"], row["pcd_error"] = "InputError", str(prior_error)
        elif isinstance(result, PCDError):
            row["pcd_error_type"], row["pcd_error"] = type(result).__name__, str(result)
        else:
            answer = result.to_json()
            row["pcd_object"] = json.dumps(answer["value"], ensure_ascii=False)
            row["pcd_needs_review"] = result.needs_review
            for path, field in result.fields.items():
                if PREFIX + path in row:
                    value = field.value
                    row[PREFIX + path] = json.dumps(value) if isinstance(value, (list, dict)) else value
                    row[PREFIX + path + ".confidence"] = field.confidence
        return row


def _missing(value: Any) -> bool:
    """None, or pandas' marker of a missing value (NaN, NA)."""
    import pandas

    return value is None or (not isinstance(value, str) and bool(pandas.isna(value)))
