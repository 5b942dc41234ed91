"""Warm per-text latency of the default engine for one checkout of this repository (a before/after
A/B of an engine change: run it on each checkout, alternating, in one session).

    python benchmarks/second_pass.py --repo /path/to/old/checkout --sets banking77
    python benchmarks/second_pass.py --repo . --sets banking77
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--repo", type=Path, default=Path(__file__).resolve().parents[1])
    parser.add_argument("--sets", nargs="*", default=["banking77"])
    parser.add_argument("--limit", type=int, default=24)
    parser.add_argument("--data", type=Path, default=Path(__file__).resolve().parents[2] / "shared" / "data")
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args()
    repo = str(args.repo.resolve())
    sys.path.insert(0, repo)
    import pcd_engine
    from benchmarks.data import load_set
    from minicpm_pcd_adapters import load_smollm2

    if not pcd_engine.__file__ or not pcd_engine.__file__.startswith(repo):
        raise SystemExit(f"pcd_engine came from {pcd_engine.__file__}, not {repo}")
    engine = load_smollm2()
    report = {}
    for name in args.sets:
        schema, rows = load_set(name, args.limit, data_dir=args.data)
        engine.classify(rows[-1]["text"], schema)  # the head and the priors, outside the timing
        seconds, calls = [], []
        for row in rows:
            started = time.perf_counter()
            result = engine.classify(row["text"], schema)
            seconds.append(time.perf_counter() - started)
            calls.append(result.diagnostics.forward_calls)
        started = time.perf_counter()
        answers = engine.classify_batch([row["text"] for row in rows], schema)
        batch = (time.perf_counter() - started) / len(rows)
        report[name] = {
            "median_ms": statistics.median(seconds) * 1e3,
            "forward_calls": statistics.median(calls),
            "batch_ms_per_text": batch * 1e3,
            "answers": [a.value.model_dump(mode="json") for a in answers],
        }
        shown = {k: round(v, 1) for k, v in report[name].items() if k != "answers"}
        print(f"{repo} {name}: {shown}", flush=True)
    if args.json:
        args.json.write_text(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
