"""Linear layers packed for oneDNN (pcd_engine/packed_weights.py) against `nn.Linear`, in one run:
two engines on SmolLM2 (float32, CPU), `pack_weights=True` and `False`, timed text by
text in alternation (which goes first alternates too), warm.

Printed per workload: each side's median ms and the median of the per-text ratios (plain / packed):
  - `classify` of one text, on each development set;
  - `engine.tools.call` with bitext's 11 categories as tools (benchmarks/tools.py), "required";
  - `classify_batch` of `--batch` texts (ms per text);
  - `generate`, 32 tokens of plain chat (ms per token).
Then, over `--agree` rows of each set, how often the two engines answer every field alike and the
largest gap between their probabilities.

    python benchmarks/packed_weights.py --limit 48 --agree 300
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.data import load_set
from benchmarks.tools import BITEXT, tool_set
from minicpm_pcd_adapters import load_smollm2
from pcd_engine import PCDEngine

SETS = ["bitext_customer_support", "banking77"]


def alternated(
    plain: Callable[[Any], Any], packed: Callable[[Any], Any], items: list[Any]
) -> dict[str, float]:
    """Each item timed on both sides, the first side alternating; medians and the median ratio."""
    times: dict[str, list[float]] = {"plain": [], "packed": []}
    for i, item in enumerate(items):
        order = [("plain", plain), ("packed", packed)]
        for side, call in order if i % 2 == 0 else order[::-1]:
            started = time.perf_counter()
            call(item)
            times[side].append(time.perf_counter() - started)
    ratios = [a / b for a, b in zip(times["plain"], times["packed"], strict=True)]
    return {
        "plain_ms": statistics.median(times["plain"]) * 1e3,
        "packed_ms": statistics.median(times["packed"]) * 1e3,
        "ratio": statistics.median(ratios),
    }


def agreement(plain: PCDEngine, packed: PCDEngine, schema: Any, texts: list[str]) -> dict[str, float]:
    a, b = plain.classify_batch(texts, schema), packed.classify_batch(texts, schema)
    fields = same = 0
    gap = 0.0
    for x, y in zip(a, b, strict=True):
        for path, field in x.fields.items():
            fields += 1
            same += field.value == y.fields[path].value
            gap = max(
                gap, *(abs(p - y.fields[path].probabilities[v]) for v, p in field.probabilities.items())
            )
    return {"fields": fields, "same": same / fields, "largest_probability_gap": gap}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--limit", type=int, default=48, help="texts timed per workload")
    parser.add_argument("--batch", type=int, default=64, help="texts in the classify_batch workload")
    parser.add_argument("--agree", type=int, default=300, help="rows per set compared for agreement")
    parser.add_argument("--json", help="write the figures here")
    args = parser.parse_args()
    engines = {"plain": load_smollm2(pack_weights=False), "packed": load_smollm2(pack_weights=True)}
    plain, packed = engines["plain"], engines["packed"]
    out: dict[str, Any] = {}
    for name in SETS:
        schema, rows = load_set(name)
        texts = [row["text"] for row in rows]
        for engine in engines.values():
            engine.classify(texts[-1], schema)  # the head and the priors, outside the timing
        out[f"{name} classify"] = alternated(
            lambda t, s=schema: plain.classify(t, s),
            lambda t, s=schema: packed.classify(t, s),
            texts[: args.limit],
        )
        batches = [texts[i : i + args.batch] for i in (0, args.batch)]
        timed = alternated(
            lambda b, s=schema: plain.classify_batch(b, s),
            lambda b, s=schema: packed.classify_batch(b, s),
            batches,
        )
        out[f"{name} classify_batch, ms per text"] = {
            k: v / args.batch if k.endswith("_ms") else v for k, v in timed.items()
        }
        out[f"{name} agreement"] = agreement(plain, packed, schema, texts[: args.agree])
        print(name, {k: v for k, v in out.items() if k.startswith(name)}, file=sys.stderr, flush=True)
    _, rows = load_set(BITEXT)
    tools, _ = tool_set(BITEXT, rows)

    def call(engine: PCDEngine) -> Callable[[str], Any]:
        return lambda t: engine.tools.call([{"role": "user", "content": t}], tools, tool_choice="required")

    texts = [row["text"] for row in rows[: args.limit]]
    for engine in engines.values():
        call(engine)(texts[-1])
    out["bitext 11 tools, tools.call"] = alternated(call(plain), call(packed), texts)
    asked = [[{"role": "user", "content": t}] for t in texts[:8]]
    timed = alternated(
        lambda m: plain.generate(m, max_tokens=32), lambda m: packed.generate(m, max_tokens=32), asked
    )
    out["generate 32 tokens, ms per token"] = {
        k: v / 32 if k.endswith("_ms") else v for k, v in timed.items()
    }
    print("\n| workload | nn.Linear ms | packed ms | plain / packed (median per text) |")
    print("|---|---:|---:|---:|")
    for label, r in out.items():
        if "agreement" in label:
            continue
        print(f"| {label} | {r['plain_ms']:.1f} | {r['packed_ms']:.1f} | {r['ratio']:.2f}x |")
    for name in SETS:
        r = out[f"{name} agreement"]
        print(f"{name}: {r['same']:.4f} of {r['fields']} fields alike, largest probability gap "
              f"{r['largest_probability_gap']:.2e}")  # fmt: skip
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
