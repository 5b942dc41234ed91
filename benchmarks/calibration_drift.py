"""Issue-33 benchmark: does `auto` stay calibrated as labels grow? (SmolLM2-135M-Instruct, CPU, FP32.)

Per development set, every row is scored once (`benchmarks/labels.py`'s cache, shared). The 300 rows
are cut in three blocks of 100; each block in turn is the test rows and `auto` is fitted on N labels
drawn from the other 200 (`--draws` draws at 50, the whole 200 once), so every figure is over 300
test rows never fitted on. Printed per count: field accuracy, mean confidence and ECE (means over the
fields), and the ECE's sampling floor: the ECE of labels drawn from the answers' own probabilities,
i.e. what a perfectly calibrated model would show on this many rows (20 draws). An ECE near its
floor cannot be told apart from perfect calibration on this data.

With two `--variants` (engine options: rule, dtype, shortlist), scored and fitted on the same label
draws, the accuracies are also compared draw by draw: the mean paired difference and its spread
(standard deviation over the draws), beside each one's uncalibrated accuracy over all 300 rows and
how many uncalibrated answers the two give alike.

    python benchmarks/calibration_drift.py --json out/calibration_drift.json
    python benchmarks/calibration_drift.py --sets bitext_customer_support --counts 50 --draws 10 \
        --variants rule=option-cc rule=option-boolcut-cc --json out/default_rule.json
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.labels import scored_set
from minicpm_pcd_adapters import load_smollm2
from pcd_engine import PCDEngine, metrics
from pcd_engine.fitting import fit
from pcd_engine.results import json_key

BLOCK = 100


def floor_ece(probabilities: list[list[float]], rng: random.Random, times: int = 20) -> float:
    """The mean ECE of labels drawn from the probabilities themselves (perfect calibration)."""
    return statistics.fmean(
        metrics.ece(probabilities, [rng.choices(range(len(p)), weights=p)[0] for p in probabilities])
        for _ in range(times)
    )


def run_set(engine: PCDEngine, name: str, args: argparse.Namespace) -> dict[str, Any]:
    _, rows, plan, scored, truth = scored_set(engine, name, Path(args.cache))
    accuracy = uncalibrated(plan, scored, truth)
    paths = [dp.decision.path for dp in plan.scored_decisions]
    variant = f"{engine.rule.name} {engine.runner.dtype} shortlist={'on' if plan.shortlisted else 'off'}"
    rescored = statistics.fmean(s[0][p].rescored for s in scored for p in paths)
    print(f"{name} {variant}: uncalibrated accuracy {accuracy:.3f}, rescored {rescored:.3f}", flush=True)
    values = {
        dp.decision.path: [json_key(c.value) for c in dp.decision.candidates] for dp in plan.scored_decisions
    }
    out: dict[str, Any] = {}
    for count in args.counts:
        figures: dict[str, list[float]] = {
            k: [] for k in ("accuracy", "confidence", "ece", "floor", "seconds")
        }
        chosen: dict[str, int] = {}
        for draw in range(args.draws if count < len(rows) - BLOCK else 1):
            pooled: dict[str, tuple[list[list[float]], list[int]]] = {p: ([], []) for p in paths}
            for block in range(len(rows) // BLOCK):
                test = range(block * BLOCK, (block + 1) * BLOCK)
                pool = [i for i in range(len(rows)) if i not in test]
                fit_idx = sorted(random.Random(draw * 7 + block).sample(pool, min(count, len(pool))))
                started = time.perf_counter()
                calibration = fit(
                    plan,
                    engine.model_identity,
                    [scored[i][0] for i in fit_idx],
                    [truth[i] for i in fit_idx],
                    "auto",
                    hidden=[scored[i][1] for i in fit_idx],
                )
                figures["seconds"].append(time.perf_counter() - started)
                for p in paths:
                    method = calibration.report["fields"][p]["method"]
                    chosen[method] = chosen.get(method, 0) + 1
                for i in test:
                    answer = calibration.apply(scored[i][0], scored[i][1])
                    for p in paths:
                        pooled[p][0].append(list(answer[p].probabilities.values()))
                        pooled[p][1].append(values[p].index(json_key(truth[i][p])))
            rng = random.Random(draw)
            figures["accuracy"].append(statistics.fmean(metrics.accuracy(*pooled[p]) for p in paths))
            figures["confidence"].append(
                statistics.fmean(statistics.fmean(metrics.confidences(pooled[p][0])) for p in paths)
            )
            figures["ece"].append(statistics.fmean(metrics.ece(*pooled[p]) for p in paths))
            figures["floor"].append(statistics.fmean(floor_ece(pooled[p][0], rng) for p in paths))
        mean = {k: statistics.fmean(v) for k, v in figures.items()}
        out[str(count)] = {
            **mean,
            "ece_per_draw": figures["ece"],
            "accuracy_per_draw": figures["accuracy"],
            "chosen": chosen,
        }
        print(
            f"{name} {count:>4} labels: accuracy {mean['accuracy']:.3f}  "
            f"confidence {mean['confidence']:.3f}  "
            f"ECE {mean['ece']:.3f} ({', '.join(f'{e:.3f}' for e in figures['ece'])})  floor "
            f"{mean['floor']:.3f}  fit {statistics.median(figures['seconds']):.0f} s  chosen {chosen}",
            flush=True,
        )
    out["uncalibrated"] = accuracy
    out["answers"] = [{p: json_key(s[0][p].value) for p in paths} for s in scored]
    return out


def uncalibrated(plan: Any, scored: list, truth: list[dict[str, Any]]) -> float:
    """Field accuracy of the rule's own answers over every row (mean over the fields)."""
    paths = [dp.decision.path for dp in plan.scored_decisions]
    pairs = list(zip(scored, truth, strict=True))
    right = [[json_key(s[0][p].value) == json_key(t[p]) for s, t in pairs] for p in paths]
    return statistics.fmean(statistics.fmean(r) for r in right)


