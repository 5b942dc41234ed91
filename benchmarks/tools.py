"""Tool routing: the engine's scored tool decision against llama.cpp function calling and transformers +
xgrammar, on the same GGUF file (SmolLM2-135M-Instruct, CPU, fp32), in one run.

Tool sets built from the development data (../shared/data):
  - bitext: its 11 categories as 11 tools with descriptions, each with one closed argument `intent`
    (the category's intents); routing = the category, and the intent is reported too;
  - banking77: its 77 intents as 77 tools without arguments.
Systems, on the same texts, each warmed up on one text first (per-text latency of a warm call):
  - ours: `engine.tools.call(..., tool_choice="required")`: the decision and every tool's closed
    arguments in one packed pass; and the same under "auto" (a text answer allowed, counted a miss);
  - ours after `--labels N`: a calibration (`engine.tools.calibrate`, method auto) fitted on N labeled
    rows that are never scored;
  - llama.cpp (`--llamacpp`, the [bench] extra), on the same GGUF file:
    - function calling, `create_chat_completion(tools=..., tool_choice="auto")` with llama-cpp-python's
      `chatml-function-calling` format (SmolLM2's template is ChatML; the format has no "required");
    - grammar JSON of one call (`{"tool": ..., "arguments": {...}}`, any tool's schema as a GBNF
      grammar) after our decision prompt: the "required" counterpart;
  - transformers + xgrammar: greedy AR of the same call JSON under the same schema, after our prompt.
Prints routing accuracy, argument accuracy (bitext), median warm latency and the median of per-text
latency ratios (baseline / ours).

    python benchmarks/tools.py --limit 100 --labels 50 --llamacpp
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.data import load_set
from minicpm_pcd_adapters import load_smollm2
from pcd_engine import DEFAULT_RULE, PCDEngine

BITEXT = "bitext_customer_support"
CATEGORIES = {  # bitext's categories as tools: what each one does
    "account": "Manage the customer's account: create, delete, edit or switch it, recover a password.",
    "cancellation_fee": "Tell the customer the fee for cancelling an order.",
    "contact": "Put the customer in touch with customer service or a human agent.",
    "delivery": "Tell the customer the delivery options and how long delivery takes.",
    "feedback": "Record a complaint or a review from the customer.",
    "invoice": "Find or send the customer's invoices.",
    "newsletter": "Subscribe the customer to the newsletter or unsubscribe them.",
    "order": "Place, change, cancel or track an order.",
    "payment": "List the payment methods or solve a payment problem.",
    "refund": "Explain the refund policy, start a refund or track one.",
    "shipping_address": "Set up or change the shipping address.",
}


def tool_set(
    name: str, rows: list[dict[str, Any]]
) -> tuple[list[dict[str, Any]], Callable[[dict[str, Any]], Any]]:
    """(OpenAI tools entries, row -> its label as `engine.tools.calibrate` reads it)."""
    if name == BITEXT:
        intents: dict[str, set[str]] = {c: set() for c in CATEGORIES}
        for row in rows:
            intents[row["labels"]["category"]].add(row["labels"]["intent"])
        tools = [
            _tool(category, text, {"intent": {"type": "string", "enum": sorted(intents[category])}})
            for category, text in CATEGORIES.items()
        ]
        return tools, lambda row: {
            "tool": row["labels"]["category"],
            "arguments": {"intent": row["labels"]["intent"]},
        }
    values = sorted({_name(row["labels"]["intent"]) for row in rows})
    tools = [_tool(v, "The customer asks about: " + v.replace("_", " ") + ".", {}) for v in values]
    return tools, lambda row: _name(row["labels"]["intent"])


def _name(intent: str) -> str:
    """A tool name for an intent (one banking77 label is spelled `reverted_card_payment?`)."""
    return intent.rstrip("?")


def gold_tool(label: Any) -> str:
    return label["tool"] if isinstance(label, dict) else label


def _tool(name: str, description: str, properties: dict[str, Any]) -> dict[str, Any]:
    parameters = {"type": "object", "properties": properties, "required": list(properties)}
    return {
        "type": "function",
        "function": {"name": name, "description": description, "parameters": parameters},
    }


class Routed:
    def __init__(self, seconds: float, tool: str | None, arguments: dict[str, Any] | None) -> None:
        self.seconds, self.tool, self.arguments = seconds, tool, arguments


def run_ours(
    engine: PCDEngine,
    tools: list[dict[str, Any]],
    calibration: Any = None,
    choice: str = "required",
    rule: str = DEFAULT_RULE,
) -> Callable[[str], Routed]:
    def call(text: str) -> Routed:
        started = time.perf_counter()
        result = engine.tools.call(
            [{"role": "user", "content": text}],
            tools,
            tool_choice=choice,
            calibration=calibration,
            rule=rule,
        )
        return Routed(time.perf_counter() - started, result.tool, result.arguments)

    return call


def call_schema(tools: list[dict[str, Any]]) -> dict[str, Any]:
    """The JSON schema of one call: `{"tool": name, "arguments": {...}}` for any of the tools."""
    return {
        "anyOf": [
            {
                "type": "object",
                "properties": {
                    "tool": {"const": t["function"]["name"]},
                    "arguments": t["function"]["parameters"],
                },
                "required": ["tool", "arguments"],
            }
            for t in tools
        ]
    }


def decision_messages(engine: PCDEngine, tools: list[dict[str, Any]], text: str) -> list[dict[str, str]]:
    """Our decision prompt as messages (the system text lists the tools), for the AR baselines."""
    plan = engine.tools.plan(tools, "required")
    system = engine.plan(plan.schema, instructions=plan.instructions).system
    return [{"role": "system", "content": system}, {"role": "user", "content": text}]


def parsed(seconds: float, raw: str) -> Routed:
    try:
        data = json.loads(raw)
        return Routed(seconds, data.get("tool"), data.get("arguments"))
    except (json.JSONDecodeError, AttributeError):
        return Routed(seconds, None, None)


def run_xgrammar(engine: PCDEngine, tools: list[dict[str, Any]], max_new: int) -> Callable[[str], Routed]:
    """Greedy AR JSON of one call under the grammar of every tool's arguments, after our prompt."""
    import xgrammar as xgr

    schema = call_schema(tools)
    info = xgr.TokenizerInfo.from_huggingface(engine.tokenizer, vocab_size=engine.model.config.vocab_size)
    grammar = xgr.GrammarCompiler(info).compile_json_schema(
        json.dumps(schema), any_whitespace=False, separators=(", ", ": ")
    )
    eos = [engine.tokenizer.convert_tokens_to_ids("<|im_end|>"), engine.tokenizer.eos_token_id]

    def call(text: str) -> Routed:
        pairs = [(m["role"], m["content"]) for m in decision_messages(engine, tools, text)]
        ids = torch.tensor([engine.prompt.render_messages(pairs)])
        started = time.perf_counter()
        with torch.inference_mode():
            out = engine.model.generate(
                ids,
                attention_mask=torch.ones_like(ids),
                max_new_tokens=max_new,
                do_sample=False,
                eos_token_id=eos,
                pad_token_id=eos[0],
                logits_processor=[xgr.contrib.hf.LogitsProcessor(grammar)],
            )
        seconds = time.perf_counter() - started
        return parsed(seconds, engine.tokenizer.decode(out[0, ids.shape[1] :], skip_special_tokens=True))

    return call


