"""Issue-45 benchmark: the time `fit` takes with heads (`auto`, hidden states), and what it answers.

Per development set, every row is scored once with its hidden states (benchmarks/labels.py's cache);
per draw the rows are shuffled (seed = draw), the first `--labels` are fitted and the rest are the
test rows. Printed per draw: seconds of fitting, the method each field chose, and field accuracy
and ECE on the test rows. Only `fit` is timed (no model work).

    python benchmarks/fitting.py --labels 50 100 200 --draws 3 --json out/fitting.json
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.labels import figures, scored_set
from minicpm_pcd_adapters import load_smollm2
from pcd_engine.fitting import fit


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sets", nargs="+", default=["bitext_customer_support", "banking77"])
    parser.add_argument("--labels", type=int, nargs="+", default=[200])
    parser.add_argument("--draws", type=int, default=3)
    parser.add_argument("--cache", default="out/labels-cache", help="folder for the scored rows")
    parser.add_argument("--json", help="write the figures here")
    args = parser.parse_args()
    engine = load_smollm2()
    out = {}
    for name in args.sets:
        _, _, plan, scored, truth = scored_set(engine, name, Path(args.cache))
        runs = []
        for labels in args.labels:
            for draw in range(args.draws):
                order = list(range(len(scored)))
                random.Random(draw).shuffle(order)
                train, test = order[:labels], order[labels:]
                began = time.perf_counter()
                cal = fit(
                    plan,
                    engine.model_identity,
                    [scored[i][0] for i in train],
                    [truth[i] for i in train],
                    "auto",
                    hidden=[scored[i][1] for i in train],
                )
                seconds = time.perf_counter() - began
                answers = [cal.apply(scored[i][0], scored[i][1]) for i in test]
                mean = figures(plan, answers, [truth[i] for i in test])["mean"]
                chosen = {p: _chosen(r) for p, r in cal.report["fields"].items()}
                runs.append({"labels": labels, "draw": draw, "seconds": seconds, **mean, "chosen": chosen})
                print(f"{name} {labels} labels, draw {draw}: {seconds:.2f} s, accuracy "
                      f"{mean['accuracy']:.4f}, ECE {mean['ece']:.4f}")  # fmt: skip
                print("   ", chosen)
            median = statistics.median(r["seconds"] for r in runs if r["labels"] == labels)
            print(f"{name}: median {median:.2f} s over {args.draws} draws at {labels} labels")
        out[name] = runs
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=1))


def _chosen(report: dict) -> str:
    if report["method"] != "head":
        return report["method"]
    return f"head/{report['head_block']}/{report['head_l2']:g}"


if __name__ == "__main__":
    main()
