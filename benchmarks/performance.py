"""Issue-6 benchmark (CPU): per-call latency cold and warm against AR JSON and the floor, batched
throughput, memory of a 32-field x 8-option request, and bf16 decisions against FP32; where a warm
request's time goes (text tokens, branch tokens, LM-head rows, the rest in Python).

One process, SmolLM2-135M-Instruct (FP32 unless said), the same prompt token ids for every system.
Ratios are computed text by text and their median is printed. With `--llamacpp` (the `[bench]`
extra), llama.cpp's grammar-constrained JSON on the same GGUF file joins the latency table.

    python benchmarks/performance.py --limit 12 --batch-texts 64 --llamacpp
    python benchmarks/performance.py --skip throughput memory precision latency --limit 16  # breakdown
"""

from __future__ import annotations

import argparse
import copy
import json
import random
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Literal

import torch
from pydantic import BaseModel, create_model

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.accuracy_latency import (
    Outcome,
    evaluate,
    print_ratios,
    prompt_ids,
    run_ar,
    run_floor,
    xgrammar_grammar,
)
from benchmarks.data import load_set
from minicpm_pcd_adapters import load_smollm2
from pcd_engine import Limits, PCDEngine

AR_TOKENS = {"bitext_customer_support": 128, "banking77": 40}
WORDS = ["red", "green", "blue", "black", "white", "orange", "purple", "brown"]


def run_engine(engine: PCDEngine, schema: type[BaseModel], rule: str | None = None):
    def call(text: str) -> Outcome:
        t = time.perf_counter()
        result = engine.classify(text, schema, rule=rule)
        return Outcome(time.perf_counter() - t, result.value.model_dump(), result.diagnostics.forward_calls)

    return call


def configurations(
    base: PCDEngine, bf16: bool, plain: PCDEngine | None = None
) -> dict[str, tuple[PCDEngine, str | None]]:
    """Ours, as (engine, rule): the default, the default before issue 35 (option-cc on whole trees), the
    cut greedy rule, the default on `plain`'s `nn.Linear` weights and on a bf16 copy (`bf16`)."""
    dtype = str(base.runner.dtype).removeprefix("torch.")
    whole = PCDEngine(base.model, base.tokenizer, shortlist=False)
    out: dict[str, tuple[PCDEngine, str | None]] = {
        f"ours warm (default: {base.rule.name}, {dtype})": (base, None),
        "ours warm (option-cc, whole trees, fp32: before)": (whole, "option-cc"),
        "ours warm (greedy-cc)": (base, "greedy-cc"),
    }
    if plain is not None:
        out["ours warm (default, pack_weights=False: nn.Linear, KV heads repeated)"] = (plain, None)
    if bf16 and base.runner.dtype != torch.bfloat16:
        fast = PCDEngine(copy.deepcopy(base.model).to(torch.bfloat16), base.tokenizer, rule=base.rule)
        out[f"ours warm (default: {base.rule.name}, bfloat16)"] = (fast, None)
    return out


def latency(base: PCDEngine, plain: PCDEngine, name: str, args: Any, llama: Any = None) -> dict[str, Any]:
    """Ours and the baselines; the AR JSON ones on `plain` (`nn.Linear` weights, as transformers runs)."""
    schema, rows = load_set(name, args.limit)
    ours = configurations(base, args.bf16, plain)
    cold = PCDEngine(base.model, base.tokenizer, prefix_cache=False)
    for engine, rule in [*ours.values(), (cold, None)]:  # the plan and its prior outside the timing
        engine.classify("warm-up", schema, rule=rule)
    systems = {label: run_engine(engine, schema, rule) for label, (engine, rule) in ours.items()}
    systems |= {
        "ours cold (default, no prefix cache)": run_engine(cold, schema),
        "floor (bare forward, same prompt)": run_floor(base, schema),
    }
    if llama is not None:
        from benchmarks.llamacpp import SYSTEM, run_llamacpp, same_prompt, warm

        assert all(same_prompt(base, schema, row["text"]) for row in rows), "llama.cpp's messages differ"
        warm(llama, base, schema)
        systems[SYSTEM] = run_llamacpp(llama, base, schema, AR_TOKENS[name])
    systems |= {
        "AR JSON xgrammar": run_ar(plain, schema, AR_TOKENS[name], xgrammar_grammar(plain, schema)),
        "AR JSON greedy": run_ar(plain, schema, AR_TOKENS[name]),
    }
    out = {}
    for label, call in systems.items():
        subset = rows[: args.greedy_limit] if label == "AR JSON greedy" else rows
        out[label] = evaluate([call(row["text"]) for row in subset], subset)
        print(f"[{name}] {label}: median {out[label]['median_ms']:.0f} ms", file=sys.stderr, flush=True)
    return out


