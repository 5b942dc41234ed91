"""Issue-15 benchmark: `pcd serve` under 1, 8 and 32 concurrent `openai` SDK clients.

`pcd serve --model smollm2` runs in its own process (its RSS is read from /proc); this process holds
the clients and, for the baselines, its own engine on the same model. The same bitext requests
(json_schema response format, the set's schema) are sent:
  - in process, one `engine.classify` after another (the floor of the HTTP path's overhead),
  - in process, one `engine.classify_batch` over all of them (the best batching can do),
  - over HTTP, one request at a time (1 client),
  - over HTTP by 8 and 32 concurrent clients, each sending its share one after another.
Printed per row: requests, throughput, p50 / p95 latency, mean batch size formed (from /metrics),
answers equal to the in-process engine's, and failures (asserted 0: every request answered once).
With `--soak-minutes M`, 8 clients then keep sending for M minutes while the server's RSS is
sampled every 10 s (the curve is printed and, with --plot, drawn).

With `--calibrate N`, a calibration is fitted in process on N labeled rows that are not among the
requests (`--method`, default head), saved, and every configuration runs twice in the same run:
with a server that has no calibration and with one started with `--calibration FILE`. The
calibrated rows compare the HTTP answers and probabilities with in-process `classify(...,
calibration=...)` and give both paths' field accuracy against the labels.

    python benchmarks/server.py --requests 96 --json out/server.json
    python benchmarks/server.py --requests 48 --clients 1 8 --calibrate 100 --json out/server-cal.json
    python benchmarks/server.py --requests 0 --soak-minutes 10 --plot docs/img/server_rss.png
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import socket
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import httpx
import openai

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.data import load_set
from minicpm_pcd_adapters import load_smollm2

SET = "bitext_customer_support"


def start_server(
    window_ms: float, max_batch: int, calibration: str | None = None
) -> tuple[subprocess.Popen[bytes], str]:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    command = [
        sys.executable,
        "-m",
        "minicpm_pcd_adapters.cli",
        "serve",
        "--model",
        "smollm2",
        "--port",
        str(port),
        "--batch-window-ms",
        str(window_ms),
        "--max-batch",
        str(max_batch),
        "--max-queue",
        "1024",
        *(["--calibration", calibration] if calibration else []),
    ]
    server = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        try:
            if httpx.get(url + "/health", timeout=1).status_code == 200:
                return server, url
        except httpx.TransportError:
            time.sleep(0.5)
        if server.poll() is not None:
            raise RuntimeError("pcd serve exited before it answered")
    raise RuntimeError("pcd serve did not start within 300 s")


def rss_mib(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return float("nan")


def batch_stats(url: str) -> tuple[float, float]:
    """(batches run, requests in them) so far, from /metrics."""
    values = {}
    for line in httpx.get(url + "/metrics").text.splitlines():
        if line.startswith(("pcd_batch_size_count ", "pcd_batch_size_sum ")):
            name, value = line.split()
            values[name] = float(value)
    return values["pcd_batch_size_count"], values["pcd_batch_size_sum"]


def request_format(schema: dict[str, Any]) -> dict[str, Any]:
    return {"type": "json_schema", "json_schema": {"name": "BitextCustomerSupport", "schema": schema}}


async def run_clients(url: str, schema: dict[str, Any], texts: list[str], clients: int) -> dict[str, Any]:
    """Each client sends its share of the texts one after another; all clients at once."""
    answers: dict[int, Any] = {}
    latencies: list[float] = []
    failures: list[str] = []
    async with openai.AsyncOpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=600) as client:

        async def one_client(share: list[int]) -> None:
            for index in share:
                started = time.perf_counter()
                try:
                    response = await client.chat.completions.create(
                        model="smollm2",
                        messages=[{"role": "user", "content": texts[index]}],
                        response_format=request_format(schema),
                    )
                except openai.APIError as error:
                    failures.append(f"{index}: {error}")
                    continue
                latencies.append(time.perf_counter() - started)
                if index in answers:
                    failures.append(f"{index}: answered twice")
                answers[index] = json.loads(response.choices[0].message.content)

        started = time.perf_counter()
        await asyncio.gather(*(one_client(list(range(c, len(texts), clients))) for c in range(clients)))
        elapsed = time.perf_counter() - started
    return {"answers": answers, "latencies": latencies, "failures": failures, "elapsed": elapsed}


def interleaved(
    url: str, engine: Any, schema: dict[str, Any], texts: list[str], calibration: Any = None
) -> dict[str, Any]:
    """Per text, in-process `classify` then the same request over HTTP (one client), measured side
    by side so that machine noise hits both alike: both answers, the largest difference between
    their probabilities, and both latencies."""
    out: dict[str, Any] = {"local": [], "remote": [], "local_ms": [], "remote_ms": [], "max_dp": 0.0}
    with openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=600) as client:
        for text in texts:
            started = time.perf_counter()
            result = engine.classify(text, schema, calibration=calibration)
            out["local_ms"].append(time.perf_counter() - started)
            started = time.perf_counter()
            response = client.chat.completions.create(
                model="smollm2",
                messages=[{"role": "user", "content": text}],
                response_format=request_format(schema),
            )
            out["remote_ms"].append(time.perf_counter() - started)
            out["local"].append(result.value)
            out["remote"].append(json.loads(response.choices[0].message.content))
            served = response.choices[0].pcd["fields"]  # type: ignore[attr-defined]
            for path, f in result.fields.items():
                for value, p in f.to_json().get("probabilities", {}).items():
                    out["max_dp"] = max(out["max_dp"], abs(served[path]["probabilities"][value] - p))
    return out


def field_accuracy(answers: list[dict[str, Any]], labels: list[dict[str, Any]]) -> float:
    hits = [a[k] == v for a, label in zip(answers, labels, strict=True) for k, v in label.items()]
    return sum(hits) / len(hits)


def summary(label: str, elapsed: float, latencies: list[float], n: int, **extra: Any) -> dict[str, Any]:
    q = statistics.quantiles(latencies, n=20) if len(latencies) > 1 else latencies * 19
    return {
        "label": label,
        "requests": n,
        "throughput": n / elapsed,
        "p50_ms": 1000 * statistics.median(latencies),
        "p95_ms": 1000 * q[18],
        **extra,
    }


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--requests", type=int, default=96, help="requests per configuration (0: soak only)")
    parser.add_argument("--clients", type=int, nargs="+", default=[1, 8, 32])
    parser.add_argument("--window-ms", type=float, default=5.0)
    parser.add_argument("--max-batch", type=int, default=64)
    parser.add_argument("--soak-minutes", type=float, default=0.0)
    parser.add_argument("--plot", default=None, help="PNG of the soak's RSS curve")
    parser.add_argument("--json", default=None)
    parser.add_argument("--calibrate", type=int, default=0, help="labeled rows to fit a calibration on "
                        "(not among the requests); 0: no calibrated run")  # fmt: skip
    parser.add_argument("--method", default="head", help="the calibration's method (default head)")
    args = parser.parse_args()
    os.environ.setdefault("HF_HUB_OFFLINE", "1")

    model, rows = load_set(SET)
    schema = model.model_json_schema()
    texts = [row["text"] for row in rows[: args.requests]]
    labels = [row["labels"] for row in rows[: args.requests]]
    report: dict[str, Any] = {"set": SET, "window_ms": args.window_ms, "rows": []}
    calibrations: list[tuple[str, Any]] = [("", None)]
    if args.calibrate:
        engine = load_smollm2()
        fit_rows = rows[-args.calibrate :]
        assert args.requests + args.calibrate <= len(rows), "the labeled rows would overlap the requests"
        calibration = engine.calibrate(
            schema, [r["text"] for r in fit_rows], [r["labels"] for r in fit_rows], method=args.method
        )
        path = Path("out/server-calibration.json").resolve()
        path.parent.mkdir(parents=True, exist_ok=True)
        calibration.save(path)
        calibrations.append((str(path), calibration))
        report["calibration"] = {
            "labels": args.calibrate,
            "methods": {path: f.method for path, f in calibration.fields.items()},
        }
        del engine
    for cal_path, calibration in calibrations:
        suffix = " (calibrated)" if calibration is not None else ""
        server, url = start_server(args.window_ms, args.max_batch, cal_path or None)
        try:
            if texts:
                run_configurations(report, url, schema, texts, labels, args.clients, calibration, suffix)
            if args.soak_minutes and calibration is None:
                report["soak"] = soak(
                    url, server.pid, schema, [row["text"] for row in rows], args.soak_minutes
                )
                if args.plot:
                    plot_rss(report["soak"], args.plot)
        finally:
            server.terminate()
            server.wait(timeout=60)
    if texts:
        print_rows(report["rows"], len(texts), report)
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(report, indent=2))


def run_configurations(
    report: dict[str, Any],
    url: str,
    schema: dict[str, Any],
    texts: list[str],
    labels: list[dict[str, Any]],
    client_counts: list[int],
    calibration: Any,
    suffix: str,
) -> None:
    """The in-process rows, then one HTTP row per client count, against one running server."""
    engine = load_smollm2()
    engine.classify(texts[0], schema, calibration=calibration)  # warm: the schema's head in both processes
    asyncio.run(run_clients(url, schema, texts[:1], 1))
    side = interleaved(url, engine, schema, texts, calibration)
    local, remote, reference = side["local_ms"], side["remote_ms"], side["local"]
    ratios = [r / t for r, t in zip(remote, local, strict=True)]
    report["http_overhead" + suffix.strip().replace(" ", "_")] = statistics.median(ratios) - 1
    report["accuracy" + suffix] = {
        "in_process": field_accuracy(side["local"], labels),
        "http": field_accuracy(side["remote"], labels),
        "same_answers": sum(a == b for a, b in zip(side["local"], side["remote"], strict=True)),
        "max_probability_difference": side["max_dp"],
    }
    started = time.perf_counter()
    batched = engine.classify_batch(texts, schema, calibration=calibration)
    elapsed = time.perf_counter() - started
    same = sum(r.value == ref for r, ref in zip(batched, reference, strict=True))
    report["rows"] += [
        summary("in-process classify, one by one" + suffix, sum(local), local, len(texts)),
        summary("in-process classify_batch" + suffix, elapsed, [elapsed], len(texts), same=same),
    ]
    del engine
    for clients in client_counts:
        before = batch_stats(url)
        run = asyncio.run(run_clients(url, schema, texts, clients))
        after = batch_stats(url)
        batches, requests = after[0] - before[0], after[1] - before[1]
        assert not run["failures"], run["failures"][:5]
        assert sorted(run["answers"]) == list(range(len(texts))), "a request was lost"
        same = sum(run["answers"][i] == reference[i] for i in range(len(texts)))
        report["rows"].append(
            summary(
                f"HTTP, {clients} client(s)" + suffix,
                run["elapsed"],
                run["latencies"],
                len(texts),
                same=same,
                mean_batch=requests / max(batches, 1),
                failures=0,
            )
        )


def print_rows(rows: list[dict[str, Any]], n: int, report: dict[str, Any]) -> None:
    print(f"\n{n} bitext requests, SmolLM2-135M, CPU, FP32")
    print(f"{'':55} {'req/s':>7} {'p50 ms':>8} {'p95 ms':>8} {'batch':>6} {'same':>5} {'vs 1 client':>11}")
    for r in rows:
        batch = f"{r['mean_batch']:.1f}" if "mean_batch" in r else ""
        same = f"{r['same']}" if "same" in r else ""
        suffix = " (calibrated)" if r["label"].endswith("(calibrated)") else ""
        one = next(x for x in rows if x["label"] == "HTTP, 1 client(s)" + suffix)
        ratio = r["throughput"] / one["throughput"]
        print(
            f"{r['label']:55} {r['throughput']:7.2f} {r['p50_ms']:8.0f} {r['p95_ms']:8.0f} "
            f"{batch:>6} {same:>5} {ratio:10.2f}x"
        )
    for key, value in report.items():
        if key.startswith("http_overhead"):
            print(f"{key} at one client (median per-text latency ratio, side by side): {100 * value:+.1f}%")
        if key.startswith("accuracy"):
            print(f"{key}: {json.dumps(value)}")


def soak(url: str, pid: int, schema: dict[str, Any], texts: list[str], minutes: float) -> dict[str, Any]:
    """8 clients sending for `minutes`; the server's RSS every 10 s."""
    curve: list[tuple[float, float]] = []
    stop = time.monotonic() + 60 * minutes
    sent = 0
    failures: list[str] = []

    async def loop() -> None:
        nonlocal sent
        started = time.monotonic()
        next_sample = 0.0
        while time.monotonic() < stop:
            if time.monotonic() - started >= next_sample:
                curve.append((time.monotonic() - started, rss_mib(pid)))
                next_sample += 10
            run = await run_clients(url, schema, texts[sent % len(texts) :][:32] or texts[:32], 8)
            sent += len(run["answers"])
            failures.extend(run["failures"])
        curve.append((time.monotonic() - started, rss_mib(pid)))

    asyncio.run(loop())
    start, end = curve[0][1], curve[-1][1]
    warm = next((r for t, r in curve if t >= 60), start)
    print(
        f"\nsoak: {sent} requests in {minutes:g} min, {len(failures)} failures; server RSS "
        f"{start:.0f} MiB at start, {warm:.0f} MiB after 1 min, {end:.0f} MiB at the end"
    )
    print("RSS curve (s, MiB): " + ", ".join(f"{t:.0f}:{r:.0f}" for t, r in curve))
    assert not failures, failures[:5]
    return {"requests": sent, "failures": len(failures), "curve": curve}


def plot_rss(soaked: dict[str, Any], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    times, rss = zip(*soaked["curve"], strict=True)
    figure, axis = plt.subplots(figsize=(6, 3))
    axis.plot([t / 60 for t in times], rss, marker=".")
    axis.set_xlabel("minutes")
    axis.set_ylabel("server RSS (MiB)")
    axis.set_ylim(0, max(rss) * 1.2)
    axis.set_title(f"pcd serve under 8 clients: {soaked['requests']} requests, {soaked['failures']} failed")
    figure.tight_layout()
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(path, dpi=100)


if __name__ == "__main__":
    main()
