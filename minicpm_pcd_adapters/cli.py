"""`pcd`: classify a file, evaluate on labeled data, fit a calibration.

    pcd classify --schema examples/ticket.py:Ticket --input examples/tickets.txt \
        --output out/tickets.jsonl --model smollm2 [--calibration cal.json --abstain-below 0.6]
    pcd evaluate --schema ... --input labeled.jsonl --model smollm2 [--fit 50] [--examples 4]
    pcd calibrate --schema ... --input labeled.jsonl --output cal.json --model smollm2 [--method head]
    pcd suggest --schema ... --input unlabeled.jsonl --count 50 --output to_label.jsonl (suggest.py)
    pcd classify --ray --actors 2 --schema ... --input folder/ --output answers/  (ray_files.py; [ray])
    pcd serve --model smollm2 [--port 8000 --api-key KEY]  (server.py; needs the [server] extra)
    pcd serve --ray --replicas 2 --model smollm2  (ray_serve.py; needs the [ray] extra)
    pcd manifest create /models/MiniCPM5-2B --output minicpm5.manifest.json  (then --manifest FILE)

`classify` input: `.jsonl`/`.ndjson`/`.json` files hold one JSON value per line (an object with a
`text` key, or a string); any other file is plain text, one input per line. Every input line gets one
output record with its line number (and `id`): its value and probabilities, or an error record. No
input is dropped. Inputs are read lazily and written a `--batch-size` chunk at a time (files.py);
`--resume` finishes an interrupted run; SIGINT / SIGTERM stop after the current chunk. Exit codes: 0
every input answered, 1 some inputs got error records, 2 usage, path or schema errors (before the
model loads), 130 stopped by a signal. `evaluate` and `calibrate`
read labeled JSONL (`{"text": ..., "label": {field: value}}`); `evaluate` writes report.json and PNG
plots (reliability diagram, coverage vs accuracy) to `--report`.
"""

from __future__ import annotations

import argparse
import importlib
import importlib.util
import json
import os
import signal
import sys
import threading
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from pydantic import BaseModel
from tqdm import tqdm

from minicpm_pcd_adapters.files import classify_file, count_lines
from minicpm_pcd_adapters.minicpm import MINICPM5_2B, load_minicpm5
from minicpm_pcd_adapters.server_settings import ServerSettings
from minicpm_pcd_adapters.smollm2 import load_smollm2
from minicpm_pcd_adapters.suggest import run_suggest
from pcd_engine import (
    MANIFEST_NAME,
    RULES,
    TEXT_FRAMINGS,
    Calibration,
    Evaluation,
    PCDEngine,
    PCDError,
    evaluate,
    read_manifest,
    verify_manifest,
    write_manifest,
)

MODELS = {"minicpm5-2b": load_minicpm5, "smollm2": load_smollm2}


