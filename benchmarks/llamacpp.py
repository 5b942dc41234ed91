"""llama.cpp grammar-constrained JSON: the CPU user's real alternative, as a benchmark baseline.

`llama-cpp-python` (the `[bench]` extra; it compiles llama.cpp from source, about 15 minutes on a
2-core machine) runs the same GGUF file the engine loads. Each call is `create_chat_completion` with
`response_format={"type": "json_object", "schema": ...}` (llama.cpp turns the schema into a GBNF
grammar), temperature 0, and the messages that render to exactly the prompt the xgrammar baseline
feeds (checked per text: `same_prompt`). llama.cpp keeps the KV of the previous prompt and reuses the
longest common prefix, so a warm call computes the text and the answer only, as our prefix cache does.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from typing import Any

from pydantic import BaseModel

from benchmarks.outcomes import Outcome, parse_object, prompt_ids
from minicpm_pcd_adapters.smollm2 import smollm2_gguf_path
from pcd_engine import PCDEngine

SYSTEM = "llamacpp-json"


def load_llama(threads: int | None = None, context: int = 4096) -> Any:
    """The GGUF file of the engine's offline model in llama.cpp (CPU, its own chat template)."""
    from llama_cpp import Llama

    return Llama(
        model_path=str(smollm2_gguf_path()),
        n_ctx=context,
        n_threads=threads or os.cpu_count(),
        n_batch=512,
        verbose=False,
    )


def messages(engine: PCDEngine, schema: type[BaseModel], text: str) -> list[dict[str, str]]:
    """The system and user messages of the engine's prompt for `text` (its frame around the text)."""
    plan = engine.plan(schema)
    frame = engine.prompt.frame
    return [
        {"role": "system", "content": plan.system},
        {"role": "user", "content": frame.open + text + frame.close},
    ]


def same_prompt(engine: PCDEngine, schema: type[BaseModel], text: str) -> bool:
    """Whether the messages render (with the engine's template) to the engine's own prompt ids."""
    pairs = [(m["role"], m["content"]) for m in messages(engine, schema, text)]
    return engine.prompt.render_messages(pairs) == prompt_ids(engine, schema, text)


def run_llamacpp(
    llama: Any, engine: PCDEngine, schema: type[BaseModel], max_tokens: int
) -> Callable[[str], Outcome]:
    """Per text: one grammar-constrained chat completion; the answer parsed and validated."""
    response_format = {"type": "json_object", "schema": schema.model_json_schema()}

    def call(text: str) -> Outcome:
        chat = messages(engine, schema, text)
        started = time.perf_counter()
        answer = llama.create_chat_completion(
            messages=chat, response_format=response_format, temperature=0.0, max_tokens=max_tokens
        )
        seconds = time.perf_counter() - started
        raw = answer["choices"][0]["message"]["content"] or ""
        return Outcome(seconds, parse_object(raw, schema), int(answer["usage"]["completion_tokens"]))

    return call


def warm(llama: Any, engine: PCDEngine, schema: type[BaseModel]) -> None:
    """One call outside the timing: the grammar's first build and the schema's prompt in the KV."""
    run_llamacpp(llama, engine, schema, 8)("warm-up")


def describe(llama: Any) -> dict[str, Any]:
    import llama_cpp

    return {
        "llama_cpp_python": llama_cpp.__version__,
        "threads": llama.n_threads,
        "gguf": str(smollm2_gguf_path()),
    }
