"""Issue-4 benchmark: `chain.batch` of ChatMiniCPM structured output against a loop of `chain.invoke`,
and against LangChain's usual local route, ChatHuggingFace over a transformers pipeline asked for
`json_schema` output (the pipeline ignores `response_format`: it generates free text that
JsonOutputParser parses).

One process, SmolLM2-135M-Instruct on CPU, FP32, the same model object for every route, bitext's
8-field schema. The baseline gets our engine's system text (instructions + the field list with the
allowed values) as its system message, so both routes are told the same thing.

    python benchmarks/langchain_batch.py --limit 64
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path
from typing import Any

import torch
from langchain_core.prompts import ChatPromptTemplate
from pydantic import BaseModel, ValidationError

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.data import load_set
from minicpm_pcd_adapters import ChatMiniCPM, load_smollm2


def score(outputs: list[Any], rows: list[dict[str, Any]], schema: type[BaseModel]) -> tuple[float, float]:
    """(field accuracy, valid-object rate); an invalid or failed output counts as all fields wrong."""
    right = valid = 0
    fields = list(rows[0]["labels"])
    for out, row in zip(outputs, rows, strict=True):
        data = out.model_dump() if isinstance(out, BaseModel) else out
        try:
            value = schema.model_validate(data).model_dump()
        except (ValidationError, TypeError):
            continue
        valid += 1
        right += sum(value[f] == row["labels"][f] for f in fields)
    return right / (len(fields) * len(rows)), valid / len(rows)


def baseline_chain(engine: Any, schema: type[BaseModel], max_new_tokens: int) -> Any:
    from langchain_huggingface import ChatHuggingFace, HuggingFacePipeline
    from transformers import pipeline

    generator = pipeline(
        "text-generation",
        model=engine.model,
        tokenizer=engine.tokenizer,
        max_new_tokens=max_new_tokens,
        do_sample=False,
        return_full_text=False,
    )
    chat = ChatHuggingFace(
        llm=HuggingFacePipeline(pipeline=generator), tokenizer=engine.tokenizer, model_id="smollm2"
    )
    system = engine.plan(schema).system.replace("{", "{{").replace("}", "}}")
    prompt = ChatPromptTemplate.from_messages([("system", system), ("human", "{text}")])
    return prompt | chat.with_structured_output(schema, method="json_schema")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--limit", type=int, default=64)
    parser.add_argument("--baseline-limit", type=int, default=None, help="texts for the slow baseline")
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--ours-only", action="store_true", help="skip the slow ChatHuggingFace baseline")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    schema, rows = load_set("bitext_customer_support", args.limit)
    texts = [row["text"] for row in rows]
    engine = load_smollm2()
    ours = ChatPromptTemplate.from_messages([("human", "{text}")]) | ChatMiniCPM(
        engine=engine, model="SmolLM2-135M-Instruct"
    ).with_structured_output(schema)
    inputs = [{"text": t} for t in texts]
    ours.invoke(inputs[0])  # compile and warm the schema (priors, prefix cache), as any service would

    started = time.perf_counter()
    batched = ours.batch(inputs, return_exceptions=True)
    batch_s = time.perf_counter() - started
    started = time.perf_counter()
    looped = [ours.invoke(x) for x in inputs]
    loop_s = time.perf_counter() - started
    assert [b for b in batched] == looped, "batch and invoke disagree"

    acc, valid = score(batched, rows, schema)
    if args.ours_only:
        print(
            f"ours, {len(rows)} texts: batch {len(rows) / batch_s:.2f} texts/s, loop {len(rows) / loop_s:.2f}"
        )
        print(f"batch / loop throughput: {loop_s / batch_s:.2f}x; field acc {acc:.3f}, valid {valid:.2f}")
        return
    n_base = args.baseline_limit or len(rows)
    base = baseline_chain(engine, schema, max_new_tokens=128)
    started = time.perf_counter()
    base_out = base.batch(inputs[:n_base], return_exceptions=True)
    base_s = time.perf_counter() - started

    base_acc, base_valid = score(base_out, rows[:n_base], schema)
    print(f"bitext_customer_support, {len(rows)} texts (baseline {n_base}), SmolLM2-135M CPU FP32")
    print(f"{'route':44}{'texts/s':>9}{'field acc':>11}{'valid':>8}")
    print(f"{'ours: chain.batch':44}{len(rows) / batch_s:>9.2f}{acc:>11.3f}{valid:>8.2f}")
    print(f"{'ours: loop of chain.invoke':44}{len(rows) / loop_s:>9.2f}{acc:>11.3f}{valid:>8.2f}")
    label = "ChatHuggingFace(pipeline) json_schema batch"
    print(f"{label:44}{n_base / base_s:>9.2f}{base_acc:>11.3f}{base_valid:>8.2f}")
    print(f"baseline sample output: {base_out[0]!r:.300}")
    print(
        f"batch / loop throughput: {loop_s / batch_s:.2f}x; ours batch / ChatHuggingFace: "
        f"{(len(rows) / batch_s) / (n_base / base_s):.2f}x"
    )


if __name__ == "__main__":
    main()
