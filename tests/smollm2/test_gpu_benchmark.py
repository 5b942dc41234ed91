"""benchmarks/gpu.py on the CPU, as a smoke test: MiniCPM5-2B's shape cut to 2 layers, fp32, a few
calls on short prompts (each schema's head and 32 tokens of text). It must print per-call figures for
ours, the AR JSON baseline and the floor, and throughput."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.slow
def test_gpu_benchmark_runs_on_the_cpu_with_its_ar_json_baseline(tmp_path):
    report = tmp_path / "gpu.json"
    command = [
        sys.executable, str(ROOT / "benchmarks" / "gpu.py"), "--device", "cpu", "--layers", "2",
        "--dtypes", "float32", "--calls", "3", "--ar-calls", "1", "--batch-sizes", "1", "2",
        "--prompt-tokens", "64", "--json", str(report),
    ]  # fmt: skip
    done = subprocess.run(command, capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert done.returncode == 0, done.stderr[-3000:]
    row = json.loads(report.read_text())["float32/sdpa"]
    assert row["weights_gib"] > 1  # the 130,560-token vocabulary of MiniCPM5-2B, twice (untied)
    for schema, fields in (("Ticket3", 3), ("Ticket8", 8)):
        ours, ar = row[schema], row[f"{schema}_ar_json"]
        assert ours["p50_ms"] > 0 and ours["floor_p50_ms"] > 0 and ar["p50_ms"] > 0
        assert ours["speedup_vs_ar_json"] == pytest.approx(ar["p50_ms"] / ours["p50_ms"])
        # a closed-field JSON object: at least a token per field, bounded by the schema
        assert fields <= ar["generated_tokens_median"] <= ar["generated_tokens_max"] < 128
        assert set(row[f"{schema}_throughput"]) == {"1", "2"}
