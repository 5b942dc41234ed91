"""`pcd serve`'s memory over many distinct schemas and system texts: the process's resident memory after a
warm-up, then after N more requests, each with a schema and a system text no earlier request had
(SmolLM2-135M, CPU, the server in this process on 127.0.0.1, 4 requests at a time).

Every cache keyed by what clients send is bounded, so the growth should stop once the caches are full
(the target: under 100 MiB over 1,000 schemas). The default warm-up (300 schemas) fills them: the
prefix cache's 512 MiB holds the heads of about 200 of these schemas, the plan caches 256 entries.
The caches' sizes are printed from /metrics where the server has them. Uses only HTTP, so the same
script measures an older checkout.

    python benchmarks/server_caches.py --warm-up 300 --requests 1000
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import time
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from minicpm_pcd_adapters import load_smollm2
from minicpm_pcd_adapters.server.app import create_app
from minicpm_pcd_adapters.server.settings import ServerSettings
from tests.helpers import served


def rss_mib() -> float:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise RuntimeError("no VmRSS in /proc/self/status")


def body(i: int) -> dict:
    schema = {
        "type": "object",
        "title": f"Route{i}",
        "properties": {
            "team": {"enum": [f"billing-{i}", f"shipping-{i}", f"accounts-{i}"]},
            "urgent": {"type": "boolean"},
        },
        "required": ["team", "urgent"],
    }
    return {
        "model": "smollm2",
        "messages": [
            {"role": "system", "content": f"You route messages for shop number {i}."},
            {"role": "user", "content": "My parcel has not arrived and I need it tomorrow."},
        ],
        "response_format": {"type": "json_schema", "json_schema": {"name": f"Route{i}", "schema": schema}},
    }


async def send(url: str, start: int, count: int) -> int:
    limit = asyncio.Semaphore(4)
    async with httpx.AsyncClient(base_url=url, timeout=300) as client:

        async def one(i: int) -> int:
            async with limit:
                return (await client.post("/v1/chat/completions", json=body(i))).status_code

        statuses = await asyncio.gather(*(one(i) for i in range(start, start + count)))
    return sum(status == 200 for status in statuses)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--warm-up", type=int, default=300, help="schemas before the first reading")
    parser.add_argument("--requests", type=int, default=1000)
    args = parser.parse_args()
    app = create_app(load_smollm2(), ServerSettings(model_name="smollm2", batch_window_ms=1))
    with served(app) as url:
        answered = asyncio.run(send(url, 0, args.warm_up))
        warm = rss_mib()
        print(f"after {args.warm_up} warm-up schemas ({answered} answered): RSS {warm:.0f} MiB", flush=True)
        print(cache_sizes(url), flush=True)
        began, done, step = time.perf_counter(), 0, max(args.requests // 4, 1)
        while done < args.requests:
            count = min(step, args.requests - done)
            answered = asyncio.run(send(url, args.warm_up + done, count))
            done += count
            now = rss_mib()
            print(
                f"after {done} more schemas ({answered} of the last {count} answered): RSS {now:.0f} MiB "
                f"(+{now - warm:.0f} MiB), {time.perf_counter() - began:.0f} s",
                flush=True,
            )
        print(cache_sizes(url), flush=True)


def cache_sizes(url: str) -> str:
    """The `pcd_cache_size` and `pcd_cache_limit` lines of /metrics (none on an older server)."""
    lines = httpx.get(f"{url}/metrics").text.splitlines()
    return "\n".join(line for line in lines if line.startswith(("pcd_cache_size{", "pcd_cache_limit{")))


if __name__ == "__main__":
    main()