def run_llamacpp(tools: list[dict[str, Any]], threads: int | None, max_new: int) -> Callable[[str], Routed]:
    """llama-cpp-python's function calling on the same GGUF file (`chatml-function-calling`): the
    model first picks `functions.<name>:` or `message:` under a grammar, then writes the arguments
    under the tool's grammar. This format has "auto" and a named tool, no "required"."""
    from llama_cpp import Llama

    from minicpm_pcd_adapters.smollm2 import smollm2_gguf_path

    llama = Llama(
        model_path=str(smollm2_gguf_path()),
        n_ctx=4096,
        n_threads=threads or os.cpu_count(),
        chat_format="chatml-function-calling",
        verbose=False,
    )

    def call(text: str) -> Routed:
        started = time.perf_counter()
        answer = llama.create_chat_completion(
            messages=[{"role": "user", "content": text}],
            tools=tools,
            tool_choice="auto",
            temperature=0.0,
            max_tokens=max_new,
        )
        seconds = time.perf_counter() - started
        calls = answer["choices"][0]["message"].get("tool_calls") or []
        if not calls:
            return Routed(seconds, None, None)
        function = calls[0]["function"]
        try:
            arguments = json.loads(function.get("arguments") or "{}")
        except json.JSONDecodeError:
            arguments = None
        return Routed(seconds, function["name"], arguments)

    return call


def run_llamacpp_json(
    engine: PCDEngine, tools: list[dict[str, Any]], threads: int | None, max_new: int
) -> Callable[[str], Routed]:
    """llama.cpp grammar JSON of one call (the JSON schema of any tool's call as a GBNF grammar) after
    our decision prompt, on the same GGUF file: the "required" counterpart of function calling."""
    from benchmarks.llamacpp import load_llama

    llama = load_llama(threads)
    response_format = {"type": "json_object", "schema": call_schema(tools)}

    def call(text: str) -> Routed:
        started = time.perf_counter()
        answer = llama.create_chat_completion(
            messages=decision_messages(engine, tools, text),
            response_format=response_format,
            temperature=0.0,
            max_tokens=max_new,
        )
        return parsed(time.perf_counter() - started, answer["choices"][0]["message"]["content"] or "")

    return call