def print_latency(name: str, results: dict[str, Any]) -> None:
    print(f"\n## {name}: per-call latency (SmolLM2-135M, CPU, fp32)")
    print("| system | texts | median ms | field acc | valid | forward calls/req |")
    print("|---|---:|---:|---:|---:|---:|")
    for label, r in results.items():
        cells = [
            r["n"],
            f"{r['median_ms']:.0f}",
            f"{r['field_acc']:.3f}",
            f"{r['valid']:.2f}",
            f"{r['calls']:.1f}",
        ]
        print(f"| {label} | " + " | ".join(map(str, cells)) + " |")
    print_ratios(results, [k for k in results if k.startswith("ours")])


def breakdown(engine: PCDEngine, name: str, limit: int, rules: list[str]) -> dict[str, Any]:
    """Where a warm request's time goes, per rule (medians over the texts, ms): the decoder over the
    text alone (on the cached head), over the text and the branches (the difference: branch
    tokens), the LM-head projection of the scored rows, and the rest of `classify` (Python: render,
    rules, results)."""
    from pcd_engine import packing
    from pcd_engine.cache import frozen_view
    from pcd_engine.runner import PassStats

    schema, rows = load_set(name, limit)
    engine = PCDEngine(engine.model, engine.tokenizer, shortlist=False)  # one pass per request, measured
    decoder = engine.model.get_decoder()
    out: dict[str, Any] = {}
    for rule in rules:
        plan = engine.plan(schema, rule=rule)
        engine.classify("warm-up", schema, rule=rule)
        parts: dict[str, list[float]] = {"total": [], "text": [], "text+branches": [], "lm_head": []}
        counts = {"text": [], "branch": plan.branch_tokens, "rows": sum(len(t.scored) for t in plan.trees)}
        for row in rows:
            ids = engine.prompt.with_head(plan.head, row["text"]).ids
            kv, past = engine.scorer.head_kv(ids, len(plan.head), PassStats())
            feed = ids[past:]
            counts["text"].append(len(feed))
            started = time.perf_counter()
            engine.classify(row["text"], schema, rule=rule)
            parts["total"].append(time.perf_counter() - started)
            with torch.inference_mode():
                positions = torch.arange(past, len(ids)).unsqueeze(0)
                started = time.perf_counter()
                decoder(
                    input_ids=torch.tensor([feed]), position_ids=positions, past_key_values=frozen_view(kv)
                )
                parts["text"].append(time.perf_counter() - started)
                packed = packing.pack_inputs(feed, past, list(plan.trees))
                inputs = {
                    "input_ids": packed.ids,
                    "attention_mask": packing.additive_mask(packed.allowed, engine.runner.dtype),
                    "position_ids": packed.positions,
                    "past_key_values": frozen_view(kv),
                }
                started = time.perf_counter()
                hidden = decoder(**inputs).last_hidden_state
                parts["text+branches"].append(time.perf_counter() - started)
                started = time.perf_counter()
                keep = [packed.at(t, i) for t, tree in enumerate(plan.trees) for i in tree.scored]
                engine.runner.projection.project(hidden[:, keep], plan.trees, plan.normalized)
                parts["lm_head"].append(time.perf_counter() - started)
        median = {k: 1000 * statistics.median(v) for k, v in parts.items()}
        out[rule] = {
            "ms": {
                "total": median["total"],
                "text tokens": median["text"],
                "branch tokens": median["text+branches"] - median["text"],
                "LM-head rows": median["lm_head"],
                "Python and the rest": median["total"] - median["text+branches"] - median["lm_head"],
            },
            "tokens": {
                "text": statistics.median(counts["text"]),
                "branch": counts["branch"],
                "scored rows": counts["rows"],
                "full-vocabulary rows": sum(
                    len(t.scored) for t, n in zip(plan.trees, plan.normalized, strict=True) if n
                ),
            },
        }
        print(f"[breakdown] {name} {rule}: {out[rule]}", file=sys.stderr, flush=True)
    return out


