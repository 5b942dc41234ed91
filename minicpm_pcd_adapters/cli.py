"""`pcd classify`: classify every line of a file into a Pydantic schema, one JSON line per input.

    pcd classify --schema examples/ticket.py:Ticket --input examples/tickets.txt \
        --output out/tickets.jsonl --model smollm2

Input: `.jsonl`/`.ndjson`/`.json` files hold one JSON value per line (an object with a `text` key,
or a string); any other file is plain text, one input per line. Every input line gets one output
line: its value and probabilities, or an error record. No input is dropped.
"""

from __future__ import annotations

import argparse
import importlib
import importlib.util
import json
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from pydantic import BaseModel
from tqdm import tqdm

from minicpm_pcd_adapters.minicpm import MINICPM5_2B, load_minicpm5
from minicpm_pcd_adapters.smollm2 import load_smollm2
from pcd_engine import RULES, PCDEngine, PCDError

MODELS = {"minicpm5-2b": load_minicpm5, "smollm2": load_smollm2}
JSON_SUFFIXES = {".jsonl", ".ndjson", ".json"}


def main(argv: Sequence[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    try:
        schema = load_schema(args.schema)
        engine = load_engine(
            args.model,
            device=args.device,
            dtype=args.dtype,
            rule=args.rule,
            allow_generation=False if args.no_generation else None,
        )
        engine.plan(schema, instructions=args.instructions)  # schema errors before reading input
    except (PCDError, ImportError, AttributeError, TypeError, ValueError) as error:
        print(f"pcd: error: {error}", file=sys.stderr)
        return 2
    records = read_inputs(Path(args.input), args.text_key)
    written = classify_records(engine, schema, records, args.instructions, Path(args.output))
    errors = sum(1 for r in written if r.get("error"))
    print(f"pcd: {len(written) - errors} classified, {errors} errors -> {args.output}", file=sys.stderr)
    return 0


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="pcd", description=__doc__.split("\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    run = sub.add_parser("classify", help="classify every line of a file")
    run.add_argument("--schema", required=True, help="module:Class or path/to/file.py:Class")
    run.add_argument("--input", required=True, help=".jsonl (objects with 'text', or strings) or text lines")
    run.add_argument("--output", required=True, help="JSONL file to write, one line per input")
    run.add_argument(
        "--model",
        default="minicpm5-2b",
        help=f"short name ({', '.join(MODELS)}), hub id, local folder or .gguf file "
        f"(default: minicpm5-2b = {MINICPM5_2B.hub_id}@{MINICPM5_2B.revision})",
    )
    run.add_argument("--rule", choices=sorted(RULES), default=None, help="scoring rule (default: engine's)")
    run.add_argument("--instructions", default=None, help="system instructions replacing the default")
    run.add_argument("--text-key", default="text", help="key of the text in JSONL objects")
    run.add_argument(
        "--no-generation",
        action="store_true",
        help="refuse schemas with open fields (free text, numbers, lists) instead of generating them",
    )
    run.add_argument("--device", default="auto")
    run.add_argument("--dtype", default=None, help="float32 (default), bfloat16, float16")
    return parser


def load_schema(spec: str) -> type[BaseModel]:
    module_name, sep, attr = spec.rpartition(":")
    if not sep or not module_name or not attr:
        raise ValueError(f"--schema must be module:Class or file.py:Class, got {spec!r}")
    if module_name.endswith(".py"):
        path = Path(module_name)
        loader_spec = importlib.util.spec_from_file_location(path.stem, path)
        if loader_spec is None or loader_spec.loader is None:
            raise ImportError(f"cannot import {path}")
        module = importlib.util.module_from_spec(loader_spec)
        sys.modules[path.stem] = module
        loader_spec.loader.exec_module(module)
    else:
        sys.path.insert(0, str(Path.cwd()))
        module = importlib.import_module(module_name)
    schema = getattr(module, attr)
    if not (isinstance(schema, type) and issubclass(schema, BaseModel)):
        raise TypeError(f"{spec} is not a pydantic BaseModel subclass")
    return schema


def load_engine(model: str, **options: Any) -> PCDEngine:
    options = {k: v for k, v in options.items() if v is not None}
    if model.lower() in MODELS:
        return MODELS[model.lower()](**options)
    return PCDEngine.from_pretrained(model, **options)


def read_inputs(path: Path, text_key: str) -> list[dict[str, Any]]:
    """One record per line: {"line", "text"} or {"line", "error"}; an `id` key is carried along."""
    records = []
    as_json = path.suffix.lower() in JSON_SUFFIXES
    with path.open(encoding="utf-8") as handle:
        for number, line in enumerate(handle, start=1):
            line = line.rstrip("\r\n")
            record: dict[str, Any] = {"line": number}
            try:
                text, extra = _parse_line(line, as_json, text_key)
                record.update(extra, text=text)
            except ValueError as error:
                record["error"] = {"type": "InputError", "message": str(error)}
            records.append(record)
    return records


def _parse_line(line: str, as_json: bool, text_key: str) -> tuple[str, dict[str, Any]]:
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


def classify_records(
    engine: PCDEngine,
    schema: type[BaseModel],
    records: list[dict[str, Any]],
    instructions: str | None,
    output: Path,
) -> list[dict[str, Any]]:
    todo = [r for r in records if "error" not in r]
    with tqdm(total=len(todo), desc="classify", unit="text", file=sys.stderr) as bar:
        results = engine.classify_batch(
            [r["text"] for r in todo],
            schema,
            instructions=instructions,
            return_exceptions=True,
            progress=bar.update,
        )
    for record, result in zip(todo, results, strict=True):
        if isinstance(result, PCDError):
            record["error"] = {"type": type(result).__name__, "message": str(result)}
        else:
            record.update(result.to_json())
        del record["text"]
    output.parent.mkdir(parents=True, exist_ok=True)
    with output.open("w", encoding="utf-8") as handle:
        for record in records:
            record.pop("text", None)
            handle.write(json.dumps(record, ensure_ascii=False) + "\n")
    return records


if __name__ == "__main__":
    raise SystemExit(main())
