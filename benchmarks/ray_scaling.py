"""Issue-16 benchmark: Ray Data actors against one in-process `classify_batch` on the same texts.

SmolLM2-135M on CPU, FP32, the bitext schema (as a JSON-schema dict, which is what crosses to the
actors), the first `--texts` rows. Rows:
  - in process: one `engine.classify_batch` over all texts (torch on every core of this machine);
  - Ray, 1 actor with 1 CPU; Ray, 2 actors with 1 CPU each (an actor holding every CPU would leave
    none to Ray Data's other tasks, and the job would wait forever).
Ray rows are timed end to end (actor start-up and model loading included); the time to the first
batch of answers and the rate after it (steady state) are printed too. Answers equal to the
in-process ones are counted.

    python benchmarks/ray_scaling.py --texts 256 --json out/ray_scaling.json

On a GPU cluster: `actors` = the number of GPUs, `num_gpus=1` per actor, and `batch_size` from
`benchmarks/gpu.py` (the batch where its rows/s stops growing), e.g.
`classify_dataset(ds, Schema, model="minicpm5-2b", actors=8, num_gpus=1, batch_size=128)`.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.data import load_set
from minicpm_pcd_adapters import load_smollm2
from minicpm_pcd_adapters.ray.data import classify_dataset

SET = "bitext_customer_support"


def run_ray(
    texts: list[str], schema: dict[str, Any], actors: int, cpus: float, batch_size: int
) -> dict[str, Any]:
    import ray

    ds = ray.data.from_items([{"id": i, "text": t} for i, t in enumerate(texts)], override_num_blocks=16)
    started = time.perf_counter()
    first: tuple[float, int] | None = None  # when the first batch of answers arrived, and its rows
    answers: dict[int, Any] = {}
    out = classify_dataset(ds, schema, model="smollm2", actors=actors, num_cpus=cpus, batch_size=batch_size)
    for batch in out.iter_batches(batch_size=None, batch_format="pandas"):
        if first is None:
            first = (time.perf_counter(), len(batch))
        for row_id, obj in zip(batch["id"], batch["pcd_object"], strict=True):
            answers[int(row_id)] = json.loads(obj) if isinstance(obj, str) else None
    total = time.perf_counter() - started
    assert sorted(answers) == list(range(len(texts))), "a row was lost"
    assert first is not None
    steady = (len(texts) - first[1]) / max(total - (first[0] - started), 1e-9)  # rows/s after the first
    return {"answers": answers, "total_s": total, "steady_rows_per_s": steady, "first_s": first[0] - started}


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--texts", type=int, default=256)
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    import ray

    model, rows = load_set(SET)
    schema = model.model_json_schema()
    texts = [row["text"] for row in rows[: args.texts]]
    while len(texts) < args.texts:  # the set has 300 rows; repeat if more are asked
        texts += texts[: args.texts - len(texts)]
    cpus = os.cpu_count() or 1

    engine = load_smollm2()
    engine.classify(texts[0], schema)  # warm: the head is cached
    started = time.perf_counter()
    reference = [r.value for r in engine.classify_batch(texts, schema)]
    local = time.perf_counter() - started
    del engine
    report: dict[str, Any] = {"texts": len(texts), "cpus": cpus, "in_process_s": local, "rows": []}

    ray.init(num_cpus=cpus, include_dashboard=False, log_to_driver=False)
    ray.data.DataContext.get_current().enable_progress_bars = False
    try:
        for actors, per_actor in ((1, 1), (min(2, cpus), 1)):
            run = run_ray(texts, schema, actors, per_actor, args.batch_size)
            same = sum(run["answers"][i] == reference[i] for i in range(len(texts)))
            report["rows"].append(
                {"actors": actors, "cpus_per_actor": per_actor, "total_s": run["total_s"],
                 "first_s": run["first_s"], "steady_rows_per_s": run["steady_rows_per_s"], "same": same}
            )  # fmt: skip
    finally:
        ray.shutdown()

    n = len(texts)
    print(f"\n{n} bitext texts, SmolLM2-135M, CPU ({cpus} cores), FP32, batch_size {args.batch_size}")
    print(f"{'':38} {'rows/s':>8} {'1st batch s':>12} {'then rows/s':>12} {'vs in-process':>14} {'same':>5}")
    print(f"{'in-process classify_batch':38} {n / local:8.2f} {'':>12} {'':>12} {1.0:13.2f}x {n:5d}")
    for r in report["rows"]:
        label = f"Ray, {r['actors']} actor(s) x {r['cpus_per_actor']} CPU"
        print(
            f"{label:38} {n / r['total_s']:8.2f} {r['first_s']:12.1f} {r['steady_rows_per_s']:12.2f} "
            f"{local / r['total_s']:13.2f}x {r['same']:5d}"
        )
    one = report["rows"][0]
    per_row = 1000 * (1 / one["steady_rows_per_s"] - local / n)
    print(f"1 actor after its first batch, against in-process: {per_row:+.0f} ms per row")
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
