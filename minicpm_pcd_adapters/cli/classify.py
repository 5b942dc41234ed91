"""`pcd classify`: every line of a file answered, streaming and resumable (files.py); with `--ray`,
files and folders on a Ray cluster, one output shard per input file (ray/files.py)."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

from tqdm import tqdm

from minicpm_pcd_adapters.by_name import load_schema
from minicpm_pcd_adapters.cli.options import (
    SETUP_ERRORS,
    Setup,
    check_paths,
    engine_options,
    fail,
    input_options,
    run_exit,
    set_up,
    stopped_by_signals,
)
from minicpm_pcd_adapters.files import answered_lines, classify_file, count_lines
from pcd_engine import Calibration, PCDError


def add_parser(sub: Any) -> None:
    parser = sub.add_parser("classify", help="classify every line of a file")
    input_options(parser, "JSONL file to classify (objects with 'text', or strings) or text lines")
    parser.add_argument("--output", required=True, help="JSONL file to write, one line per input")
    parser.add_argument(
        "--no-generation",
        action="store_true",
        help="refuse schemas with open fields (free text, numbers, lists) instead of generating them",
    )
    parser.add_argument("--batch-size", type=int, default=32, help="inputs per engine batch; each batch's "
                     "records are written as it completes (default 32)")  # fmt: skip
    parser.add_argument(
        "--resume",
        action="store_true",
        help="skip inputs already answered in --output (a torn last record is redone) and append",
    )
    parser.add_argument("--calibration", default=None, help="a calibration JSON file from `pcd calibrate`")
    parser.add_argument("--ray", action="store_true", help="classify on a Ray cluster: --input is a file or "
                     "folder of JSONL / text / Parquet files, --output a folder of shards, one per input "
                     "file; a rerun skips the shards already complete (the [ray] extra)")  # fmt: skip
    parser.add_argument("--ray-address", default=None, help="the cluster to join (default: a local one)")
    parser.add_argument("--actors", type=int, default=1, help="with --ray: engines running at once")
    parser.add_argument("--num-gpus", type=float, default=0, help="with --ray: GPUs per actor")
    parser.add_argument("--output-format", choices=("parquet", "jsonl"), default="parquet",
                        help="with --ray: the shards' format (default parquet)")  # fmt: skip
    parser.add_argument(
        "--abstain-below",
        type=float,
        default=None,
        help="mark fields whose (calibrated) confidence is below this probability; their records say "
        "needs_review",
    )


def main(args: argparse.Namespace) -> int:
    if args.ray:
        return run_ray(args)
    try:
        check_paths(args)  # before the resume check reads the input
        if args.batch_size < 1:
            raise ValueError(f"--batch-size must be at least 1, got {args.batch_size}")
        if args.resume and len(answered_lines(Path(args.output))) >= count_lines(Path(args.input)):
            print(
                f"pcd: every line of {args.input} is answered in {args.output}; nothing to resume",
                file=sys.stderr,
            )
            return 0  # before any model loads
        setup = set_up(args)
    except SETUP_ERRORS as error:
        return fail(error)
    return run(setup, args)


def run(setup: Setup, args: argparse.Namespace) -> int:
    """Exit codes: 0 every input answered, 1 some inputs got error records, 130 stopped by a signal
    (rerun with --resume to finish)."""
    source, output = Path(args.input), Path(args.output)
    with stopped_by_signals() as stop:
        total = count_lines(source)
        with tqdm(total=total, desc="classify", unit="text", file=sys.stderr) as bar:
            summary = classify_file(
                setup.engine,
                setup.schema,
                source,
                output,
                text_key=args.text_key,
                batch_size=args.batch_size,
                resume=args.resume,
                stop=stop,
                progress=bar.update,
                calibration=setup.calibration,
                abstain_below=args.abstain_below,
                **setup.options,
            )
    answered = summary.written - summary.errors
    print(
        f"pcd: {answered} classified ({summary.needs_review} need review), {summary.errors} errors, "
        f"{summary.skipped} already done -> {output}",
        file=sys.stderr,
    )
    return run_exit(summary.stopped, summary.errors)


def run_ray(args: argparse.Namespace) -> int:
    """`pcd classify --ray`: exit 0 every row answered, 1 some error rows, 2 usage or schema errors."""
    try:
        import ray

        from minicpm_pcd_adapters.ray.files import classify_files, input_files, rows_in
    except ImportError as error:
        return fail(f"{error}; install the ray extra: pip install 'minicpm-pcd[ray]'")
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
    except SETUP_ERRORS as error:
        return fail(error)
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
        return fail(error)
    finally:
        ray.shutdown()
    print(
        f"pcd: {summary.rows} rows written to {output} ({summary.errors} error rows); "
        f"{summary.shards} shards, {summary.skipped} already complete",
        file=sys.stderr,
    )
    return 1 if summary.errors else 0