def print_breakdown(name: str, results: dict[str, Any]) -> None:
    print(f"\n## {name}: where a warm request's time goes (median ms)")
    rules = list(results)
    print("| part | " + " | ".join(rules) + " |\n|---|" + "---:|" * len(rules))
    for part in next(iter(results.values()))["ms"]:
        print(f"| {part} | " + " | ".join(f"{results[r]['ms'][part]:.0f}" for r in rules) + " |")
    for part in next(iter(results.values()))["tokens"]:
        print(f"| {part} (count) | " + " | ".join(f"{results[r]['tokens'][part]:.0f}" for r in rules) + " |")


ADJECTIVES = (
    "red green blue black white orange purple brown silver golden small large quick slow early late inner "
)
ADJECTIVES += "outer upper lower"
NOUNS = (
    "card transfer payment account refund limit fee pin atm cash top_up exchange balance statement address"
)


def one_field(values: list[str]) -> type[BaseModel]:
    return create_model(f"Many{len(values)}", label=(Literal[tuple(values)], ...))  # type: ignore[misc]


SIZES = (2, 77, 150, 300)


def many_values(engine: PCDEngine, limit: int, bf16: bool) -> dict[str, Any]:
    """Warm latency of one field of 2, 77 (banking77's intents), 150 and 300 (synthetic
    `adjective_noun`) values, per configuration of ours; the cost per value is (t_N - t_2) / (N - 2)."""
    limits = Limits(max_candidates=512)  # 300 > 256
    banking, rows = load_set("banking77", limit)
    intents = list(banking.model_fields["intent"].annotation.__args__)  # type: ignore[union-attr]
    synthetic = [f"{a}_{n}" for a in ADJECTIVES.split() for n in NOUNS.split()]
    random.Random(0).shuffle(synthetic)
    fields = {2: one_field(["yes_it_is", "no_it_is_not"]), 77: one_field(intents)}
    fields |= {n: one_field(sorted(synthetic[:n])) for n in SIZES[2:]}
    out: dict[str, Any] = {}
    for name, (ours, rule) in configurations(engine, bf16).items():
        ours = PCDEngine(ours.model, ours.tokenizer, limits=limits, shortlist=ours.shortlist is not None)
        medians = {}
        for n, schema in fields.items():
            ours.classify("warm-up", schema, rule=rule)
            plan = ours.plan(schema, rule=rule)
            seconds, calls = [], []
            for row in rows:
                started = time.perf_counter()
                result = ours.classify(row["text"], schema, rule=rule)
                seconds.append(time.perf_counter() - started)
                calls.append(result.diagnostics.forward_calls)
            medians[n] = {
                "ms": 1000 * statistics.median(seconds),
                "branch_tokens": plan.branch_tokens,
                "rule": plan.scored_decisions[0].rule_name,
                "calls": statistics.fmean(calls),
            }
        per_value = {n: (medians[n]["ms"] - medians[2]["ms"]) / (n - 2) for n in medians if n > 2}
        out[name] = {"values": medians, "ms_per_value": per_value}
        print(f"[many values] {name}: {out[name]}", file=sys.stderr, flush=True)
    return out