def measure(
    label: str, call: Callable[[str], Routed], rows: list[dict[str, Any]], set_name: str
) -> dict[str, Any]:
    call(rows[0]["text"])  # warm: the schema's head, priors, grammar, KV
    outcomes = [call(row["text"]) for row in rows]
    gold = [row["labels"]["category" if set_name == BITEXT else "intent"] for row in rows]
    routed = [o.tool == _name(g) for o, g in zip(outcomes, gold, strict=True)]
    out: dict[str, Any] = {
        "n": len(rows),
        "seconds": [o.seconds for o in outcomes],
        "median_ms": statistics.median(o.seconds for o in outcomes) * 1e3,
        "routing": sum(routed) / len(rows),
    }
    if set_name == BITEXT:
        out["intent"] = statistics.mean(
            (o.arguments or {}).get("intent") == row["labels"]["intent"]
            for o, row in zip(outcomes, rows, strict=True)
        )
    print(
        f"[{set_name}] {label}: {out['median_ms']:.0f} ms, routing {out['routing']:.3f}",
        file=sys.stderr,
        flush=True,
    )
    return {label: out}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--limit", type=int, default=100, help="texts scored per set (the first rows)")
    parser.add_argument(
        "--labels", type=int, default=50, help="labeled rows for the calibration (the last rows)"
    )
    parser.add_argument("--sets", nargs="*", default=["bitext_customer_support", "banking77"])
    parser.add_argument("--rules", nargs="*", default=[DEFAULT_RULE], help="our scoring rules to measure")
    parser.add_argument("--llamacpp", action="store_true", help="add llama.cpp function calling ([bench])")
    parser.add_argument("--no-xgrammar", action="store_true")
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--json", type=Path, default=None, help="also write all figures here")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    engine = load_smollm2()
    report = {}
    for set_name in args.sets:
        _, rows = load_set(set_name)
        scored, labeled = rows[: args.limit], rows[len(rows) - args.labels :] if args.labels else []
        if set(map(id, scored)) & set(map(id, labeled)):
            raise SystemExit("--limit and --labels overlap: the labeled rows must never be scored")
        tools, label_of = tool_set(set_name, rows)
        results: dict[str, Any] = {}
        for rule in args.rules:
            tag = f"pcd {rule}"
            results |= measure(f"{tag}, required", run_ours(engine, tools, rule=rule), scored, set_name)
            if labeled:
                started = time.perf_counter()
                calibration = engine.tools.calibrate(
                    tools,
                    [r["text"] for r in labeled],
                    [label_of(r) for r in labeled],
                    tool_choice="required",
                    rule=rule,
                )
                seconds = time.perf_counter() - started
                print(f"[{set_name}] {tag}: calibrated on {len(labeled)} in {seconds:.0f} s", file=sys.stderr)
                ours = run_ours(engine, tools, calibration, rule=rule)
                results |= measure(f"{tag} + {len(labeled)} labels, required", ours, scored, set_name)
            results |= measure(
                f"{tag}, auto", run_ours(engine, tools, choice="auto", rule=rule), scored, set_name
            )
        max_new = 48 if set_name == "bitext_customer_support" else 32
        if args.llamacpp:
            results |= measure(
                "llama.cpp function calling, auto",
                run_llamacpp(tools, args.threads, max_new),
                scored,
                set_name,
            )
            results |= measure(
                "llama.cpp grammar JSON, required",
                run_llamacpp_json(engine, tools, args.threads, max_new),
                scored,
                set_name,
            )
        if not args.no_xgrammar:
            results |= measure(
                "transformers + xgrammar, required", run_xgrammar(engine, tools, max_new), scored, set_name
            )
        report[set_name] = results
        print_table(set_name, len(tools), results)
    if args.json:
        args.json.write_text(json.dumps(report, indent=1))


def print_table(set_name: str, count: int, results: dict[str, Any]) -> None:
    print(f"\n## {set_name}: {count} tools (SmolLM2-135M-Instruct, CPU, fp32)")
    first = next(iter(results))
    print(f"| system, tool_choice | texts | routing acc | intent acc | median warm ms | ratio vs {first} |")
    print("|---|---:|---:|---:|---:|---:|")
    ours = results[first]["seconds"]
    for label, r in results.items():
        ratio = statistics.median(b / a for a, b in zip(ours, r["seconds"], strict=True))
        intent = f"{r['intent']:.3f}" if "intent" in r else "-"
        print(f"| {label} | {r['n']} | {r['routing']:.3f} | {intent} | {r['median_ms']:.0f} | {ratio:.2f}x |")


if __name__ == "__main__":
    main()