def main(argv: Sequence[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    if args.command == "serve":
        return run_serve(args)
    if args.command == "manifest":
        return run_manifest(args)
    if args.command == "classify" and args.ray:
        return run_classify_ray(args)
    try:
        check_paths(args)
        schema = load_schema(args.schema)
        calibration = Calibration.load(args.calibration) if getattr(args, "calibration", None) else None
        labeled = (
            read_labeled(Path(args.input), args.text_key, args.label_key)
            if args.command in ("evaluate", "calibrate")
            else None
        )
        engine = load_engine(
            args.model,
            **engine_options(args),
            allow_generation=False if getattr(args, "no_generation", False) else None,
        )
        engine.plan(schema, instructions=args.instructions)  # schema errors before reading input
    except (PCDError, ImportError, AttributeError, TypeError, ValueError, OSError) as error:
        print(f"pcd: error: {error}", file=sys.stderr)
        return 2
    if args.command == "evaluate":
        assert labeled is not None
        return run_evaluate(engine, schema, labeled, args, calibration)
    if args.command == "calibrate":
        assert labeled is not None
        return run_calibrate(engine, schema, labeled, args)
    if args.command == "suggest":
        return run_suggest(engine, schema, args, calibration)
    return run_classify(engine, schema, args, calibration)


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="pcd", description="Typed classification with parallel constrained decoding"
    )
    sub = parser.add_subparsers(dest="command", required=True)
    run = sub.add_parser("classify", help="classify every line of a file")
    _common(run, "JSONL file to classify (objects with 'text', or strings) or text lines")
    run.add_argument("--output", required=True, help="JSONL file to write, one line per input")
    run.add_argument(
        "--no-generation",
        action="store_true",
        help="refuse schemas with open fields (free text, numbers, lists) instead of generating them",
    )
    run.add_argument("--batch-size", type=int, default=32, help="inputs per engine batch; each batch's "
                     "records are written as it completes (default 32)")  # fmt: skip
    run.add_argument(
        "--resume",
        action="store_true",
        help="skip inputs already answered in --output (a torn last record is redone) and append",
    )
    run.add_argument("--calibration", default=None, help="a calibration JSON file from `pcd calibrate`")
    run.add_argument("--ray", action="store_true", help="classify on a Ray cluster: --input is a file or "
                     "folder of JSONL / text / Parquet files, --output a folder of shards, one per input "
                     "file; a rerun skips the shards already complete (the [ray] extra)")  # fmt: skip
    run.add_argument("--ray-address", default=None, help="the cluster to join (default: a local one)")
    run.add_argument("--actors", type=int, default=1, help="with --ray: engines running at once")
    run.add_argument("--num-gpus", type=float, default=0, help="with --ray: GPUs per actor")
    run.add_argument("--output-format", choices=("parquet", "jsonl"), default="parquet", help="with --ray: "
                     "the shards' format (default parquet)")  # fmt: skip
    run.add_argument(
        "--abstain-below",
        type=float,
        default=None,
        help="mark fields whose (calibrated) confidence is below this probability; their records say "
        "needs_review",
    )
    evaluate = sub.add_parser("evaluate", help="measure accuracy and calibration on a labeled JSONL file")
    _common(evaluate, 'labeled JSONL: {"text": ..., "label": {field: value}} per line')
    evaluate.add_argument(
        "--label-key", default="label", help="key of the label object (also read: 'labels')"
    )
    evaluate.add_argument("--calibration", default=None, help="evaluate with this calibration JSON file")
    evaluate.add_argument(
        "--fit", type=int, default=0, help="fit a calibration on the first N labeled lines (after the "
        "examples) and score the rest, with and without it"
    )  # fmt: skip
    evaluate.add_argument("--method", default="auto", help="calibration method for --fit (default: auto)")
    evaluate.add_argument(
        "--examples", type=int, default=0, help="use the first N labeled lines as in-context examples "
        "(in the cached head) and score the rest"
    )  # fmt: skip
    evaluate.add_argument("--report", default="out/evaluate", help="folder for report.json and the PNG plots")
    calibrate = sub.add_parser("calibrate", help="fit a calibration from a (labeled or unlabeled) JSONL file")
    _common(calibrate, 'JSONL: {"text": ..., "label": {...}} per line; without labels: batch calibration')
    calibrate.add_argument(
        "--label-key", default="label", help="key of the label object (also read: 'labels')"
    )
    calibrate.add_argument("--output", required=True, help="calibration JSON file to write")
    calibrate.add_argument(
        "--method", default="auto", help="auto, head, bias, temperature, batch or none (head: its "
        "weights go beside the JSON, same name with .safetensors)"
    )  # fmt: skip
    calibrate.add_argument("--folds", type=int, default=5, help="cross-validation folds of the report")
    suggest = sub.add_parser("suggest", help="pick the texts most worth labeling next, ready to label")
    _common(suggest, "JSONL file of unlabeled texts (objects with 'text', or strings) or text lines")
    suggest.add_argument("--output", required=True, help='JSONL file to write: {"text", "label": the '
                         'current best guess to correct, "pcd"} per suggested text')  # fmt: skip
    suggest.add_argument("--count", type=int, default=50, help="how many texts to suggest (default 50)")
    suggest.add_argument("--by", choices=("margin", "entropy"), default="margin", help="uncertainty: the "
                         "lowest margin (default) or highest entropy over the fields")  # fmt: skip
    suggest.add_argument("--calibration", default=None, help="judge certainty under this calibration")
    _serve_options(sub.add_parser("serve", help="serve the model over an OpenAI-compatible HTTP API"))
    manifest = sub.add_parser("manifest", help="write or check the SHA-256 manifest of a model folder")
    action = manifest.add_subparsers(dest="action", required=True)
    create = action.add_parser("create", help="hash every weight, config and tokenizer file of a folder")
    create.add_argument("folder", help="model folder (a hub snapshot folder, a `hf download` folder ...)")
    create.add_argument("--output", default=None, help=f"manifest file (default: FOLDER/{MANIFEST_NAME})")
    create.add_argument("--revision", default=None, help="hub commit the files come from (recorded; "
        "default: the commit of a hub cache snapshot folder)")  # fmt: skip
    verify = action.add_parser("verify", help="check a folder against a manifest (exit 0 or 2)")
    verify.add_argument("folder")
    verify.add_argument("--manifest", required=True, help="manifest file from `pcd manifest create`")
    return parser


def run_manifest(args: argparse.Namespace) -> int:
    """`pcd manifest create|verify`: exit 0, or 2 with the file that does not match."""
    try:
        if args.action == "create":
            target = write_manifest(args.folder, args.output, revision=args.revision)
            count = len(read_manifest(target)["files"])
            print(f"pcd: {count} files hashed into {target}", file=sys.stderr)
        else:
            verify_manifest(args.folder, args.manifest)
            print(f"pcd: {args.folder} matches {args.manifest}", file=sys.stderr)
    except (PCDError, OSError) as error:
        print(f"pcd: error: {error}", file=sys.stderr)
        return 2
    return 0


def _serve_options(parser: argparse.ArgumentParser) -> None:
    defaults = ServerSettings(model_name="")
    _model_options(parser)
    add = parser.add_argument
    add("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1: this machine only)")
    add("--port", type=int, default=8000, help="port to listen on (default 8000)")
    add("--api-key", default=os.environ.get("PCD_API_KEY"), help="require 'Authorization: Bearer KEY' on "
        "every endpoint but /health (default: $PCD_API_KEY; none: no key)")  # fmt: skip
    add("--served-model-name", default=None, help="the model id clients send and /v1/models lists "
        "(default: the --model value)")  # fmt: skip
    add("--instructions", default=None, help="system instructions for requests without a system message")
    add("--abstain-below", type=float, default=None, help="flag scored fields below this confidence "
        "(choice.pcd.abstained_fields); a request can set its own in its 'pcd' object")  # fmt: skip
    add("--no-generation", action="store_true", help="refuse schemas with open fields")
    add("--batch-window-ms", type=float, default=defaults.batch_window_ms, help="how long a structured "
        "request waits for others with the same schema to share its batch (default %(default)s)")  # fmt: skip
    add("--max-batch", type=int, default=defaults.max_batch, help="requests per batch (default %(default)s)")
    add("--max-queue", type=int, default=defaults.max_queue, help="requests waiting for the model; more get "
        "503 with Retry-After (default %(default)s)")  # fmt: skip
    add("--request-timeout", type=float, default=defaults.request_timeout_s, help="seconds before an "
        "unanswered request gets 504 (default %(default)s)")  # fmt: skip
    add("--max-body-bytes", type=int, default=defaults.max_body_bytes, help="larger bodies get 413 "
        "(default %(default)s)")  # fmt: skip
    add("--max-text-chars", type=int, default=defaults.max_text_chars, help="characters of all messages "
        "of a request together (default %(default)s)")  # fmt: skip
    add("--max-tokens", type=int, default=defaults.max_tokens, help="default answer length of plain chat "
        "(default %(default)s)")  # fmt: skip
    add("--ray", action="store_true", help="run as a Ray Serve deployment (the [ray] extra): Serve's proxy "
        "listens on --host/--port and spreads requests over --replicas copies, each with its own "
        "engine")  # fmt: skip
    add("--replicas", type=int, default=1, help="with --ray: server replicas (default 1)")
    add("--ray-address", default=None, help="with --ray: the cluster to join (default: a local one)")
    add("--num-gpus", type=float, default=0, help="with --ray: GPUs per replica (default 0)")
    add("--cors-origin", action="append", default=[], help="allow browser calls from this origin "
        "(repeatable; default: CORS off)")  # fmt: skip


def run_serve(args: argparse.Namespace) -> int:
    """Load the model, then serve until interrupted (exit 0), or exit 2 before loading on bad options."""
    try:
        import uvicorn

        from minicpm_pcd_adapters.server import create_app
    except ImportError as error:
        print(
            f"pcd: error: {error}; install the server extra: pip install 'minicpm-pcd[server]'",
            file=sys.stderr,
        )
        return 2
    settings = ServerSettings(
        model_name=args.served_model_name or args.model,
        api_key=args.api_key or None,
        batch_window_ms=args.batch_window_ms,
        max_batch=args.max_batch,
        max_queue=args.max_queue,
        request_timeout_s=args.request_timeout,
        max_body_bytes=args.max_body_bytes,
        max_text_chars=args.max_text_chars,
        max_tokens=args.max_tokens,
        cors_origins=tuple(args.cors_origin),
    )
    options = {
        **engine_options(args),
        "instructions": args.instructions,
        "abstain_below": args.abstain_below,
        "allow_generation": False if args.no_generation else None,
    }
    if settings.api_key is None and not _loopback(args.host):
        print(f"pcd: warning: serving on {args.host} without --api-key: anyone who reaches it can use it",
              file=sys.stderr)  # fmt: skip
    if args.ray:
        return _serve_on_ray(args, settings, options)  # each replica's load_engine drops Nones
    try:
        settings.check()
        engine = load_engine(args.model, **options)
    except (PCDError, ValueError, OSError) as error:
        print(f"pcd: error: {error}", file=sys.stderr)
        return 2
    uvicorn.run(create_app(engine, settings), host=args.host, port=args.port, log_level="info")
    return 0


def run_classify_ray(args: argparse.Namespace) -> int:
    """`pcd classify --ray`: exit 0 every row answered, 1 some error rows, 2 usage or schema errors."""
    try:
        import ray

        from minicpm_pcd_adapters.ray_files import classify_files, input_files, rows_in
    except ImportError as error:
        print(f"pcd: error: {error}; install the ray extra: pip install 'minicpm-pcd[ray]'", file=sys.stderr)
        return 2
    try:
        files = input_files(Path(args.input))
        output = Path(args.output)
        if output.exists() and not output.is_dir():
            raise NotADirectoryError(f"--output {output}: with --ray it names a folder of shards")
        output.mkdir(parents=True, exist_ok=True)
        calibration = Calibration.load(args.calibration) if args.calibration else None
        load_schema(args.schema)  # import errors before the job (schema errors: in classify_files)
        if args.batch_size < 1 or args.actors < 1:
            raise ValueError("--batch-size and --actors must be at least 1")
    except (PCDError, ImportError, AttributeError, TypeError, ValueError, OSError) as error:
        print(f"pcd: error: {error}", file=sys.stderr)
        return 2
    options = {
        "instructions": args.instructions,
        # checked above; each actor loads the file itself (a head's weights sit beside the JSON)
        "calibration": str(Path(args.calibration).resolve()) if calibration is not None else None,
        "abstain_below": args.abstain_below,
    }
    ray.init(address=args.ray_address, log_to_driver=False)
    try:
        with tqdm(total=sum(rows_in(f) for f in files), unit="row", desc="pcd classify --ray") as bar:
            summary = classify_files(
                Path(args.input),
                output,
                args.schema,
                model=args.model,
                output_format=args.output_format,
                text_key=args.text_key,
                actors=args.actors,
                batch_size=args.batch_size,
                num_gpus=args.num_gpus,
                engine_options=engine_options(args),  # each actor's load_engine drops Nones
                progress=bar.update,
                **options,  # None is classify_batch's own default for each
            )
    except PCDError as error:
        print(f"pcd: error: {error}", file=sys.stderr)
        return 2
    finally:
        ray.shutdown()
    print(
        f"pcd: {summary.rows} rows written to {output} ({summary.errors} error rows); "
        f"{summary.shards} shards, {summary.skipped} already complete",
        file=sys.stderr,
    )
    return 1 if summary.errors else 0


def _serve_on_ray(args: argparse.Namespace, settings: ServerSettings, options: dict[str, Any]) -> int:
    try:
        import ray
        from ray import serve

        from minicpm_pcd_adapters.ray_serve import pcd_application

        application = pcd_application(
            args.model,
            settings,
            replicas=args.replicas,
            num_gpus=args.num_gpus,
            engine_options=options,
        )
    except (ImportError, ValueError) as error:
        print(f"pcd: error: {error} (pcd serve --ray needs the [ray] extra)", file=sys.stderr)
        return 2
    ray.init(address=args.ray_address)
    try:
        serve.start(http_options={"host": args.host, "port": args.port})
        serve.run(application, name="pcd", route_prefix="/", blocking=True)
    except KeyboardInterrupt:
        pass
    finally:
        serve.shutdown()
        ray.shutdown()
    return 0


def _loopback(host: str) -> bool:
    return host in ("localhost", "::1") or host.startswith("127.")


def _common(parser: argparse.ArgumentParser, input_help: str) -> None:
    parser.add_argument("--schema", required=True, help="module:Class or path/to/file.py:Class")
    parser.add_argument("--input", required=True, help=input_help)
    _model_options(parser)
    parser.add_argument("--instructions", default=None, help="system instructions replacing the default")
    parser.add_argument("--text-key", default="text", help="key of the text in JSONL objects")


def _model_options(parser: argparse.ArgumentParser) -> None:
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


def check_paths(args: argparse.Namespace) -> None:
    """Input and output paths, checked before the model loads (OSError / ValueError)."""
    source = Path(args.input)
    if not source.is_file():
        raise FileNotFoundError(f"--input {source}: no such file")
    with source.open("rb"):
        pass  # readable
    target = getattr(args, "output", None)
    if args.command == "classify" and getattr(args, "batch_size", 1) < 1:
        raise ValueError(f"--batch-size must be at least 1, got {args.batch_size}")
    if args.command == "suggest" and args.count < 1:
        raise ValueError(f"--count must be at least 1, got {args.count}")
    if target is None:
        return
    target = Path(target)
    if target.is_dir():
        raise IsADirectoryError(f"--output {target} is a folder; name a file")
    target.parent.mkdir(parents=True, exist_ok=True)
    if not os.access(target.parent, os.W_OK) or (target.exists() and not os.access(target, os.W_OK)):
        raise PermissionError(f"--output {target}: not writable")


def run_classify(
    engine: PCDEngine, schema: type[BaseModel], args: argparse.Namespace, calibration: Calibration | None
) -> int:
    """Exit codes: 0 every input answered, 1 some inputs got error records, 130 stopped by a signal
    (rerun with --resume to finish)."""
    source, output = Path(args.input), Path(args.output)
    stop = threading.Event()
    previous = {sig: signal.signal(sig, lambda *_: stop.set()) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        total = count_lines(source)
        with tqdm(total=total, desc="classify", unit="text", file=sys.stderr) as bar:
            summary = classify_file(
                engine,
                schema,
                source,
                output,
                text_key=args.text_key,
                batch_size=args.batch_size,
                resume=args.resume,
                stop=stop,
                progress=bar.update,
                instructions=args.instructions,
                calibration=calibration,
                abstain_below=args.abstain_below,
            )
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    answered = summary.written - summary.errors
    print(
        f"pcd: {answered} classified ({summary.needs_review} need review), {summary.errors} errors, "
        f"{summary.skipped} already done -> {output}",
        file=sys.stderr,
    )
    if summary.stopped:
        print("pcd: stopped before the end of the input; rerun with --resume to finish", file=sys.stderr)
        return 130
    return 1 if summary.errors else 0


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


def run_evaluate(
    engine: PCDEngine,
    schema: type[BaseModel],
    rows: list[tuple[str, dict[str, Any] | None]],
    args: argparse.Namespace,
    calibration: Calibration | None,
) -> int:
    if any(label is None for _, label in rows):
        print("pcd: error: every line needs a label to evaluate", file=sys.stderr)
        return 2
    try:
        from minicpm_pcd_adapters import plots  # matplotlib: the [eval] extra
    except ImportError as error:
        print(
            f"pcd: error: {error}; install the plots with: pip install 'minicpm-pcd[eval]'", file=sys.stderr
        )
        return 2
    if args.examples + args.fit >= len(rows):
        print(
            f"pcd: error: --examples + --fit must leave lines to score ({len(rows)} lines)", file=sys.stderr
        )
        return 2
    shots = [(text, label) for text, label in rows[: args.examples]]
    fitting = rows[args.examples : args.examples + args.fit]
    scoring = rows[args.examples + args.fit :]
    options: dict[str, Any] = {"instructions": args.instructions, "examples": shots}
    report = Path(args.report)
    try:
        if calibration is not None:  # before any model work
            calibration.check(engine.plan(schema, **options), engine.model_identity)
        with tqdm(total=len(scoring), desc="evaluate", unit="text", file=sys.stderr) as bar:
            base = evaluate(
                engine,
                schema,
                [t for t, _ in scoring],
                [y for _, y in scoring],
                progress=bar.update,
                **options,
            )
        variants = {"uncalibrated": base}

        def calibrated(cal: Calibration) -> Evaluation:  # a head reads hidden states: score again
            if not cal.needs_hidden:
                return base.recalibrated(cal)
            texts, labels = [t for t, _ in scoring], [y for _, y in scoring]
            return evaluate(engine, schema, texts, labels, calibration=cal, **options)

        if calibration is not None:
            variants["calibrated"] = calibrated(calibration)
        if fitting:
            fitted = engine.calibrate(
                schema, [t for t, _ in fitting], [y for _, y in fitting], method=args.method, **options
            )
            report.mkdir(parents=True, exist_ok=True)
            fitted.save(report / "calibration.json")
            variants[f"calibrated on {len(fitting)}"] = calibrated(fitted)
    except PCDError as error:
        print(f"pcd: error: {error}", file=sys.stderr)
        return 2
    out = {name: e.to_json() for name, e in variants.items()}
    report.mkdir(parents=True, exist_ok=True)
    (report / "report.json").write_text(
        json.dumps(out, indent=1, ensure_ascii=False) + "\n", encoding="utf-8"
    )
    for name, e in variants.items():
        slug = name.replace(" ", "_")
        plots.reliability_diagram(e, report / f"reliability_{slug}.png", f"reliability ({name})")
        plots.coverage_plot(e, report / f"coverage_{slug}.png", f"coverage vs accuracy ({name})")
        print(summary_table(name, e))
    print(f"pcd: report and plots -> {report}", file=sys.stderr)
    return 0


def summary_table(name: str, evaluation: Evaluation) -> str:
    """A plain-text table: one line per field, then the means and the exact-object accuracy."""
    lines = [f"== {name}", f"{'field':<28}{'n':>6}{'acc':>8}{'macroF1':>9}{'ECE':>8}{'majority':>10}"]
    for path, f in evaluation.fields.items():
        r = f.report()
        if r["n"]:
            row = f"{path:<28}{r['n']:>6}{r['accuracy']:>8.3f}{r['macro_f1']:>9.3f}{r['ece']:>8.3f}"
            lines.append(row + f"{r['majority']:>10.3f}")
    s = evaluation.summary
    if s["field_accuracy"] is not None:
        mean = (
            f"{'mean':<28}{'':>6}{s['field_accuracy']:>8.3f}{s['field_macro_f1']:>9.3f}{s['field_ece']:>8.3f}"
        )
        lines.append(mean + f"{s['field_majority']:>10.3f}")
    exact = "n/a" if s["exact_accuracy"] is None else f"{s['exact_accuracy']:.3f}"
    lines.append(
        f"exact object accuracy {exact}; {s['answered']}/{s['texts']} answered, {s['errors']} errors"
    )
    return "\n".join(lines)


def run_calibrate(
    engine: PCDEngine,
    schema: type[BaseModel],
    rows: list[tuple[str, dict[str, Any] | None]],
    args: argparse.Namespace,
) -> int:
    labeled = any(label is not None for _, label in rows)
    labels = [label or {} for _, label in rows] if labeled else None
    try:
        with tqdm(total=len(rows), desc="calibrate", unit="text", file=sys.stderr) as bar:
            fitted = engine.calibrate(
                schema,
                [text for text, _ in rows],
                labels,
                method=args.method,
                folds=args.folds,
                instructions=args.instructions,
                progress=bar.update,
            )
        output = Path(args.output)
        output.parent.mkdir(parents=True, exist_ok=True)
        fitted.save(output)
    except (PCDError, OSError) as error:
        print(f"pcd: error: {error}", file=sys.stderr)
        return 2
    for path, report in fitted.report["fields"].items():
        if "before" in report:
            before, after = report["before"], report["after"]
            print(
                f"{path:<28} {report['method']:<12} "
                f"accuracy {before['accuracy']:.3f} -> {after['accuracy']:.3f}"
                f"  ECE {before['ece']:.3f} -> {after['ece']:.3f}  (cross-validated, n={report['n']})"
            )
        else:
            print(f"{path:<28} {report['method']:<12} n={report['n']}")
    print(f"pcd: calibration -> {args.output}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
