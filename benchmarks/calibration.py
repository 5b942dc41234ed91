"""Issue-14 benchmark: what labeled and unlabeled texts buy (calibration, in-context examples, wording).

One process, SmolLM2-135M-Instruct on CPU, FP32, default rule (option-cc). For each development set
the last `--fit` rows (50) are the user's labeled texts and the others are scored. Per configuration
(branch wording x number of in-context examples, the examples taken from the labeled rows and left
out of the fitting), every text is scored once and the calibrations are compared on those scores:
  - uncalibrated: the rule's own probabilities
  - auto / bias: fitted on the labeled rows (cross-validated choice of method per field)
  - batch (50 unlabeled): batch calibration fitted on the labeled rows' texts, labels unused
  - batch (in-batch): `classify_batch(calibrate="batch")` over the scored rows themselves
Printed per variant: field accuracy, macro-F1, ECE, log-loss (means over fields), exact-object
accuracy, the majority-answer floor (each field's most frequent label among the labeled rows), and
pooled coverage / accuracy when abstaining below 0.5, 0.7, 0.9. With `--xgrammar N`, xgrammar AR JSON
runs on the first N scored rows and every variant is also reported on those rows.

    python benchmarks/calibration.py --json out/calibration.json --plots docs/img
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.accuracy_latency import SETS, run_ar, xgrammar_grammar
from benchmarks.data import load_set
from minicpm_pcd_adapters import load_smollm2, plots
from pcd_engine import Calibration, Evaluation, PCDEngine, PCDError, metrics
from pcd_engine.calibration import fit
from pcd_engine.evaluation import evaluate
from pcd_engine.results import json_key

THRESHOLDS = (0.5, 0.7, 0.9)


def configuration(
    engine: PCDEngine,
    schema: Any,
    fit_rows: list[dict[str, Any]],
    score_rows: list[dict[str, Any]],
    shots: int,
    scores_dir: Path | None = None,
    scores_name: str = "",
) -> dict[str, Evaluation]:
    """Score once, then every calibration variant on those scores."""
    examples = [(r["text"], r["labels"]) for r in fit_rows[:shots]]
    pool = fit_rows[shots:]
    started = time.perf_counter()
    base = evaluate(
        engine, schema, [r["text"] for r in score_rows], [r["labels"] for r in score_rows], examples=examples
    )
    fitted = engine.classify_batch(
        [r["text"] for r in pool], schema, examples=examples, return_exceptions=True
    )
    seconds = time.perf_counter() - started
    plan = engine.plan(schema, examples=examples)
    fields = [None if isinstance(r, PCDError) else r.fields for r in fitted]
    labels = [r["labels"] for r in pool]
    identity = engine.model_identity
    scored = [None if isinstance(r, PCDError) else r.fields for r in base.results]
    variants: dict[str, Calibration | None] = {
        "uncalibrated": None,
        "auto": fit(plan, identity, fields, labels, "auto"),
        "bias": fit(plan, identity, fields, labels, "bias"),
        f"batch ({len(pool)} unlabeled)": fit(plan, identity, fields, None, "batch"),
        "batch (in-batch)": fit(plan, identity, scored, None, "batch"),
    }
    out = {name: base if cal is None else base.recalibrated(cal) for name, cal in variants.items()}
    if scores_dir is not None:  # the rule's scores, to study other calibrations without the model
        dump = {
            "fit": [
                None if f is None else {p: list(r.log_scores.values()) for p, r in f.items()} for f in fields
            ],
            "fit_labels": labels,
            "score": [
                None if f is None else {p: list(r.log_scores.values()) for p, r in f.items()} for f in scored
            ],
            "score_labels": [r["labels"] for r in score_rows],
        }
        scores_dir.mkdir(parents=True, exist_ok=True)
        (scores_dir / f"{scores_name}.json").write_text(json.dumps(dump))
    print(f"  scored {len(score_rows) + len(pool)} texts in {seconds:.0f} s", file=sys.stderr, flush=True)
    return out


def majority(fit_rows: list[dict[str, Any]], evaluation: Evaluation) -> float:
    """Mean over fields of the accuracy of answering each field's most frequent label among the
    labeled rows."""
    floors = []
    for path, f in evaluation.fields.items():
        train = [f.values.index(json_key(r["labels"][path])) for r in fit_rows]
        floors.append(metrics.majority_floor(train, f.labels))
    return sum(floors) / len(floors)


def pooled_abstention(evaluation: Evaluation, threshold: float) -> tuple[float, float]:
    """(coverage, accuracy on answered) over every (text, field), abstaining below `threshold`."""
    answered = right = total = 0
    for f in evaluation.fields.values():
        for probs, label in zip(f.probabilities, f.labels, strict=True):
            total += 1
            if max(probs) >= threshold:
                answered += 1
                right += probs.index(max(probs)) == label
    return answered / total, (right / answered if answered else float("nan"))


def first_rows(evaluation: Evaluation, n: int) -> float:
    """Field accuracy (mean over fields) on the first n scored rows (for the xgrammar comparison)."""
    accs = []
    for f in evaluation.fields.values():
        accs.append(metrics.accuracy(f.probabilities[:n], f.labels[:n]))
    return sum(accs) / len(accs)


def xgrammar_accuracy(engine: PCDEngine, schema: Any, rows: list[dict[str, Any]], max_new: int) -> float:
    call = run_ar(engine, schema, max_new, xgrammar_grammar(engine, schema))
    right = total = 0
    for row in rows:
        value = call(row["text"]).value
        for field, gold in row["labels"].items():
            total += 1
            right += value is not None and value.get(field) == gold
    return right / total


def row(name: str, e: Evaluation, floor: float, xgr_n: int) -> dict[str, Any]:
    s = e.summary
    out = {
        "variant": name,
        "field_accuracy": s["field_accuracy"],
        "macro_f1": s["field_macro_f1"],
        "ece": s["field_ece"],
        "log_loss": s["field_log_loss"],
        "exact": s["exact_accuracy"],
        "majority": floor,
        "abstain": {t: pooled_abstention(e, t) for t in THRESHOLDS},
    }
    if xgr_n:
        out[f"field_accuracy_first_{xgr_n}"] = first_rows(e, xgr_n)
    return out


def print_table(title: str, rows: list[dict[str, Any]], xgr: tuple[int, float] | None) -> None:
    print(f"\n### {title}")
    head = "| variant | field acc | macro-F1 | ECE | log-loss | exact | majority floor |"
    head += "".join(f" cov / acc @{t} |" for t in THRESHOLDS)
    if xgr:
        head += f" field acc, first {xgr[0]} |"
    print(head)
    print("|---|" + "---:|" * (head.count("|") - 2))
    for r in rows:
        cells = [r["field_accuracy"], r["macro_f1"], r["ece"], r["log_loss"], r["exact"], r["majority"]]
        line = f"| {r['variant']} | " + " | ".join(f"{c:.3f}" for c in cells) + " |"
        line += "".join(f" {c:.2f} / {a:.3f} |" for c, a in r["abstain"].values())
        if xgr:
            line += f" {r[f'field_accuracy_first_{xgr[0]}']:.3f} |"
        print(line)
    if xgr:
        print(f"\nxgrammar AR JSON on the first {xgr[0]} scored rows: field accuracy {xgr[1]:.3f}")
    sys.stdout.flush()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--sets", nargs="*", default=list(SETS))
    parser.add_argument("--fit", type=int, default=50, help="labeled rows (taken from the end of each set)")
    parser.add_argument("--limit", type=int, default=None, help="score at most this many rows per set")
    parser.add_argument("--examples", type=int, nargs="*", default=[0, 4, 16])
    parser.add_argument("--wordings", nargs="*", default=["json", "plain"])
    parser.add_argument("--xgrammar", type=int, default=0, help="xgrammar AR JSON on the first N scored rows")
    parser.add_argument("--json", type=Path, default=None)
    parser.add_argument("--plots", type=Path, default=None, help="folder for the PNGs of the default setup")
    parser.add_argument("--scores", type=Path, default=None, help="folder to save every text's rule scores")
    args = parser.parse_args()
    base = load_smollm2()
    engines = {"json": base}
    if "plain" in args.wordings:
        engines["plain"] = PCDEngine(base.model, base.tokenizer, branch_wording="plain")
    report: dict[str, Any] = {}
    for name in args.sets:
        schema, rows = load_set(name)
        fit_rows, score_rows = rows[-args.fit :], rows[: -args.fit][: args.limit]
        xgr = None
        if args.xgrammar:
            started = time.perf_counter()
            xgr = (args.xgrammar, xgrammar_accuracy(base, schema, score_rows[: args.xgrammar], SETS[name]))
            print(f"  xgrammar: {time.perf_counter() - started:.0f} s", file=sys.stderr, flush=True)
        report[name] = {"xgrammar": xgr, "configurations": {}}
        for wording in args.wordings:
            for shots in args.examples if wording == "json" else [0]:
                title = f"{name}: wording {wording}, {shots} in-context examples, {len(score_rows)} scored"
                print(title, file=sys.stderr, flush=True)
                slug = f"{name}_{wording}_{shots}"
                evaluations = configuration(
                    engines[wording], schema, fit_rows, score_rows, shots, args.scores, slug
                )
                floor = majority(fit_rows, evaluations["uncalibrated"])
                rows_out = [row(v, e, floor, args.xgrammar) for v, e in evaluations.items()]
                report[name]["configurations"][f"{wording}/{shots}"] = rows_out
                print_table(title, rows_out, xgr)
                if args.plots and wording == "json" and shots == 0:
                    for variant in ("uncalibrated", "auto"):
                        slug = f"{name}_{variant}"
                        plots.reliability_diagram(
                            evaluations[variant], args.plots / f"{slug}_reliability.png", f"{name}: {variant}"
                        )
                        plots.coverage_plot(
                            evaluations[variant], args.plots / f"{slug}_coverage.png", f"{name}: {variant}"
                        )
                if args.json:
                    args.json.parent.mkdir(parents=True, exist_ok=True)
                    args.json.write_text(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
