"""Issue-32 benchmark: 64 prompts in one `/v1/completions` request against 64 chat requests sent one
after another by one client, on `pcd serve --model smollm2` (its own process, CPU, fp32), in one run.

The same bitext texts, two constraints:
  - choice: vLLM's `guided_choice` over the 11 categories (chat: the text as the user's message;
    completions: a raw prompt `Customer message: ...\\nCategory:` and the categories after a space);
  - json: the set's whole schema (`response_format` json_schema on chat, `json_schema` on completions,
    SGLang's and llama.cpp's spelling).
Each shape is warmed up once (plans, prefix cache), then timed `--repeats` times; the median wall time
is printed with the ratio (64 chat requests / one completions request) and each shape's field
accuracy against the labels.

    python benchmarks/completions.py --prompts 64 --repeats 3
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import openai

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.data import load_set
from benchmarks.server import start_server

SET = "bitext_customer_support"


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--prompts", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--json", type=Path, help="also write the figures here")
    args = parser.parse_args()
    model, rows = load_set(SET, limit=args.prompts)
    schema = model.model_json_schema()
    categories = list(schema["properties"]["category"]["enum"])
    texts = [row["text"] for row in rows]
    prompts = [f"Customer message: {text}\nCategory:" for text in texts]
    server, url = start_server(window_ms=5, max_batch=64)
    client = openai.OpenAI(base_url=url + "/v1", api_key="-", max_retries=0, timeout=600)
    try:
        shapes = {
            "choice": (
                lambda: [
                    client.chat.completions.create(
                        model="smollm2",
                        messages=[{"role": "user", "content": text}],
                        extra_body={"guided_choice": categories},
                    )
                    .choices[0]
                    .message.content
                    for text in texts
                ],
                lambda: [
                    c.text.strip()
                    for c in client.completions.create(
                        model="smollm2",
                        prompt=prompts,
                        extra_body={"guided_choice": [" " + c for c in categories]},
                    ).choices
                ],
                lambda answers: [
                    a == row["labels"]["category"] for a, row in zip(answers, rows, strict=True)
                ],
            ),
            "json": (
                lambda: [
                    client.chat.completions.create(
                        model="smollm2",
                        messages=[{"role": "user", "content": text}],
                        response_format={
                            "type": "json_schema",
                            "json_schema": {"name": "Bitext", "schema": schema},
                        },
                    )
                    .choices[0]
                    .message.content
                    for text in texts
                ],
                lambda: [
                    c.text
                    for c in client.completions.create(
                        model="smollm2", prompt=prompts, max_tokens=64, extra_body={"json_schema": schema}
                    ).choices
                ],
                lambda answers: [
                    json.loads(a)[name] == value
                    for a, row in zip(answers, rows, strict=True)
                    for name, value in row["labels"].items()
                ],
            ),
        }
        figures: dict[str, Any] = {"prompts": len(texts), "repeats": args.repeats}
        for name, (chats, completions, correct) in shapes.items():
            chats(), completions()  # warm: plans, priors, the prefix cache
            timed: dict[str, list[float]] = {"chat": [], "completions": []}
            answers: dict[str, list[Any]] = {}
            for _ in range(args.repeats):
                for kind, run in (("chat", chats), ("completions", completions)):
                    started = time.perf_counter()
                    answers[kind] = run()
                    timed[kind].append(time.perf_counter() - started)
            chat_s, completions_s = statistics.median(timed["chat"]), statistics.median(timed["completions"])
            row = {
                "chat_s": round(chat_s, 2),
                "completions_s": round(completions_s, 2),
                "speedup": round(chat_s / completions_s, 2),
                "chat_accuracy": round(statistics.mean(correct(answers["chat"])), 3),
                "completions_accuracy": round(statistics.mean(correct(answers["completions"])), 3),
            }
            figures[name] = row
            print(
                f"{name:7s} {len(texts)} chat requests {chat_s:6.2f} s | one completions request "
                f"{completions_s:6.2f} s | {row['speedup']:.2f}x | field accuracy chat "
                f"{row['chat_accuracy']:.3f}, completions {row['completions_accuracy']:.3f}"
            )
        if args.json:
            args.json.parent.mkdir(parents=True, exist_ok=True)
            args.json.write_text(json.dumps(figures, indent=2))
    finally:
        server.terminate()
        server.wait(timeout=30)


if __name__ == "__main__":
    main()
