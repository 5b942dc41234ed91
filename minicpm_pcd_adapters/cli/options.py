"""What the `pcd` commands share: input, model and engine options; path and labeled-file checks.

Everything here runs before a model loads, so a bad option or path costs no loading time.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path
from typing import Any

from minicpm_pcd_adapters.loaders import MODELS, load_engine, load_schema
from minicpm_pcd_adapters.minicpm import MINICPM5_2B
from pcd_engine import RULES, TEXT_FRAMINGS, Calibration, PCDEngine, PCDError

# what a command turns into exit code 2 (usage, path, schema or loading errors)
SETUP_ERRORS = (PCDError, ImportError, AttributeError, TypeError, ValueError, OSError)


def fail(error: object) -> int:
    print(f"pcd: error: {error}", file=sys.stderr)
    return 2


def input_options(parser: argparse.ArgumentParser, input_help: str) -> None:
    parser.add_argument("--schema", required=True, help="module:Class or path/to/file.py:Class")
    parser.add_argument("--input", required=True, help=input_help)
    model_options(parser)
    parser.add_argument("--instructions", default=None, help="system instructions replacing the default")
    parser.add_argument("--text-key", default="text", help="key of the text in JSONL objects")


def model_options(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--model",
        default="minicpm5-2b",
        help=f"short name ({', '.join(MODELS)}), hub id, local folder or .gguf file "
        f"(default: minicpm5-2b = {MINICPM5_2B.hub_id}@{MINICPM5_2B.revision})",
    )
    parser.add_argument(
        "--rule", choices=sorted(RULES), default=None, help="scoring rule (default: engine's)"
    )
    parser.add_argument("--device", default="auto", help="auto (default), cpu, cuda, cuda:1 ...")
    parser.add_argument("--dtype", default=None, help="float32 (default), bfloat16, float16")
    parser.add_argument("--manifest", default=None, help="check the model files against this manifest "
        "(`pcd manifest create`) before loading them")  # fmt: skip
    parser.add_argument("--text-framing", choices=TEXT_FRAMINGS, default=None, help="how the text sits "
        "in the prompt (default: turn; see docs/benchmarks.md on injected instructions)")  # fmt: skip


def engine_options(args: argparse.Namespace) -> dict[str, Any]:
    """The model options every command shares (None: the engine's default)."""
    return {
        "device": args.device,
        "dtype": args.dtype,
        "rule": args.rule,
        "manifest": str(Path(args.manifest).resolve()) if args.manifest else None,  # for Ray workers too
        "text_framing": args.text_framing,
    }


def check_paths(args: argparse.Namespace) -> None:
    """Input and output paths, checked before the model loads (OSError / ValueError)."""
    source = Path(args.input)
    if not source.is_file():
        raise FileNotFoundError(f"--input {source}: no such file")
    with source.open("rb"):
        pass  # readable
    target = getattr(args, "output", None)
    if target is None:
        return
    target = Path(target)
    if target.is_dir():
        raise IsADirectoryError(f"--output {target} is a folder; name a file")
    target.parent.mkdir(parents=True, exist_ok=True)
    if not os.access(target.parent, os.W_OK) or (target.exists() and not os.access(target, os.W_OK)):
        raise PermissionError(f"--output {target}: not writable")


def read_labeled(path: Path, text_key: str, label_key: str) -> list[tuple[str, dict[str, Any] | None]]:
    """(text, label or None) per line of a JSONL file; ValueError naming the line for a bad one."""
    rows = []
    with path.open(encoding="utf-8") as handle:
        for number, line in enumerate(handle, start=1):
            if not line.strip():
                continue
            try:
                value = json.loads(line)
            except json.JSONDecodeError as error:
                raise ValueError(f"{path}:{number}: malformed JSON: {error}") from None
            if not isinstance(value, dict) or not isinstance(value.get(text_key), str):
                raise ValueError(f"{path}:{number}: expected an object with a string {text_key!r}")
            label = value.get(label_key, value.get("labels"))
            if label is not None and not isinstance(label, dict):
                raise ValueError(f"{path}:{number}: {label_key!r} must be an object of field values")
            rows.append((value[text_key], label))
    if not rows:
        raise ValueError(f"{path} has no input lines")
    return rows


def load_for(args: argparse.Namespace) -> tuple[Any, PCDEngine, Calibration | None]:
    """(schema, engine, calibration) of a model command, the schema planned (its errors raised)
    before any input is read."""
    schema = load_schema(args.schema)
    calibration = Calibration.load(args.calibration) if getattr(args, "calibration", None) else None
    engine = load_engine(
        args.model,
        **engine_options(args),
        allow_generation=False if getattr(args, "no_generation", False) else None,
    )
    engine.plan(schema, instructions=args.instructions)
    return schema, engine, calibration
