"""`pcd run-batch` over an OpenAI batch file of N lines (SmolLM2-135M, CPU): chat lines with the README's
`Ticket` schema as `response_format`, every 50th line broken (not JSON, or another url), the run killed
(SIGKILL) once a share of the output is written, then `--resume`d. Checks that every input line has
exactly one record, in order, each broken line one error record, and prints the lines per second of
the two runs.

    python benchmarks/run_batch.py --lines 1000 --kill-at 0.4
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "examples"))

from ticket import Ticket  # noqa: E402

FORMAT = {"type": "json_schema", "json_schema": {"name": "Ticket", "schema": Ticket.model_json_schema()}}


def batch_lines(count: int) -> list[str]:
    texts = (ROOT / "examples" / "tickets.txt").read_text().splitlines()
    lines = []
    for i in range(count):
        if i % 50 == 49:
            lines.append(
                "{broken"
                if i % 100 == 99
                else json.dumps({"custom_id": f"r{i}", "url": "/v1/embeddings", "body": {}})
            )
            continue
        asked = [{"role": "user", "content": f"{texts[i % len(texts)]} (#{i})"}]
        body = {"model": "smollm2", "messages": asked, "response_format": FORMAT}
        lines.append(
            json.dumps({"custom_id": f"r{i}", "method": "POST", "url": "/v1/chat/completions", "body": body})
        )
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--lines", type=int, default=1000)
    parser.add_argument("--kill-at", type=float, default=0.4, help="share of lines written before the kill")
    args = parser.parse_args()
    folder = Path(tempfile.mkdtemp())
    source, output = folder / "batch.jsonl", folder / "out.jsonl"
    lines = batch_lines(args.lines)
    source.write_text("\n".join(lines) + "\n")
    command = [sys.executable, "-m", "minicpm_pcd_adapters.cli", "run-batch", "-i", str(source),
               "-o", str(output), "--model", "smollm2"]  # fmt: skip
    began = time.perf_counter()
    process = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, cwd=ROOT)
    while not (output.exists() and output.read_text().count("\n") >= args.kill_at * args.lines):
        if process.poll() is not None:
            raise SystemExit(f"run-batch ended before the kill (exit {process.returncode})")
        time.sleep(0.2)
    os.kill(process.pid, signal.SIGKILL)
    process.wait()
    first = time.perf_counter() - began
    written = output.read_text().count("\n")
    began = time.perf_counter()
    resumed = subprocess.run([*command, "--resume"], capture_output=True, text=True, cwd=ROOT)
    second = time.perf_counter() - began
    records = [json.loads(line) for line in output.read_text().splitlines()]
    wanted = [json.loads(line).get("custom_id") if line.startswith('{"') else None for line in lines]
    broken = [i for i, line in enumerate(lines) if i % 50 == 49]
    assert resumed.returncode == 1, resumed.stderr  # the broken lines' error records
    assert [r["custom_id"] for r in records] == wanted, "a line lost, repeated or out of order"
    assert [i for i, r in enumerate(records) if r["error"] is not None] == broken
    assert all(r["response"]["status_code"] == 200 for r in records if r["error"] is None)
    print(f"{args.lines} lines ({len(broken)} broken), killed after {written} lines written, then --resume")
    print(f"  first run (load + lines until the kill): {first:.1f} s")
    print(f"  resumed run (load + {args.lines - written} lines): {second:.1f} s")
    print(f"  every line one record, in order; {len(broken)} error records, all on the broken lines")


if __name__ == "__main__":
    main()