def paired(first: dict[str, Any], second: dict[str, Any], count: str) -> tuple[float, float, int]:
    """Mean and standard deviation over the draws of the second variant's accuracy minus the first's."""
    differences = [
        b - a
        for a, b in zip(first[count]["accuracy_per_draw"], second[count]["accuracy_per_draw"], strict=True)
    ]
    spread = statistics.stdev(differences) if len(differences) > 1 else 0.0
    return statistics.fmean(differences), spread, len(differences)


def agreement(first: dict[str, Any], second: dict[str, Any]) -> float:
    """The share of (row, field) answers, uncalibrated, that two variants give alike."""
    pairs = list(zip(first["answers"], second["answers"], strict=True))
    return statistics.fmean(a[p] == b[p] for a, b in pairs for p in a)


def engine_options(variant: str) -> dict[str, Any]:
    """`rule=option-cc,dtype=bfloat16,shortlist=off` -> load_smollm2's options."""
    options: dict[str, Any] = {}
    for part in filter(None, variant.split(",")):
        key, _, value = part.partition("=")
        if key not in ("rule", "dtype", "shortlist", "fp32_rescore"):
            keys = "rule, dtype, shortlist, fp32_rescore"
            raise SystemExit(f"unknown variant key {key!r} in {variant!r}: use {keys}")
        options[key] = value if key in ("rule", "dtype") else value == "on"
    return options


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--sets", nargs="+", default=["bitext_customer_support", "banking77"])
    parser.add_argument("--counts", type=int, nargs="*", default=[50, 200], help="none: uncalibrated only")
    parser.add_argument("--draws", type=int, default=3, help="label draws per count below the whole pool")
    parser.add_argument("--cache", default="out/labels-cache", help="benchmarks/labels.py's scored rows")
    parser.add_argument(
        "--variants",
        nargs="+",
        default=[""],
        help="engines compared on the same draws: rule=R, dtype=D, shortlist=on|off, fp32_rescore=on|off",
    )
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    results: dict[str, dict[str, Any]] = {}
    for variant in args.variants:
        engine = load_smollm2(**engine_options(variant))
        for name in args.sets:
            results.setdefault(name, {})[variant or "default"] = run_set(engine, name, args)
    if len(args.variants) == 2:
        for name, per_variant in results.items():
            first, second = per_variant.values()
            labels = " - ".join(reversed(list(per_variant)))
            print(f"{name}: uncalibrated answers alike {agreement(first, second):.3f}")
            for count in first:
                if count in ("uncalibrated", "answers"):
                    continue
                mean, spread, draws = paired(first, second, count)
                print(f"{name} {count} labels: {labels} = {mean:+.3f} (sd {spread:.3f} over {draws} draws)")
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