def print_many(results: dict[str, Any]) -> None:
    print(
        "\n## one field of N values: warm median ms (first-pass branch tokens, forward calls), ms per value"
    )
    print(
        "| ours | "
        + " | ".join(f"N={n}" for n in SIZES)
        + " | "
        + " | ".join(f"ms/value ({n})" for n in SIZES[1:])
        + " |"
    )
    print("|---|" + "---:|" * (2 * len(SIZES) - 1))
    for label, r in results.items():
        cells = [
            f"{r['values'][n]['ms']:.0f} ({r['values'][n]['branch_tokens']}, {r['values'][n]['calls']:.0f})"
            for n in SIZES
        ]
        cells += [f"{r['ms_per_value'][n]:.2f}" for n in SIZES[1:]]
        print(f"| {label} | " + " | ".join(cells) + " |")


def throughput(engine: PCDEngine, count: int, sizes: list[int]) -> dict[int, float]:
    schema, rows = load_set("bitext_customer_support", count)
    texts = [row["text"] for row in rows]
    engine.classify("warm-up", schema)
    reference = None
    out: dict[int, float] = {}
    for size in sizes:
        t = time.perf_counter()
        if size == 1:
            results = [engine.classify(text, schema) for text in texts]
        else:
            results = [
                r for i in range(0, count, size) for r in engine.classify_batch(texts[i : i + size], schema)
            ]
        out[size] = count / (time.perf_counter() - t)
        values = [r.value for r in results]
        assert reference is None or values == reference, f"batch {size} changed a decision"
        reference = values
        print(f"[throughput] batch {size}: {out[size]:.2f} texts/s", file=sys.stderr, flush=True)
    return out


def wide_schema(fields: int = 32, options: int = 8) -> type[BaseModel]:
    spec: dict[str, Any] = {
        f"field_{i:02d}": (Literal[tuple(f"{w}_{i}" for w in WORDS[:options])], ...)  # type: ignore[misc]
        for i in range(fields)
    }
    return create_model("Wide32x8", **spec)


def memory_child(kind: str) -> None:
    """In a fresh process: load, note the resident size, run one request, print the peak growth."""
    engine = load_smollm2()
    schema = wide_schema()
    text = "The paint on the fence is red in some places and blue in others; which colours apply?"
    plan = engine.plan(schema)  # compiling a schema is not the request
    engine.plan(schema, rule="option")
    ids = prompt_ids(engine, schema, text)
    resident = _rss_kib()
    if kind == "ours":
        engine.classify(text, schema, rule="option")
    elif kind == "ours-cc":
        engine.classify(text, schema)  # also runs the three content-free passes of the prior
    else:
        with torch.inference_mode():
            engine.model(input_ids=torch.tensor([ids]), use_cache=True, logits_to_keep=1)
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    print(
        json.dumps({"added_mib": (peak - resident) / 1024, "prompt": len(ids), "branch": plan.branch_tokens})
    )


def _rss_kib() -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    raise RuntimeError("no VmRSS")


def memory() -> dict[str, Any]:
    out = {}
    for kind in ("prefill", "ours", "ours-cc"):
        done = subprocess.run(
            [sys.executable, __file__, "--memory-child", kind], capture_output=True, text=True, check=True
        )
        out[kind] = json.loads(done.stdout.strip().splitlines()[-1])
        print(f"[memory] {kind}: {out[kind]}", file=sys.stderr, flush=True)
    return out


