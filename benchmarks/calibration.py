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

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.accuracy_latency import SETS, run_ar, xgrammar_grammar
from benchmarks.data import load_set
from minicpm_pcd_adapters import load_smollm2, plots
from pcd_engine import (
    Calibration,
    Evaluation,
    FieldResult,
    InputError,
    PCDEngine,
    PCDError,
    PCDResult,
    metrics,
)
from pcd_engine.fitting import decision_labels, fit
from pcd_engine.results import json_key

THRESHOLDS = (0.5, 0.7, 0.9)


def configuration(
    engine: PCDEngine,
    schema: Any,
    fit_rows: list[dict[str, Any]],
    score_rows: list[dict[str, Any]],
    shots: int,
    scores: Path | None = None,
    saved: dict[str, Any] | None = None,
) -> dict[str, Evaluation]:
    """Score once (or take the saved scores of an earlier run), then every calibration variant on
    those scores. `scores`: a file to save every text's rule scores to."""
    examples = [(r["text"], r["labels"]) for r in fit_rows[:shots]]
    pool = fit_rows[shots:]
    plan = engine.plan(schema, examples=examples)
    started = time.perf_counter()
    if saved is None:
        scored = engine.classify_batch(
            [r["text"] for r in score_rows], schema, examples=examples, return_exceptions=True
        )
        fitted = engine.classify_batch(
            [r["text"] for r in pool], schema, examples=examples, return_exceptions=True
        )
        print(
            f"  scored {len(score_rows) + len(pool)} texts in {time.perf_counter() - started:.0f} s",
            file=sys.stderr,
        )
    else:
        scored, fitted = rebuild(plan, saved["score"]), rebuild(plan, saved["fit"])
    truth = [decision_labels(plan.compiled, r["labels"], i) for i, r in enumerate(score_rows)]
    values = {
        dp.decision.path: [json_key(c.value) for c in dp.decision.candidates] for dp in plan.scored_decisions
    }
    base = Evaluation.of(values, scored, truth)
    fit_fields = [None if isinstance(r, PCDError) else r.fields for r in fitted]
    score_fields = [None if isinstance(r, PCDError) else r.fields for r in scored]
    labels = [r["labels"] for r in pool]
    identity = engine.model_identity
    variants: dict[str, Calibration | None] = {
        "uncalibrated": None,
        "auto": fit(plan, identity, fit_fields, labels, "auto"),
        "bias": fit(plan, identity, fit_fields, labels, "bias"),
        f"batch ({len(pool)} unlabeled)": fit(plan, identity, fit_fields, None, "batch"),
        "batch (in-batch)": fit(plan, identity, score_fields, None, "batch"),
    }
    if scores is not None and saved is None:  # the rule's scores, to study calibrations without the model
        dump = {"fit": [_scores(f) for f in fit_fields], "score": [_scores(f) for f in score_fields]}
        scores.parent.mkdir(parents=True, exist_ok=True)
        scores.write_text(json.dumps(dump))
    return {name: base if cal is None else base.recalibrated(cal) for name, cal in variants.items()}


def _scores(fields: dict[str, FieldResult] | None) -> dict[str, list[float]] | None:
    return None if fields is None else {p: list(f.log_scores.values()) for p, f in fields.items()}


def rebuild(plan: Any, saved: list[dict[str, list[float]] | None]) -> list[Any]:
    """Results made of saved rule scores: each field's raw probabilities and answer, as the engine
    gives them before calibration (None: the text had failed)."""
    out: list[Any] = []
    for row in saved:
        if row is None:
            out.append(InputError("failed in the scoring run"))
            continue
        fields = {}
        for dp in plan.scored_decisions:
            values = [c.value for c in dp.decision.candidates]
            z = torch.tensor(row[dp.decision.path], dtype=torch.float64)
            probs = torch.softmax(z, dim=0).tolist()
            best = max(range(len(probs)), key=probs.__getitem__)
            margin = probs[best] - max((p for i, p in enumerate(probs) if i != best), default=0.0)
            fields[dp.decision.path] = FieldResult(
                dp.decision.path, values[best], dict(zip(values, probs, strict=True)),
                dict(zip(values, z.tolist(), strict=True)), margin, dp.rule.name,
            )  # fmt: skip
        out.append(PCDResult(None, fields, None))
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
    parser.add_argument(
        "--from-scores",
        action="store_true",
        help="no scoring: recompute every calibration from the scores saved in --scores by an earlier run "
        "(and its xgrammar figures from --json)",
    )
    args = parser.parse_args()
    base = load_smollm2()
    engines = {"json": base}
    if "plain" in args.wordings:
        engines["plain"] = PCDEngine(base.model, base.tokenizer, branch_wording="plain")
    report: dict[str, Any] = {}
    earlier = (
        json.loads(args.json.read_text()) if args.from_scores and args.json and args.json.exists() else {}
    )
    for name in args.sets:
        schema, rows = load_set(name)
        fit_rows, score_rows = rows[-args.fit :], rows[: -args.fit][: args.limit]
        xgr = earlier.get(name, {}).get("xgrammar")
        if args.xgrammar and not args.from_scores:
            started = time.perf_counter()
            xgr = (args.xgrammar, xgrammar_accuracy(base, schema, score_rows[: args.xgrammar], SETS[name]))
            print(f"  xgrammar: {time.perf_counter() - started:.0f} s", file=sys.stderr, flush=True)
        first = xgr[0] if xgr else 0
        report[name] = {"xgrammar": xgr, "configurations": {}}
        for wording in args.wordings:
            for shots in args.examples if wording == "json" else [0]:
                title = f"{name}: wording {wording}, {shots} in-context examples, {len(score_rows)} scored"
                print(title, file=sys.stderr, flush=True)
                file = args.scores / f"{name}_{wording}_{shots}.json" if args.scores else None
                saved = json.loads(file.read_text()) if args.from_scores and file else None
                evaluations = configuration(
                    engines[wording], schema, fit_rows, score_rows, shots, file, saved
                )
                floor = majority(fit_rows, evaluations["uncalibrated"])
                rows_out = [row(v, e, floor, first) for v, e in evaluations.items()]
                report[name]["configurations"][f"{wording}/{shots}"] = rows_out
                print_table(title, rows_out, xgr)
                if args.plots and wording == "json" and shots == 0:
                    for variant in ("uncalibrated", "bias"):
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
