"""Multi-turn structured calls: field accuracy when the text to classify is the last turn of a longer
conversation, under the two renderings a door has had (SmolLM2-135M, CPU, the default rule).

Each row of a development set becomes: a system message, a user greeting, the assistant's reply, then
the row's text as the user's last turn. Renderings:
  - turns (now, every door): the conversation as the chat template's turns (`engine.classify` on a
    `Conversation`);
  - flattened (before: the LangChain, LlamaIndex and server structured paths): the turns as one user
    text of "Role: content" paragraphs, the system message as the instructions.
The single-turn accuracy (the row's text alone) is printed beside them as the reference.

With `--labels N`, the same renderings after N labels: every row of a set is scored once per rendering
(hidden states kept), the rows are cut in three blocks of 100, and on each block `auto` is fitted on N
labels drawn from the other 200 (`--draws` draws, the same draws for every rendering), so every figure
is over 300 rows never fitted on. Printed per rendering: the uncalibrated field accuracy over the 300
rows, the mean field accuracy and ECE after labels, and the paired difference of turns against
flattened with its spread over the draws; `--fields` adds each field's accuracy.

    python benchmarks/multi_turn.py --limit 150
    python benchmarks/multi_turn.py --labels 50 --draws 10 --fields
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import time
from pathlib import Path
from typing import Any, NamedTuple

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.data import load_set
from benchmarks.labels import fitted_answers
from minicpm_pcd_adapters import load_smollm2
from pcd_engine import Conversation, PCDEngine, PCDError, metrics
from pcd_engine.fitting import decision_labels
from pcd_engine.results import json_key

SYSTEM = "You are a customer-support assistant. Classify the customer's last message."
OPENING = [("user", "Hello, I need some help."), ("assistant", "Of course. What can I do for you?")]


def accuracy(results: list[Any], rows: list[dict[str, Any]]) -> float:
    right = total = 0
    for result, row in zip(results, rows, strict=True):
        for name, label in row["labels"].items():
            total += 1
            right += not isinstance(result, PCDError) and getattr(result.value, name) == label
    return right / total


def renderings(rows: list[dict[str, Any]]) -> dict[str, list[Any]]:
    """Each rendering's inputs, scored under a plan whose instructions are SYSTEM: a conversation's
    system text takes the instructions' place (`engine.classify` does the same)."""
    turns = [Conversation.of([*OPENING, ("user", row["text"])]) for row in rows]
    return {
        "single turn (reference)": [row["text"] for row in rows],
        "turns (now)": turns,
        "flattened (before)": [Conversation(c.turns).text for c in turns],
    }


def measure(engine: PCDEngine, name: str, limit: int) -> list[tuple[str, float, float]]:
    model, rows = load_set(name, limit)
    out = []
    for label, inputs in renderings(rows).items():
        started = time.perf_counter()
        results = engine.classify_batch(inputs, model, instructions=SYSTEM, return_exceptions=True)
        out.append((label, accuracy(results, rows), time.perf_counter() - started))
    return out


BLOCK = 100


class Labeled(NamedTuple):
    """One rendering's figures on one set."""

    uncalibrated: dict[str, float]  # per field, over every row
    after_labels: dict[str, float]  # per field, over every draw's test rows
    per_draw: list[tuple[float, float]]  # per draw: (mean field accuracy, mean ECE)


