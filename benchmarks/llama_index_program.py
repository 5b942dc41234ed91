"""Issue-5 benchmark: MiniCPMPCDProgram against LlamaIndex's default route for a local model,
`LLMTextCompletionProgram` over llama-index-llms-huggingface's `HuggingFaceLLM` (free text, then
PydanticOutputParser, which adds the JSON schema to the prompt).

One process, SmolLM2-135M-Instruct on CPU, FP32, the same model object for both, bitext's 8-field
schema, the same prompt template. HuggingFaceLLM runs as a chat model (the tokenizer's chat
template), greedy, at most 128 new tokens, stopping at `<|im_end|>`.

    python benchmarks/llama_index_program.py --limit 64
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.data import load_set
from benchmarks.langchain_batch import score
from minicpm_pcd_adapters import MiniCPMLLM, MiniCPMPCDProgram, load_smollm2

TEMPLATE = "Classify this customer-support message:\n{text}"


def baseline_program(engine: Any, schema: Any) -> Any:
    from llama_index.core.program import LLMTextCompletionProgram
    from llama_index.llms.huggingface import HuggingFaceLLM

    llm = HuggingFaceLLM(
        model=engine.model,
        tokenizer=engine.tokenizer,
        max_new_tokens=128,
        is_chat_model=True,
        stopping_ids=[engine.tokenizer.convert_tokens_to_ids("<|im_end|>")],
        generate_kwargs={"do_sample": False},
    )
    return LLMTextCompletionProgram.from_defaults(output_cls=schema, prompt_template_str=TEMPLATE, llm=llm)


def timed(program: Any, text: str) -> tuple[float, Any]:
    started = time.perf_counter()
    try:
        out = program(text=text)
    except Exception as error:  # the baseline's parse errors count as invalid objects
        out = error
    return time.perf_counter() - started, out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--limit", type=int, default=64)
    parser.add_argument("--threads", type=int, default=None)
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    schema, rows = load_set("bitext_customer_support", args.limit)
    engine = load_smollm2()
    ours = MiniCPMPCDProgram.from_defaults(
        schema, prompt_template_str=TEMPLATE, llm=MiniCPMLLM(engine=engine, model="SmolLM2-135M-Instruct")
    )
    base = baseline_program(engine, schema)
    ours(text=rows[0]["text"])  # compile and warm the schema, as any service would
    ours_s, base_s, ratios, ours_out, base_out = [], [], [], [], []
    for row in rows:
        seconds, out = timed(ours, row["text"])
        ours_s.append(seconds)
        ours_out.append(out)
        seconds, out = timed(base, row["text"])
        base_s.append(seconds)
        base_out.append(out)
        ratios.append(base_s[-1] / ours_s[-1])
    acc, valid = score(ours_out, rows, schema)
    base_acc, base_valid = score(base_out, rows, schema)
    print(f"bitext_customer_support, {len(rows)} texts, SmolLM2-135M CPU FP32")
    print(f"{'route':52}{'median ms':>10}{'field acc':>11}{'valid':>8}")
    print(f"{'ours: MiniCPMPCDProgram':52}{statistics.median(ours_s) * 1e3:>10.0f}{acc:>11.3f}{valid:>8.2f}")
    label = "LLMTextCompletionProgram(HuggingFaceLLM)"
    print(f"{label:52}{statistics.median(base_s) * 1e3:>10.0f}{base_acc:>11.3f}{base_valid:>8.2f}")
    print(f"median per-text latency ratio (baseline / ours): {statistics.median(ratios):.2f}x")
    print(f"baseline sample output: {base_out[0]!r:.300}")


if __name__ == "__main__":
    main()
