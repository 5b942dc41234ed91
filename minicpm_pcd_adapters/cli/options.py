"""What the `pcd` commands share: input, model and engine options; path and labeled-file checks.

Everything here runs before a model loads, so a bad option or path costs no loading time.
"""

from __future__ import annotations

import argparse
import difflib
import json
import os
import signal
import sys
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from minicpm_pcd_adapters.by_name import MODELS, load_engine, load_schema
from minicpm_pcd_adapters.minicpm import MINICPM5_2B
from pcd_engine import (
    RULES,
    TEXT_FRAMINGS,
    Calibration,
    CalibrationError,
    CompiledSchema,
    Limits,
    PCDError,
    compile_schema,
)

if TYPE_CHECKING:
    from pcd_engine import PCDEngine

# what a command turns into exit code 2 (usage, path, schema or loading errors)
SETUP_ERRORS = (PCDError, ImportError, AttributeError, TypeError, ValueError, OSError)


def fail(error: object) -> int:
    print(f"pcd: error: {error}", file=sys.stderr)
    return 2


def input_options(parser: argparse.ArgumentParser, input_help: str) -> None:
    parser.add_argument("--schema", required=True, help="module:Class, path/to/file.py:Class, or a JSON "
        "file: a JSON Schema object, or a development set's NAME.schema.json")  # fmt: skip
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


@contextmanager
def stopped_by_signals() -> Iterator[threading.Event]:
    """An event that SIGINT or SIGTERM sets while the block runs (a long run then stops after its
    current batch, resumable), the previous handlers restored after it."""
    stop = threading.Event()
    previous = {sig: signal.signal(sig, lambda *_: stop.set()) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        yield stop
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def run_exit(stopped: bool, failed: int) -> int:
    """The exit code of a long run (classify, run-batch): 130 stopped by a signal (saying how to
    finish), 1 some inputs got error records, else 0."""
    if stopped:
        print("pcd: stopped before the end of the input; rerun with --resume to finish", file=sys.stderr)
        return 130
    return 1 if failed else 0


def portable_schema(spec: str | None) -> str | None:
    """A --schema with its file made absolute, so that a process elsewhere (a Ray actor or replica)
    finds it; `module:Class` as given."""
    if spec is None:
        return None
    if spec.endswith(".json"):
        return str(Path(spec).resolve())
    module, sep, name = spec.rpartition(":")
    return f"{Path(module).resolve()}:{name}" if sep and module.endswith(".py") else spec


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


def read_labeled(
    path: Path, text_key: str, label_key: str, schema: Any = None
) -> list[tuple[str, dict[str, Any] | None]]:
    """(text, label or None) per line of a JSONL file; ValueError naming the line (counted from 1)
    for a bad one. With `schema`, every label's fields and values are checked against it."""
    compiled = compile_schema(schema, Limits(), allow_open=True) if schema is not None else None
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
            if label is not None and compiled is not None:
                check_label(label, compiled, f"{path}:{number}")
            rows.append((value[text_key], label))
    if not rows:
        raise ValueError(f"{path} has no input lines")
    return rows


def check_label(label: dict[str, Any], compiled: CompiledSchema, where: str) -> None:
    """ValueError naming `where` for a label field the schema lacks (with the nearest field's name)
    or a closed field's value it does not allow. Nested and open fields are left to the engine."""
    names = sorted({f.json_keys[0] for f in compiled.fields} | {o.json_keys[0] for o in compiled.open_fields})
    closed = {f.json_keys[0]: f for f in compiled.fields if len(f.json_keys) == 1}
    for key, value in label.items():
        if key not in names:
            near = difflib.get_close_matches(key, names, n=1)
            hint = f"did you mean {near[0]!r}?" if near else f"the fields are {', '.join(names)}"
            raise ValueError(f"{where}: the label has no field {key!r} in the schema; {hint}")
        field = closed.get(key)
        if field is None:
            continue
        allowed = [c.value for c in field.candidates]
        values = value if field.multi_label and isinstance(value, list) else [value]
        bad = [v for v in values if not any(type(v) is type(a) and v == a for a in allowed)]
        if bad:
            shown = ", ".join(json.dumps(a) for a in allowed[:12]) + (", ..." if len(allowed) > 12 else "")
            raise ValueError(f"{where}: label {key!r} has the value {json.dumps(bad[0])}, not one of {shown}")


@dataclass(frozen=True)
class Setup:
    """What a model command has once its setup passed: the schema, the loaded engine with the
    schema planned, the checked calibration (or None), the labeled rows of a labeled command, and
    the plan options (instructions, in-context examples) every engine call of the command uses."""

    schema: Any
    engine: PCDEngine
    calibration: Calibration | None
    rows: list[tuple[str, dict[str, Any] | None]]
    options: dict[str, Any]


def set_up(
    args: argparse.Namespace,
    *,
    labeled: bool = False,
    check_rows: Callable[[list[tuple[str, dict[str, Any] | None]]], None] | None = None,
) -> Setup:
    """The setup every model command shares, cheapest checks first so that a bad option, path,
    schema, label or calibration costs no loading time: the paths, the schema, the calibration
    against the schema's fields, the labeled rows (`labeled`), then the model, the plan and the
    calibration against both. `--examples N` (where a command has it) takes the first N labeled
    rows as in-context examples. Raises one of SETUP_ERRORS."""
    check_paths(args)
    schema = load_schema(args.schema)
    calibration = load_calibration(args, schema)  # for other fields: the first thing to say
    rows = read_labeled(Path(args.input), args.text_key, args.label_key, schema) if labeled else []
    if check_rows is not None:
        check_rows(rows)  # a command's own checks of its labeled rows, before the model loads
    examples = rows[: getattr(args, "examples", 0)]
    options: dict[str, Any] = {"instructions": args.instructions}
    if examples:
        options["examples"] = [(text, label) for text, label in examples]
    engine = load_model(args, schema)
    if calibration is not None:
        calibration.check(engine.plan(schema, **options), engine.model_identity)
    return Setup(schema, engine, calibration, rows, options)


def load_model(args: argparse.Namespace, schema: Any) -> PCDEngine:
    """The engine of a model command, with the schema planned on it (its errors raised)."""
    engine = load_engine(
        args.model,
        **engine_options(args),
        allow_generation=False if getattr(args, "no_generation", False) else None,
    )
    engine.plan(schema, instructions=args.instructions)
    return engine


def load_calibration(args: argparse.Namespace, schema: Any) -> Calibration | None:
    """`--calibration`, if given, loaded and checked against the fields the schema scores (no model
    needed: the plan, model and rules are checked once the model is loaded)."""
    if not getattr(args, "calibration", None):
        return None
    calibration = Calibration.load(args.calibration)
    check_calibration_fields(calibration, compile_schema(schema, Limits(), allow_open=True))
    return calibration


def check_calibration_fields(calibration: Calibration, compiled: CompiledSchema) -> None:
    """CalibrationError when the calibration was fitted for other fields than the schema scores."""
    scored = {d.path for d in compiled.decisions if len(d.candidates) > 1}
    fitted = set(calibration.rules)
    if scored != fitted:
        which = sorted(fitted - scored) or sorted(scored - fitted)
        side = "the schema has no field" if fitted - scored else "the calibration has no field"
        raise CalibrationError(
            f"--calibration was fitted for another schema: {side} {which[0]!r}; fit one for this schema"
        )