def labeled(engine: PCDEngine, name: str, count: int, draws: int) -> dict[str, Labeled]:
    """Per rendering: its figures, `auto` fitted on `count` labels drawn from the blocks a row is
    not in."""
    model, rows = load_set(name)
    plan = engine.plan(model, instructions=SYSTEM)
    truth = [decision_labels(plan.compiled, row["labels"], i) for i, row in enumerate(rows)]
    paths = [dp.decision.path for dp in plan.scored_decisions]
    values = {
        dp.decision.path: [json_key(c.value) for c in dp.decision.candidates] for dp in plan.scored_decisions
    }
    out: dict[str, Labeled] = {}
    for label, inputs in renderings(rows).items():
        started = time.perf_counter()
        answered = engine.score_fields(plan, inputs, hidden=True)
        seconds = time.perf_counter() - started
        print(f"  {name} {label}: scored {len(rows)} rows in {seconds:.0f} s", flush=True)
        scored = [s for s in answered if not isinstance(s, PCDError)]
        if len(scored) < len(rows):
            raise RuntimeError(f"{name} {label}: some rows could not be scored")
        right = [
            [json_key(s[0][p].value) == json_key(t[p]) for s, t in zip(scored, truth, strict=True)]
            for p in paths
        ]
        figures = Labeled(dict(zip(paths, map(statistics.fmean, right), strict=True)), {}, [])
        hits: dict[str, list[bool]] = {p: [] for p in paths}
        for draw in range(draws):
            pooled: dict[str, tuple[list[list[float]], list[int]]] = {p: ([], []) for p in paths}
            for block in range(len(rows) // BLOCK):
                test = range(block * BLOCK, (block + 1) * BLOCK)
                pool = [i for i in range(len(rows)) if i not in test]
                picked = sorted(random.Random(draw * 7 + block).sample(pool, count))
                answers = fitted_answers(engine, plan, scored, truth, picked, test, "auto")
                for i, answer in zip(test, answers, strict=True):
                    for p in paths:
                        pooled[p][0].append(list(answer[p].probabilities.values()))
                        pooled[p][1].append(values[p].index(json_key(truth[i][p])))
                        hits[p].append(json_key(answer[p].value) == json_key(truth[i][p]))
            figures.per_draw.append(
                (
                    statistics.fmean(metrics.accuracy(*pooled[p]) for p in paths),
                    statistics.fmean(metrics.ece(*pooled[p]) for p in paths),
                )
            )
        figures.after_labels.update({p: statistics.fmean(h) for p, h in hits.items()})
        out[label] = figures
    return out


def print_labeled(engine: PCDEngine, count: int, draws: int, fields: bool) -> None:
    print(f"| set | rendering | uncalibrated | after {count} labels (sd over {draws} draws) | ECE, labeled |")
    print("|---|---|---|---|---|")
    for name in ("bitext_customer_support", "banking77"):
        per_rendering = labeled(engine, name, count, draws)
        for label, figures in per_rendering.items():
            accuracy = [a for a, _ in figures.per_draw]
            print(
                f"| {name} | {label} | {statistics.fmean(figures.uncalibrated.values()):.3f} "
                f"| {statistics.fmean(accuracy):.3f} ({statistics.pstdev(accuracy):.3f}) "
                f"| {statistics.fmean(e for _, e in figures.per_draw):.3f} |",
                flush=True,
            )
        turns, flattened = per_rendering["turns (now)"], per_rendering["flattened (before)"]
        differences = [t[0] - f[0] for t, f in zip(turns.per_draw, flattened.per_draw, strict=True)]
        spread = statistics.stdev(differences) if len(differences) > 1 else 0.0
        mean = statistics.fmean(differences)
        print(f"{name}: turns - flattened = {mean:+.4f} (sd {spread:.4f})", flush=True)
        if fields:
            for path in turns.uncalibrated:
                print(
                    f"  {path}: uncalibrated "
                    + ", ".join(
                        f"{k.split()[0]} {f.uncalibrated[path]:.3f}" for k, f in per_rendering.items()
                    )
                    + f"; after {count} labels "
                    + ", ".join(
                        f"{k.split()[0]} {f.after_labels[path]:.3f}" for k, f in per_rendering.items()
                    ),
                    flush=True,
                )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--limit", type=int, default=150, help="rows per development set")
    parser.add_argument("--labels", type=int, default=0, help="compare after this many labels (0: none)")
    parser.add_argument("--draws", type=int, default=10, help="label draws with --labels")
    parser.add_argument("--fields", action="store_true", help="with --labels: each field's accuracy")
    args = parser.parse_args()
    engine = load_smollm2()
    if args.labels:
        print_labeled(engine, args.labels, args.draws, args.fields)
        return
    print("| set | rendering | field accuracy | seconds |")
    print("|---|---|---|---|")
    for name in ("bitext_customer_support", "banking77"):
        for label, acc, seconds in measure(engine, name, args.limit):
            print(f"| {name} | {label} | {acc:.3f} | {seconds:.0f} |", flush=True)


if __name__ == "__main__":
    main()
