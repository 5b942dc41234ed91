"""`pcd evaluate`: accuracy and calibration on a labeled JSONL file, with report.json, report.html
(`report.py`: the page a person reads) and PNG plots."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any

from tqdm import tqdm

from minicpm_pcd_adapters.cli.options import SETUP_ERRORS, Setup, fail, input_options, set_up
from pcd_engine import PCDError

if TYPE_CHECKING:
    from pcd_engine import Calibration, Evaluation


def add_parser(sub: Any) -> None:
    parser = sub.add_parser("evaluate", help="measure accuracy and calibration on a labeled JSONL file")
    input_options(parser, 'labeled JSONL: {"text": ..., "label": {field: value}} per line')
    parser.add_argument("--label-key", default="label", help="key of the label object (also read: 'labels')")
    parser.add_argument("--calibration", default=None, help="evaluate with this calibration JSON file")
    parser.add_argument(
        "--fit", type=int, default=0, help="fit a calibration on the first N labeled lines (after the "
        "examples) and score the rest, with and without it"
    )  # fmt: skip
    parser.add_argument("--method", default="auto", help="calibration method for --fit (default: auto)")
    parser.add_argument(
        "--examples", type=int, default=0, help="use the first N labeled lines as in-context examples "
        "(in the cached head) and score the rest"
    )  # fmt: skip
    parser.add_argument(
        "--report",
        default="out/evaluate",
        help="folder for report.html, report.json and the PNG plots (default: out/evaluate); one that "
        "already holds a report needs --overwrite",
    )
    parser.add_argument("--overwrite", action="store_true", help="replace the report already in --report "
                        "(its report files, calibration and PNG plots are removed first)")  # fmt: skip


def main(args: argparse.Namespace) -> int:
    try:  # everything checkable before the model loads
        check_report(Path(args.report), args.overwrite)
        import_plots()
        setup = set_up(args, labeled=True, check_rows=lambda rows: check_rows(rows, args))
    except SETUP_ERRORS as error:
        return fail(error)
    return run(setup, args)


def check_rows(rows: list[tuple[str, dict[str, Any] | None]], args: argparse.Namespace) -> None:
    if any(label is None for _, label in rows):
        raise ValueError("every line needs a label to evaluate")
    if args.examples + args.fit >= len(rows):
        raise ValueError(f"--examples + --fit must leave lines to score ({len(rows)} lines)")


REPORT_FILES = ("report.json", "report.html", "calibration.json", "calibration.safetensors", "*.png")


def check_report(report: Path, overwrite: bool) -> None:
    """Before the model loads: a report folder that already holds a report is refused unless
    `overwrite`, and then emptied of it, so that one run's plots never sit beside another's."""
    if report.exists() and not report.is_dir():
        raise NotADirectoryError(f"--report {report} is a file; name a folder")
    old = [p for pattern in REPORT_FILES for p in report.glob(pattern)] if report.is_dir() else []
    if old and not overwrite:
        raise FileExistsError(
            f"--report {report} already holds a report; pass --overwrite or name another folder"
        )
    for path in old:
        path.unlink()


def import_plots() -> Any:
    try:
        from minicpm_pcd_adapters import plots  # matplotlib: the [eval] extra
    except ImportError as error:
        raise ImportError(f"{error}; install the plots with: pip install 'minicpm-pcd[eval]'") from None
    return plots


def run(setup: Setup, args: argparse.Namespace) -> int:
    plots = import_plots()
    from minicpm_pcd_adapters.report import write_report  # Jinja2 beside matplotlib: the [eval] extra
    from pcd_engine import evaluate_each  # with the engine: PyTorch is loaded by now

    engine, schema, rows, calibration, options = (
        setup.engine, setup.schema, setup.rows, setup.calibration, setup.options
    )  # fmt: skip
    shots = rows[: args.examples]
    fitting = rows[args.examples : args.examples + args.fit]
    scoring = rows[args.examples + args.fit :]
    report = Path(args.report)
    texts, labels = [t for t, _ in scoring], [y for _, y in scoring]
    calibrations: dict[str, Calibration | None] = {"uncalibrated": None}
    if calibration is not None:
        calibrations["calibrated"] = calibration
    try:
        if fitting:  # fitted first, so that the scored lines are scored once for every variant
            fitted = engine.calibrate(
                schema, [t for t, _ in fitting], [y for _, y in fitting], method=args.method, **options
            )
            report.mkdir(parents=True, exist_ok=True)
            fitted.save(report / "calibration.json")
            calibrations[f"calibrated on {len(fitting)}"] = fitted
        with tqdm(total=len(scoring), desc="evaluate", unit="text", file=sys.stderr) as bar:
            variants = evaluate_each(
                engine, schema, texts, labels, calibrations, progress=bar.update, **options
            )
    except PCDError as error:
        return fail(error)
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
    about = {
        "schema": args.schema,
        "model": engine.model_identity.name,
        "input": f"{args.input}: {len(rows)} records; {len(shots)} in-context examples, "
        f"{len(fitting)} fitted on, {len(scoring)} scored (from record {len(shots) + len(fitting) + 1})",
        "calibration": args.calibration or "none given",
    }
    write_report(report / "report.html", variants, texts, about, first=len(shots) + len(fitting) + 1)
    print(f"pcd: report.html, report.json and plots -> {report}", file=sys.stderr)
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
