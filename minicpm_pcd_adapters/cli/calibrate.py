"""`pcd calibrate`: fit a calibration (maps or heads) from a labeled or unlabeled JSONL file."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

from tqdm import tqdm

from minicpm_pcd_adapters.cli.options import SETUP_ERRORS, Setup, fail, input_options, set_up
from pcd_engine import PCDError


def add_parser(sub: Any) -> None:
    parser = sub.add_parser("calibrate", help="fit a calibration from a (labeled or unlabeled) JSONL file")
    input_options(parser, 'JSONL: {"text": ..., "label": {...}} per line; without labels: batch calibration')
    parser.add_argument("--label-key", default="label", help="key of the label object (also read: 'labels')")
    parser.add_argument("--output", required=True, help="calibration JSON file to write")
    parser.add_argument(
        "--method", default="auto", help="auto, head, bias, temperature, batch or none (head: its "
        "weights go beside the JSON, same name with .safetensors)"
    )  # fmt: skip
    parser.add_argument("--folds", type=int, default=5, help="cross-validation folds of the report")


def main(args: argparse.Namespace) -> int:
    try:
        setup = set_up(args, labeled=True)
    except SETUP_ERRORS as error:
        return fail(error)
    return run(setup, args)


def run(setup: Setup, args: argparse.Namespace) -> int:
    engine, schema, rows = setup.engine, setup.schema, setup.rows
    labeled = any(label is not None for _, label in rows)
    labels = [label or {} for _, label in rows] if labeled else None
    fields = len(engine.plan(schema, **setup.options).scored_decisions)
    how = f"{args.method}, {args.folds}-fold" if labeled else "batch"
    fit_bar: list[Any] = []  # opened once scoring is done and the first field's fitting starts
    try:
        with tqdm(total=len(rows), desc="score", unit="text", file=sys.stderr) as bar:

            def fitting(path: str) -> None:  # a field starts: the one before it is done
                if not fit_bar:
                    bar.close()
                    fit_bar.append(tqdm(total=fields, desc=f"fit ({how})", unit="field", file=sys.stderr))
                else:
                    fit_bar[0].update(1)
                fit_bar[0].set_postfix_str(path)

            fitted = engine.calibrate(
                schema,
                [text for text, _ in rows],
                labels,
                method=args.method,
                folds=args.folds,
                progress=bar.update,
                fit_progress=fitting,
                **setup.options,
            )
        for done in fit_bar:
            done.update(done.total - done.n)
            done.close()
        output = Path(args.output)
        output.parent.mkdir(parents=True, exist_ok=True)
        fitted.save(output)
    except (PCDError, OSError) as error:
        return fail(error)
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
