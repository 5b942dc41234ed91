"""Issue-2 benchmark: our rules against AR JSON baselines on the same model, prompt and texts.

One process, SmolLM2-135M-Instruct on CPU, FP32. For each data set:
  - ours, every rule (the engine as shipped: prefix cache on; the first call per schema is cold);
    rules that read the same trees come from one packed pass
  - with `--llamacpp` (the `[bench]` extra): llama.cpp grammar JSON on the same GGUF file and prompt
  - greedy AR JSON with `model.generate` (same prompt; parsed and validated afterwards)
  - xgrammar-constrained AR JSON (same prompt; grammar from the Pydantic JSON schema)
  - floor: one bare forward pass over the same prompt, no cache
Prints median per-call latency, the median of per-text latency ratios (baseline / ours), field
accuracy, exact-object accuracy, valid-object rate and forward calls per request.

    python benchmarks/accuracy_latency.py --limit 100 --llamacpp
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

import torch
from pydantic import BaseModel

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.data import load_set
from benchmarks.outcomes import Outcome, parse_object, prompt_ids
from minicpm_pcd_adapters import load_smollm2
from pcd_engine import PCDEngine

SETS = {"bitext_customer_support": 128, "banking77": 40}  # name -> AR max_new_tokens


def run_ours(
    engine: PCDEngine, schema: type[BaseModel], rules: list[str]
) -> Callable[[str], dict[str, Outcome]]:
    """All rules that share a layout come from one packed pass (the pass is timed once for all)."""

    def call(text: str) -> dict[str, Outcome]:
        t = time.perf_counter()
        results = engine.compare_rules(text, schema, rules)
        seconds = time.perf_counter() - t
        return {
            name: Outcome(seconds, r.value.model_dump(), r.diagnostics.forward_calls)
            for name, r in results.items()
        }

    return call


def run_floor(engine: PCDEngine, schema: type[BaseModel]) -> Callable[[str], Outcome]:
    def call(text: str) -> Outcome:
        ids = prompt_ids(engine, schema, text)
        t = time.perf_counter()
        engine.runner.prefill(ids)
        return Outcome(time.perf_counter() - t, None, 1)

    return call


def run_ar(
    engine: PCDEngine, schema: type[BaseModel], max_new: int, grammar: Any = None
) -> Callable[[str], Outcome]:
    model, tokenizer = engine.model, engine.tokenizer
    eos = [tokenizer.convert_tokens_to_ids("<|im_end|>"), tokenizer.eos_token_id]

    def call(text: str) -> Outcome:
        ids = torch.tensor([prompt_ids(engine, schema, text)], device=model.device)
        t = time.perf_counter()
        kwargs: dict[str, Any] = {}
        if grammar is not None:
            import xgrammar as xgr

            kwargs["logits_processor"] = [xgr.contrib.hf.LogitsProcessor(grammar)]
        with torch.inference_mode():
            out = model.generate(
                ids,
                attention_mask=torch.ones_like(ids),
                max_new_tokens=max_new,
                do_sample=False,
                eos_token_id=eos,
                pad_token_id=eos[0],
                **kwargs,
            )
        seconds = time.perf_counter() - t
        new = out[0, ids.shape[1] :]
        raw = tokenizer.decode(new, skip_special_tokens=True)
        return Outcome(seconds, parse_object(raw, schema), int(new.shape[0]))

    return call


def xgrammar_grammar(engine: PCDEngine, schema: type[BaseModel]) -> Any:
    import xgrammar as xgr

    info = xgr.TokenizerInfo.from_huggingface(engine.tokenizer, vocab_size=engine.model.config.vocab_size)
    compiler = xgr.GrammarCompiler(info)
    return compiler.compile_json_schema(
        json.dumps(schema.model_json_schema()), any_whitespace=False, separators=(", ", ": ")
    )


def evaluate(outcomes: list[Outcome], rows: list[dict[str, Any]]) -> dict[str, Any]:
    labels = [row["labels"] for row in rows]
    fields = list(labels[0])
    right = total = exact = valid = 0
    for o, gold in zip(outcomes, labels, strict=True):
        valid += o.value is not None
        hits = [o.value is not None and o.value.get(f) == gold[f] for f in fields]
        right += sum(hits)
        total += len(hits)
        exact += all(hits)
    return {
        "n": len(rows),
        "seconds": [o.seconds for o in outcomes],
        "median_ms": statistics.median(o.seconds for o in outcomes) * 1e3,
        "field_acc": right / total,
        "exact_acc": exact / len(rows),
        "valid": valid / len(rows),
        "calls": statistics.mean(o.calls for o in outcomes),
    }


def measure(label: str, call: Callable[[str], Any], rows: list[dict[str, Any]], name: str) -> dict[str, Any]:
    outcomes = [call(row["text"]) for row in rows]
    if isinstance(outcomes[0], dict):
        out = {f"pcd:{rule}": evaluate([o[rule] for o in outcomes], rows) for rule in outcomes[0]}
    else:
        out = {label: evaluate(outcomes, rows)}
    for key, r in out.items():
        print(
            f"[{name}] {key}: median {r['median_ms']:.0f} ms, field acc {r['field_acc']:.3f}",
            file=sys.stderr,
            flush=True,
        )
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--limit", type=int, default=100)
    parser.add_argument(
        "--ar-greedy-limit",
        type=int,
        default=None,
        help="texts for the plain greedy AR baseline (default: --limit)",
    )
    parser.add_argument("--sets", nargs="*", default=list(SETS))
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    parser.add_argument("--json", type=Path, default=None, help="also write all figures here")
    parser.add_argument("--ours-only", action="store_true", help="skip the floor and AR baselines")
    parser.add_argument("--no-code", action="store_true", help="skip the code rule (its own prompt)")
    parser.add_argument("--llamacpp", action="store_true", help="add llama.cpp JSON (the [bench] extra)")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    engine = load_smollm2()
    llama = None
    if args.llamacpp:
        from benchmarks.llamacpp import load_llama

        llama = load_llama(args.threads)
    report: dict[str, Any] = {}
    for name in args.sets:
        schema, rows = load_set(name, args.limit)
        greedy_rows = rows[: args.ar_greedy_limit or len(rows)]
        results: dict[str, Any] = {}
        for layout in (["option", "option-mean", "option-cc"], ["option-unique", "option-unique-cc"]):
            results |= measure("", run_ours(engine, schema, layout), rows, name)
        results |= measure("", run_ours(engine, schema, ["greedy", "greedy-cc"]), rows, name)
        if not args.no_code:
            results |= measure("", run_ours(engine, schema, ["code"]), rows, name)
        if args.ours_only:
            report[name] = results
            print_table(name, results)
            continue
        results |= measure("floor (bare prefill)", run_floor(engine, schema), rows, name)
        if llama is not None:
            from benchmarks.llamacpp import SYSTEM, run_llamacpp, same_prompt, warm

            assert all(same_prompt(engine, schema, r["text"]) for r in rows), "llama.cpp's messages differ"
            warm(llama, engine, schema)
            results |= measure(SYSTEM, run_llamacpp(llama, engine, schema, SETS[name]), rows, name)
        grammar = xgrammar_grammar(engine, schema)
        results |= measure("AR JSON xgrammar", run_ar(engine, schema, SETS[name], grammar), rows, name)
        results |= measure("AR JSON greedy", run_ar(engine, schema, SETS[name]), greedy_rows, name)
        report[name] = results
        print_table(name, results)
    if args.json:
        args.json.write_text(json.dumps(report, indent=1))


def print_table(name: str, results: dict[str, Any]) -> None:
    print(f"\n## {name} (SmolLM2-135M-Instruct, CPU, fp32)")
    print("| system | texts | median ms | field acc | exact | valid | forward calls/req |")
    print("|---|---:|---:|---:|---:|---:|---:|")
    for label, r in results.items():
        print(
            f"| {label} | {r['n']} | {r['median_ms']:.0f} | {r['field_acc']:.3f} | {r['exact_acc']:.3f} "
            f"| {r['valid']:.2f} | {r['calls']:.1f} |"
        )
    print_ratios(results, [k for k in results if k.startswith("pcd:")])


def print_ratios(results: dict[str, Any], ours: list[str]) -> None:
    """A table of median per-text latency ratios, every other system / each of ours."""
    baselines = [b for b in results if b not in ours]
    print("\nmedian per-text latency ratio, baseline / ours (>1: ours faster), on the texts both ran")
    print("| ours | " + " | ".join(baselines) + " |")
    print("|---|" + "---:|" * len(baselines))
    for label in ours:
        mine = results[label]["seconds"]
        cells = [
            statistics.median(b / a for a, b in zip(mine, results[base]["seconds"], strict=False))
            for base in baselines
        ]
        print(f"| {label} | " + " | ".join(f"{c:.2f}x" for c in cells) + " |")


if __name__ == "__main__":
    main()
