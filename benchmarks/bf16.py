"""Issue-44 benchmark: where bf16 loses decisions, and what keeps them (SmolLM2-135M-Instruct, CPU).

Every variant scores the same dev-set rows with the default engine (rule, shortlist, prefix cache);
only where numbers are rounded differs:
  fp32                the reference
  bf16                the weights in bfloat16, everything computed in it (what `--dtype bfloat16` does)
  bf16, fp32 columns  the decoder in bf16; the scored tokens' logits from the decoder's output in
                      float32 against float32 copies of only their LM-head rows (the normaliser of a
                      row, its log-sum-exp over the vocabulary, stays from the bf16 head)
  bf16, fp32 head     the decoder in bf16; the whole LM head in float32 (a float32 copy of its weight)
  bf16 products, fp32 residual   matrix products in bf16 (torch.autocast), the residual stream, norms
                      and rotary embeddings in float32, the scored columns in float32
  fp32, bf16-rounded weights     float32 compute on weights rounded to bf16 and back: what the
                      weights' rounding alone costs
Per set: field accuracy against the labels, the share of fields decided as fp32 decides them, the
largest probability difference from fp32, and the median time per text (one text a call).

    python benchmarks/bf16.py --limit 100
"""

from __future__ import annotations

import argparse
import copy
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.data import load_set
from minicpm_pcd_adapters import load_smollm2
from pcd_engine import PCDEngine
from pcd_engine.projection import LMHeadProjection

SETS = ("bitext_customer_support", "banking77")


class Float32Columns:
    """A projection whose scored columns are computed in float32 from the decoder's output and
    float32 copies of their LM-head rows; `whole_head`: the normaliser from a float32 head too."""

    def __init__(self, projection: LMHeadProjection, whole_head: bool) -> None:
        self.projection, self.whole_head = projection, whole_head
        weight = projection.model.get_output_embeddings().weight
        self.head32 = weight.detach().float() if whole_head else None
        self.weight = weight

    def own_rows(self, hidden: torch.Tensor, tree: Any) -> torch.Tensor:
        rows = torch.tensor(tree.vocab, device=hidden.device)
        return hidden.float() @ self.weight[rows].float().T

    def log_softmax_columns(self, parts: list[torch.Tensor], trees: list[Any]) -> list[torch.Tensor]:
        out = []
        for hidden, tree in zip(parts, trees, strict=True):
            flat = hidden.reshape(-1, hidden.shape[-1])
            if self.head32 is not None:
                normaliser = torch.logsumexp(flat.float() @ self.head32.T, dim=-1)
            else:
                normaliser = torch.logsumexp((flat.to(self.weight.dtype) @ self.weight.T).float(), dim=-1)
            columns = self.own_rows(flat, tree) - normaliser[:, None]
            out.append(columns.reshape(*hidden.shape[:-1], len(tree.vocab)))
        return out

    def install(self) -> None:
        self.projection._own_rows = self.own_rows  # type: ignore[method-assign]
        self.projection._log_softmax_columns = self.log_softmax_columns  # type: ignore[method-assign]


def variants(base: PCDEngine) -> dict[str, PCDEngine]:
    model16 = copy.deepcopy(base.model).to(torch.bfloat16)
    out = {"fp32": base}
    for name, columns in (("bf16", None), ("bf16, fp32 columns", False), ("bf16, fp32 head", True)):
        engine = PCDEngine(model16, base.tokenizer, rule=base.rule, self_check=False)
        if columns is not None:
            Float32Columns(engine.runner.projection, whole_head=columns).install()
        out[name] = engine
    mixed = copy.deepcopy(model16)
    mixed.get_input_embeddings().register_forward_hook(lambda module, args, output: output.float())
    for module in (mixed, mixed.get_decoder(), mixed.get_output_embeddings()):
        _autocast(module)  # products in bf16; adds, norms and rotary stay in the float32 stream
    engine = PCDEngine(mixed, base.tokenizer, rule=base.rule, self_check=False)
    engine.runner.projection.head_splits = True  # its probe runs the head outside autocast
    Float32Columns(engine.runner.projection, whole_head=False).install()
    out["bf16 products, fp32 residual"] = engine
    rounded = copy.deepcopy(base.model).to(torch.bfloat16).to(torch.float32)
    out["fp32, bf16-rounded weights"] = PCDEngine(rounded, base.tokenizer, rule=base.rule)
    return out


def _autocast(module: Any) -> None:
    inner = module.forward

    def forward(*args: Any, **kwargs: Any) -> Any:
        with torch.autocast("cpu", dtype=torch.bfloat16):
            return inner(*args, **kwargs)

    module.forward = forward


def measure(engine: PCDEngine, schema: Any, rows: list[dict[str, Any]]) -> tuple[list[Any], list[float]]:
    results, seconds = [], []
    engine.classify(rows[0]["text"], schema)  # warm: the plan and the prefix cache
    for row in rows:
        start = time.perf_counter()
        results.append(engine.classify(row["text"], schema))
        seconds.append(time.perf_counter() - start)
    return results, seconds


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--limit", type=int, default=100, help="rows per set (default 100)")
    parser.add_argument("--sets", nargs="*", default=list(SETS))
    parser.add_argument("--json", type=Path, help="write the figures here")
    args = parser.parse_args()
    torch.manual_seed(0)
    engines = variants(load_smollm2())
    report: dict[str, Any] = {}
    for name in args.sets:
        schema, rows = load_set(name, args.limit)
        answers = {label: measure(engine, schema, rows) for label, engine in engines.items()}
        reference = answers["fp32"][0]
        report[name] = {}
        for label, (results, seconds) in answers.items():
            right = same = total = 0
            worst = 0.0
            for row, result, want in zip(rows, results, reference, strict=True):
                for path, field in result.fields.items():
                    total += 1
                    right += field.value == row["labels"][path]
                    same += field.value == want.fields[path].value
                    for value, p in field.probabilities.items():
                        worst = max(worst, abs(p - want.fields[path].probabilities.get(value, 0.0)))
            report[name][label] = {
                "field_accuracy": round(right / total, 4),
                "same_as_fp32": round(same / total, 4),
                "max_prob_diff": round(worst, 4),
                "median_ms": round(1000 * statistics.median(seconds), 1),
            }
            print(name, label, report[name][label], flush=True)
    if args.json:
        args.json.write_text(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
