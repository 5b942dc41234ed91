"""`POST /classify` against chat completions with `response_format`, on the same texts and schema
(SmolLM2-135M, CPU, `pcd serve` in this process on 127.0.0.1, started with `--schema`): one request
holding all N texts, against N chat requests sent one after another (a client's loop) and N sent 16
at a time (which the server batches too). Texts per second, median of `--repeats` runs, and the
largest probability difference between the two doors (they are the same call).

    python benchmarks/classify_endpoint.py --texts 64
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "examples"))

from ticket import Ticket  # noqa: E402

from minicpm_pcd_adapters import load_smollm2  # noqa: E402
from minicpm_pcd_adapters.server.app import create_app  # noqa: E402
from minicpm_pcd_adapters.server.settings import ServerSettings  # noqa: E402
from tests.helpers import served  # noqa: E402

FORMAT = {"type": "json_schema", "json_schema": {"name": "Ticket", "schema": Ticket.model_json_schema()}}


def texts(count: int) -> list[str]:
    lines = (ROOT / "examples" / "tickets.txt").read_text().splitlines()
    return [f"{lines[i % len(lines)]} (#{i})" for i in range(count)]


async def chat(url: str, items: list[str], in_flight: int) -> tuple[float, list[list[float]]]:
    limit = asyncio.Semaphore(in_flight)
    async with httpx.AsyncClient(base_url=url, timeout=600) as client:

        async def one(text: str) -> list[float]:
            async with limit:
                body = {"model": "smollm2", "messages": [{"role": "user", "content": text}]}
                answer = (
                    await client.post("/v1/chat/completions", json=body | {"response_format": FORMAT})
                ).json()
                topic = answer["choices"][0]["pcd"]["fields"]["topic"]["probabilities"]
                return list(topic.values())

        began = time.perf_counter()
        probs = await asyncio.gather(*(one(t) for t in items))
    return time.perf_counter() - began, probs


def classify(url: str, items: list[str]) -> tuple[float, list[list[float]]]:
    began = time.perf_counter()
    answer = httpx.post(url + "/classify", json={"model": "smollm2", "input": items}, timeout=600).json()
    return time.perf_counter() - began, [d["probs"] for d in answer["data"]]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--texts", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    settings = ServerSettings(model_name="smollm2", schema=f"{ROOT / 'examples' / 'ticket.py'}:Ticket")
    items = texts(args.texts)
    with served(create_app(load_smollm2(), settings)) as url:
        classify(url, items[:2])  # warm: the plan, the prefix cache
        runs: dict[str, list[float]] = {"/classify, one request": [], "chat, one at a time": [],
                                         "chat, 16 in flight": []}  # fmt: skip
        gap = 0.0
        for _ in range(args.repeats):
            seconds, door = classify(url, items)
            runs["/classify, one request"].append(seconds)
            seconds, one_by_one = asyncio.run(chat(url, items, 1))
            runs["chat, one at a time"].append(seconds)
            seconds, _ = asyncio.run(chat(url, items, 16))
            runs["chat, 16 in flight"].append(seconds)
            pairs = zip(door, one_by_one, strict=True)
            gap = max(gap, *(abs(a - b) for x, y in pairs for a, b in zip(x, y, strict=True)))
    base = statistics.median(runs["/classify, one request"])
    print(f"{args.texts} texts, median of {args.repeats} runs (SmolLM2-135M, CPU)")
    for name, seconds in runs.items():
        median = statistics.median(seconds)
        rate = args.texts / median
        print(f"  {name:24s} {median:6.2f} s  {rate:6.1f} texts/s  /classify is {median / base:.2f}x faster")
    print(f"largest probability difference between /classify and chat: {gap:.2e}")


if __name__ == "__main__":
    main()
