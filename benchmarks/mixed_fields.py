"""Issue-3 benchmark: a mixed model (3 scored fields + 1 short free-text field) against xgrammar AR JSON.

One process, SmolLM2-135M-Instruct on CPU, FP32, bitext texts. Both sides get the same prompt (the
engine's system text lists all four fields) and the same model:
  - ours: `engine.classify(text, Mixed)`: one packed pass scores the closed fields, then constrained
    generation writes the summary after the scored values (prefix cache on, as shipped)
  - xgrammar AR JSON: `model.generate` of the whole object under the grammar of Mixed's JSON schema
Prints median per-call latency, the median of per-text ratios (AR / ours), accuracy on the closed
fields, valid-object rate and generated tokens per request.

    python benchmarks/mixed_fields.py --limit 50
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch
from pydantic import BaseModel, Field, create_model

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.accuracy_latency import run_ar, xgrammar_grammar
from benchmarks.data import load_set
from minicpm_pcd_adapters import load_smollm2
from pcd_engine import PCDEngine, PCDError

CLOSED = ("category", "intent", "is_question")


def mixed_model(full: type[BaseModel]) -> type[BaseModel]:
    """Three closed fields of the bitext schema plus a short free-text summary."""
    fields: dict[str, Any] = {
        name: (full.model_fields[name].annotation, full.model_fields[name]) for name in CLOSED
    }
    fields["summary"] = (str, Field(max_length=60, description="The request in a few words."))
    return create_model("SupportRequest", **fields)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--limit", type=int, default=50)
    parser.add_argument("--threads", type=int, default=None)
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    full, rows = load_set("bitext_customer_support", args.limit)
    schema = mixed_model(full)
    engine: PCDEngine = load_smollm2()
    ar = run_ar(engine, schema, max_new=96, grammar=xgrammar_grammar(engine, schema))
    engine.classify(rows[0]["text"], schema)  # compile and warm the schema (priors, prefix cache)
    ours_s, ar_s, ratios, ours_tokens, ar_tokens = [], [], [], [], []
    right = {"ours": 0, "ar": 0}
    valid = {"ours": 0, "ar": 0}
    for row in rows:
        t = time.perf_counter()
        try:
            result = engine.classify(row["text"], schema)
            ours_value: dict[str, Any] | None = result.value.model_dump()
            ours_tokens.append(result.diagnostics.generated_tokens)
        except PCDError:
            ours_value = None
        ours_s.append(time.perf_counter() - t)
        outcome = ar(row["text"])
        ar_s.append(outcome.seconds)
        ar_tokens.append(outcome.calls)
        ratios.append(outcome.seconds / ours_s[-1])
        for label, value in (("ours", ours_value), ("ar", outcome.value)):
            if value is not None:
                valid[label] += 1
                right[label] += sum(value[f] == row["labels"][f] for f in CLOSED)
    n = len(rows)
    print(f"bitext_customer_support, {n} texts, schema: {', '.join(CLOSED)} (scored) + summary (generated)")
    print(f"{'':24}{'median ms':>10}{'closed acc':>12}{'valid':>8}{'gen tokens':>12}")
    print(
        f"{'ours (pcd + gen)':24}{statistics.median(ours_s) * 1e3:>10.0f}"
        f"{right['ours'] / (3 * n):>12.3f}{valid['ours'] / n:>8.2f}{statistics.mean(ours_tokens):>12.1f}"
    )
    print(
        f"{'xgrammar AR JSON':24}{statistics.median(ar_s) * 1e3:>10.0f}"
        f"{right['ar'] / (3 * n):>12.3f}{valid['ar'] / n:>8.2f}{statistics.mean(ar_tokens):>12.1f}"
    )
    print(f"median per-text ratio (xgrammar AR / ours): {statistics.median(ratios):.2f}x")


if __name__ == "__main__":
    main()
