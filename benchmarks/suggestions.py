"""Issue-45 benchmark: suggested labels against random ones, by round (SmolLM2-135M-Instruct, CPU).

Per development set, every row is scored once with its hidden states (benchmarks/labels.py's cache).
Per draw, the rows are shuffled (seed = draw): the first `--pool` are the texts a user could label,
the rest are the held-out test rows. Each round adds `--step` labels and fits `auto` (heads
included) on all the labels so far:

- random: the next texts drawn uniformly from the pool;
- suggested: `suggestions.pick` (the engine's `suggest_labels`): the first round on the uncalibrated
  answers, each later round on the answers under the calibration fitted so far, away from the
  texts already labeled.

Printed per round: field accuracy and ECE on the test rows (mean and spread over the draws), and
the paired difference suggested - random with its standard error.

    python benchmarks/suggestions.py --draws 10 --rounds 4 --json out/suggestions.json
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.accuracy_latency import SETS
from benchmarks.labels import figures, scored_set
from minicpm_pcd_adapters import load_smollm2
from pcd_engine.fitting import fit
from pcd_engine.suggestions import pick


def one_draw(engine: Any, plan: Any, scored: list, truth: list, draw: int, args: argparse.Namespace) -> dict:
    order = list(range(len(scored)))
    random.Random(draw).shuffle(order)
    pool, test = order[: args.pool], order[args.pool :]
    out: dict[str, list[tuple[float, float]]] = {"random": [], "suggested": []}
    chosen: dict[str, list[int]] = {"random": [], "suggested": []}
    calibration = None
    draws = random.Random(1000 + draw)
    for _ in range(args.rounds):
        left = [i for i in pool if i not in chosen["random"]]
        chosen["random"] += draws.sample(left, args.step)
        labeled = set(chosen["suggested"])
        candidates = [i for i in pool if i not in labeled]
        fields = [
            scored[i][0] if calibration is None else calibration.apply(scored[i][0], scored[i][1])
            for i in candidates
        ]
        features = [scored[i][1].text_middle for i in candidates]
        taken = [scored[i][1].text_middle for i in chosen["suggested"]]
        picked = pick(fields, features, args.step, labeled=taken, seed=draw)
        chosen["suggested"] += [candidates[p.index] for p in picked]
        for name, idx in chosen.items():
            cal = fit(
                plan,
                engine.model_identity,
                [scored[i][0] for i in idx],
                [truth[i] for i in idx],
                "auto",
                hidden=[scored[i][1] for i in idx],
            )
            answers = [cal.apply(scored[i][0], scored[i][1]) for i in test]
            mean = figures(plan, answers, [truth[i] for i in test])["mean"]
            out[name].append((mean["accuracy"], mean["ece"]))
            if name == "suggested":
                calibration = cal
    return out


def run_set(engine: Any, name: str, args: argparse.Namespace) -> dict[str, Any]:
    _, _, plan, scored, truth = scored_set(engine, name, Path(args.cache))
    runs = []
    for draw in range(args.draws):
        runs.append(one_draw(engine, plan, scored, truth, draw, args))
        last = runs[-1]
        print(
            f"{name} draw {draw}: "
            + "  ".join(f"{s} " + " ".join(f"{a:.3f}" for a, _ in last[s]) for s in last),
            flush=True,
        )
    table = []
    for r in range(args.rounds):
        row: dict[str, Any] = {"labels": args.step * (r + 1)}
        for s in ("random", "suggested"):
            acc = [run[s][r][0] for run in runs]
            ece = [run[s][r][1] for run in runs]
            row[s] = {
                "accuracy": statistics.fmean(acc),
                "accuracy_sd": _sd(acc),
                "ece": statistics.fmean(ece),
            }
        diff = [run["suggested"][r][0] - run["random"][r][0] for run in runs]
        row["difference"] = statistics.fmean(diff)
        row["difference_se"] = _sd(diff) / len(diff) ** 0.5
        table.append(row)
        print(
            f"{name} {row['labels']:>4} labels: random {row['random']['accuracy']:.3f} "
            f"(sd {row['random']['accuracy_sd']:.3f}, ECE {row['random']['ece']:.3f})  suggested "
            f"{row['suggested']['accuracy']:.3f} (sd {row['suggested']['accuracy_sd']:.3f}, ECE "
            f"{row['suggested']['ece']:.3f})  difference {row['difference']:+.3f} "
            f"(se {row['difference_se']:.3f})",
            flush=True,
        )
    return {"draws": args.draws, "pool": args.pool, "rounds": table, "runs": runs}


def _sd(values: list[float]) -> float:
    return statistics.stdev(values) if len(values) > 1 else 0.0


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--sets", nargs="+", default=list(SETS))
    parser.add_argument("--draws", type=int, default=10)
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--step", type=int, default=50, help="labels added per round")
    parser.add_argument(
        "--pool", type=int, default=200, help="rows a user could label; the rest are test rows"
    )
    parser.add_argument("--cache", default="out/labels-cache", help="folder for the scored rows")
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    engine = load_smollm2()
    results = {name: run_set(engine, name, args) for name in args.sets}
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
