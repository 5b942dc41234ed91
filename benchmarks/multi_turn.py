"""Multi-turn structured calls: field accuracy when the text to classify is the last turn of a longer
conversation, under the two renderings a door has had (SmolLM2-135M, CPU, the default rule).

Each row of a development set becomes: a system message, a user greeting, the assistant's reply, then
the row's text as the user's last turn. Renderings:
  - turns (now, every door): the conversation as the chat template's turns (`engine.classify` on a
    `Conversation`);
  - flattened (before: the LangChain, LlamaIndex and server structured paths): the turns as one user
    text of "Role: content" paragraphs, the system message as the instructions.
The single-turn accuracy (the row's text alone) is printed beside them as the reference.

    python benchmarks/multi_turn.py --limit 150
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.data import load_set
from minicpm_pcd_adapters import load_smollm2
from pcd_engine import Conversation, PCDEngine, PCDError

SYSTEM = "You are a customer-support assistant. Classify the customer's last message."
OPENING = [("user", "Hello, I need some help."), ("assistant", "Of course. What can I do for you?")]


def accuracy(results: list[Any], rows: list[dict[str, Any]]) -> float:
    right = total = 0
    for result, row in zip(results, rows, strict=True):
        for name, label in row["labels"].items():
            total += 1
            right += not isinstance(result, PCDError) and getattr(result.value, name) == label
    return right / total


def measure(engine: PCDEngine, name: str, limit: int) -> list[tuple[str, float, float]]:
    model, rows = load_set(name, limit)
    conversations = [Conversation.of([("system", SYSTEM), *OPENING, ("user", row["text"])]) for row in rows]
    runs = {
        "single turn (reference)": lambda: engine.classify_batch(
            [r["text"] for r in rows], model, instructions=SYSTEM, return_exceptions=True
        ),
        "turns (now)": lambda: engine.classify_batch(conversations, model, return_exceptions=True),
        "flattened (before)": lambda: engine.classify_batch(
            [Conversation(c.turns).text for c in conversations],
            model,
            instructions=SYSTEM,
            return_exceptions=True,
        ),
    }
    out = []
    for label, run in runs.items():
        started = time.perf_counter()
        results = run()
        out.append((label, accuracy(results, rows), time.perf_counter() - started))
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--limit", type=int, default=150, help="rows per development set")
    args = parser.parse_args()
    engine = load_smollm2()
    print("| set | rendering | field accuracy | seconds |")
    print("|---|---|---|---|")
    for name in ("bitext_customer_support", "banking77"):
        for label, acc, seconds in measure(engine, name, args.limit):
            print(f"| {name} | {label} | {acc:.3f} | {seconds:.0f} |", flush=True)


if __name__ == "__main__":
    main()
