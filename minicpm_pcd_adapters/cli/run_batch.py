"""`pcd run-batch`: an OpenAI batch file (the format vLLM's `run-batch` reads) answered in process by
the server's own app, one output record per input line, resumable (server/batch_files.py)."""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any

from tqdm import tqdm

from minicpm_pcd_adapters.by_name import load_engine, load_schema
from minicpm_pcd_adapters.cli.options import (
    SETUP_ERRORS,
    engine_options,
    fail,
    model_options,
    portable_schema,
    run_exit,
    stopped_by_signals,
)
from minicpm_pcd_adapters.files import count_lines
from minicpm_pcd_adapters.server.settings import ServerSettings
from pcd_engine import Calibration

if TYPE_CHECKING:
    from minicpm_pcd_adapters.server.batch_files import BatchSummary


def add_parser(sub: Any) -> None:
    parser = sub.add_parser(
        "run-batch", help="answer an OpenAI batch file (chat, completions, classify lines)"
    )
    add = parser.add_argument
    add("-i", "--input-file", required=True, help="the batch file: one JSON request per line "
        '({"custom_id", "method": "POST", "url", "body"})')  # fmt: skip
    add("-o", "--output-file", required=True, help="the JSONL file of answers, one per input line, in order")
    model_options(parser)
    add("--served-model-name", default=None, help="the model name the requests' bodies give (default: "
        "the --model value)")  # fmt: skip
    add(
        "--schema",
        default=None,
        help="the schema /v1/classify lines are answered with (as pcd serve --schema)",
    )
    add("--calibration", nargs="+", default=[], metavar="FILE", help="calibration files, applied as "
        "pcd serve applies them")  # fmt: skip
    add("--instructions", default=None, help="system instructions for requests without a system message")
    add("--concurrency", type=int, default=64, help="lines answered at once; scored lines with the same "
        "schema among them share engine batches (default 64)")  # fmt: skip
    add("--max-batch", type=int, default=64, help="requests per engine batch (default 64)")
    add("--resume", action="store_true", help="keep the output's whole records and answer the lines after "
        "them (a torn last record is redone); with --ray, the parts an interrupted run left")  # fmt: skip
    add("--ray", action="store_true", help="answer the file on a Ray cluster (the [ray] extra): parts "
        "of --part-lines lines, each answered by one of --actors engines, joined in order")  # fmt: skip
    add("--ray-address", default=None, help="with --ray: the cluster to join (default: a local one)")
    add("--actors", type=int, default=1, help="with --ray: engines running at once (default 1)")
    add("--num-gpus", type=float, default=0, help="with --ray: GPUs per actor (default 0)")
    add("--part-lines", type=int, default=1000, help="with --ray: lines per part (default 1000)")


def main(args: argparse.Namespace) -> int:
    """Exit codes: 0 every line answered with 200, 1 some lines got an error, 2 bad options (before the
    model loads), 130 stopped by a signal (rerun with --resume)."""
    try:
        from minicpm_pcd_adapters.server.app import create_app
        from minicpm_pcd_adapters.server.batch_files import answered_records
    except ImportError as error:
        return fail(f"{error}; install the server extra: pip install 'minicpm-pcd[server]'")
    source, output = Path(args.input_file), Path(args.output_file)
    key = os.urandom(16).hex()  # the in-process app's key: nothing else reaches it, but the guard stays on
    try:
        if not source.is_file():
            raise FileNotFoundError(f"--input-file {source}: no such file")
        if source.resolve() == output.resolve():
            raise ValueError("--output-file must not be the input file")
        if args.concurrency < 1:
            raise ValueError(f"--concurrency must be at least 1, got {args.concurrency}")
        settings = ServerSettings(
            model_name=args.served_model_name or args.model,
            api_key=key,
            max_batch=args.max_batch,
            max_queue=max(256, 2 * args.concurrency),
            request_timeout_s=24 * 3600.0,
            calibrations=tuple(str(Path(f).resolve()) for f in args.calibration),
            schema=portable_schema(args.schema),  # for Ray actors too
        )
        settings.check()
        if args.schema is not None:
            load_schema(args.schema)
        for path in settings.calibrations:
            Calibration.load(path)
        total = count_lines(source)
        if args.resume and answered_records(output) >= total:
            print(f"pcd: every line of {source} is answered in {output}; nothing to resume", file=sys.stderr)
            return 0
        if min(args.actors, args.part_lines) < 1:
            raise ValueError("--actors and --part-lines must be at least 1")
        app = None
        if not args.ray:  # on Ray, each actor loads its own engine
            engine = load_engine(args.model, **_engine_options(args))
            app = create_app(engine, settings)
    except SETUP_ERRORS as error:
        return fail(error)
    if args.ray:
        summary = _on_ray(args, settings, source, output, total)
        if summary is None:
            return 2
    else:
        summary = _in_process(args, app, key, source, output, total)
    print(
        f"pcd: {summary.written - summary.failed} answered, {summary.failed} failed, {summary.skipped} "
        f"already done -> {output}",
        file=sys.stderr,
    )
    return run_exit(summary.stopped, summary.failed)


def _engine_options(args: argparse.Namespace) -> dict[str, Any]:
    return {**engine_options(args), "instructions": args.instructions}


def _in_process(
    args: argparse.Namespace, app: Any, key: str, source: Path, output: Path, total: int
) -> BatchSummary:
    from minicpm_pcd_adapters.server.batch_files import run_batch_file

    with (
        stopped_by_signals() as stop,
        tqdm(total=total, desc="run-batch", unit="line", file=sys.stderr) as bar,
    ):
        return run_batch_file(
            app,
            source,
            output,
            headers={"Authorization": f"Bearer {key}"},
            concurrency=args.concurrency,
            resume=args.resume,
            stop=stop,
            progress=bar.update,
        )


def _on_ray(
    args: argparse.Namespace, settings: ServerSettings, source: Path, output: Path, total: int
) -> BatchSummary | None:
    try:
        import ray

        from minicpm_pcd_adapters.ray.batch_files import run_batch_on_ray
    except ImportError as error:
        fail(f"{error}; install the ray extra: pip install 'minicpm-pcd[ray]'")
        return None
    options = {k: v for k, v in _engine_options(args).items() if v is not None}
    ray.init(address=args.ray_address, log_to_driver=False)
    try:
        with tqdm(total=total, desc="run-batch --ray", unit="line", file=sys.stderr) as bar:
            return run_batch_on_ray(
                args.model,
                settings,
                options,
                source.resolve(),
                output.resolve(),
                actors=args.actors,
                num_gpus=args.num_gpus,
                concurrency=args.concurrency,
                part_lines=args.part_lines,
                resume=args.resume,
                progress=bar.update,
            )
    finally:
        ray.shutdown()