def precision(base: PCDEngine, limit: int, margin: float) -> dict[str, Any]:
    """bf16 decisions against FP32 ones, without and with FP32 re-scoring below `margin`."""
    started = time.perf_counter()
    fast = copy.deepcopy(base.model).to(torch.bfloat16)
    mixed = PCDEngine(fast, base.tokenizer, reference_model=base.model, rescore_margin=margin)
    check_s = time.perf_counter() - started
    plain = PCDEngine(fast, base.tokenizer, self_check=False)
    out: dict[str, Any] = {"self_check": vars(mixed.precision_check), "self_check_s": check_s}
    for name in AR_TOKENS:
        schema, rows = load_set(name, limit)
        fields = same_plain = same_mixed = rescored = 0
        seconds = {"fp32": 0.0, "bf16": 0.0, "bf16+rescore": 0.0}
        for row in rows:
            results = {}
            for label, engine in (("fp32", base), ("bf16", plain), ("bf16+rescore", mixed)):
                t = time.perf_counter()
                results[label] = engine.classify(row["text"], schema)
                seconds[label] += time.perf_counter() - t
            for path, field in results["fp32"].fields.items():
                fields += 1
                same_plain += results["bf16"].fields[path].value == field.value
                same_mixed += results["bf16+rescore"].fields[path].value == field.value
            rescored += results["bf16+rescore"].diagnostics.rescored_fields
        out[name] = {
            "fields": fields,
            "bf16_agreement": same_plain / fields,
            "rescored_agreement": same_mixed / fields,
            "rescored_share": rescored / fields,
            "seconds": seconds,
        }
        print(f"[precision] {name}: {out[name]}", file=sys.stderr, flush=True)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--limit", type=int, default=12, help="texts per set for per-call latency")
    parser.add_argument("--greedy-limit", type=int, default=6, help="texts for plain greedy AR JSON")
    parser.add_argument("--batch-texts", type=int, default=64)
    parser.add_argument("--batch-sizes", type=int, nargs="*", default=[1, 4, 16, 64])
    parser.add_argument("--precision-limit", type=int, default=12)
    parser.add_argument("--margin", type=float, default=0.2)
    parser.add_argument(
        "--skip",
        nargs="*",
        default=[],
        choices=["latency", "breakdown", "many", "throughput", "memory", "precision"],
    )
    parser.add_argument("--llamacpp", action="store_true", help="add llama.cpp JSON (the [bench] extra)")
    parser.add_argument("--threads", type=int, default=None, help="torch and llama.cpp threads")
    parser.add_argument("--bf16", action="store_true", help="add the default on a bf16 copy of the weights")
    parser.add_argument("--json", type=Path, default=None)
    parser.add_argument("--memory-child", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.memory_child:
        memory_child(args.memory_child)
        return
    report: dict[str, Any] = {}
    if args.threads:
        torch.set_num_threads(args.threads)
    engine = load_smollm2()
    llama = None
    if args.llamacpp:
        from benchmarks.llamacpp import describe, load_llama

        llama = load_llama(args.threads)
        report["llamacpp"] = describe(llama)
    if "latency" not in args.skip:
        plain = load_smollm2(pack_weights=False)
        for name in AR_TOKENS:
            report[name] = latency(engine, plain, name, args, llama)
            print_latency(name, report[name])
    if "breakdown" not in args.skip:
        for name in AR_TOKENS:
            report[f"breakdown {name}"] = breakdown(
                engine, name, args.limit, ["option-cc", "option-unique-cc"]
            )
            print_breakdown(name, report[f"breakdown {name}"])
    if "many" not in args.skip:
        report["many values"] = many_values(engine, args.limit, args.bf16)
        print_many(report["many values"])
    if "throughput" not in args.skip:
        report["throughput"] = throughput(engine, args.batch_texts, args.batch_sizes)
        print(f"\n## classify_batch throughput, bitext, {args.batch_texts} texts")
        print("| batch | texts/s | vs batch 1 |\n|---:|---:|---:|")
        first = report["throughput"][args.batch_sizes[0]]
        for size, rate in report["throughput"].items():
            print(f"| {size} | {rate:.2f} | {rate / first:.2f}x |")
    if "memory" not in args.skip:
        report["memory"] = mem = memory()
        print("\n## memory added by one 32-field x 8-option request (MiB above the loaded model)")
        print(f"prompt {mem['prefill']['prompt']} tokens, branch tokens {mem['ours']['branch']}")
        for kind in ("prefill", "ours", "ours-cc"):
            added = mem[kind]["added_mib"]
            print(f"- {kind}: {added:.0f} MiB ({added / mem['prefill']['added_mib']:.2f}x the prefill)")
    if "precision" not in args.skip:
        report["precision"] = precision(engine, args.precision_limit, args.margin)
        print("\n## bf16 decisions vs FP32 (SmolLM2, CPU)")
        print(json.dumps(report["precision"], indent=1))
    if args.json:
        args.json.write_text(json.dumps(report, indent=1, default=str))


if __name__ == "__main__":
    main()
