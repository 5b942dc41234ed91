"""Ray Data on a real local cluster (`ray.init(num_cpus=2)`): `classify_dataset` against the in-process
engine, error rows, schemas that cannot travel, and an actor killed mid-job. The model is a tiny random
Llama saved to a folder, loaded by every actor as a user's model would be."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from typing import ClassVar, Literal

import psutil
import pytest
import ray
from pydantic import BaseModel

from minicpm_pcd_adapters.ray.data import classify_dataset
from pcd_engine import PCDEngine, UnsupportedSchemaError
from tests.helpers import ROUTE

TEXTS = ["refund me", "The app crashes when I log in.", "Where is my parcel?", "charged twice", "hello"]


@pytest.fixture(scope="module", autouse=True)
def cluster():
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    ray.data.DataContext.get_current().enable_progress_bars = False
    yield
    ray.shutdown()


@pytest.fixture(scope="module")
def folder(tiny_folder):
    return tiny_folder


def test_classify_dataset_equals_classify_batch_and_keeps_bad_rows(folder):
    rows = [{"id": i, "text": t} for i, t in enumerate(TEXTS * 3)] + [
        {"id": 15, "text": "  "},
        {"id": 16, "text": None},
    ]
    out = classify_dataset(ray.data.from_items(rows), ROUTE, model=folder, batch_size=4, actors=2).take_all()
    assert sorted(r["id"] for r in out) == list(range(17))  # every input exactly once
    reference = PCDEngine.from_pretrained(folder).classify_batch(TEXTS * 3, ROUTE)
    by_id = {r["id"]: r for r in out}
    for i, expected in enumerate(reference):
        row = by_id[i]
        assert row["pcd_error"] is None
        assert row["pcd.topic"] == expected.value["topic"] and row["pcd.urgent"] == expected.value["urgent"]
        assert row["pcd.topic.confidence"] == pytest.approx(expected.fields["topic"].confidence, abs=1e-5)
        assert row["pcd_object"] is not None and row["text"] == rows[i]["text"]
    for i in (15, 16):
        assert by_id[i]["pcd_error_type"] == "InputError" and by_id[i]["pcd_object"] is None
        assert by_id[i]["pcd.topic"] is None


def test_schemas_that_cannot_travel_fail_before_the_job(folder):
    def local_schema():
        class Held(BaseModel):
            lock: ClassVar = threading.Lock()  # a lock cannot be pickled
            topic: Literal["a", "b"]

        return Held

    with pytest.raises(UnsupportedSchemaError, match=r"cannot be pickled.*import path"):
        classify_dataset(ray.data.from_items([{"text": "x"}]), local_schema(), model=folder)
    with pytest.raises(UnsupportedSchemaError):
        classify_dataset(ray.data.from_items([{"text": "x"}]), {"type": "array"}, model=folder)
    with pytest.raises(ValueError, match="explicit batch_size"):
        classify_dataset(
            ray.data.from_items([{"text": "x"}]), ROUTE, model=folder, num_gpus=1, batch_size=None
        )


def test_an_actor_killed_mid_job_is_restarted_and_no_input_is_lost_or_doubled(folder):
    rows = [{"id": i, "text": f"{TEXTS[i % 5]} #{i}"} for i in range(120)]
    out = classify_dataset(
        ray.data.from_items(rows, override_num_blocks=30), ROUTE, model=folder, batch_size=2
    )
    seen, killed = [], []
    for row in out.iter_rows():
        seen.append(row["id"])
        if len(seen) == 8 and not killed:
            killed = _kill_map_workers()
    assert killed, "no actor process was found to kill"
    assert sorted(seen) == list(range(120))
    assert all(r is not None for r in seen)


def _kill_map_workers() -> list[int]:
    pids = []
    for process in psutil.process_iter(["pid", "cmdline"]):
        title = " ".join(process.info["cmdline"] or [])
        if "MapWorker" in title and process.info["pid"] != os.getpid():
            os.kill(process.info["pid"], signal.SIGKILL)
            pids.append(process.info["pid"])
    time.sleep(0.5)
    return pids


def test_cli_classify_ray_writes_one_shard_per_file_and_a_rerun_skips_them(folder, tmp_path):
    import pyarrow.parquet as pq

    inputs = tmp_path / "in"
    (inputs / "more").mkdir(parents=True)
    (inputs / "a.jsonl").write_text('{"id": 7, "text": "refund me"}\n{not json\n"Where is my parcel?"\n')
    (inputs / "more" / "b.txt").write_text("charged twice\n\nhello\n")
    schema_file = tmp_path / "route.py"
    schema_file.write_text(
        "from typing import Literal\nfrom pydantic import BaseModel\n\n"
        "class Route(BaseModel):\n    topic: Literal['billing', 'bug', 'other']\n    urgent: bool\n"
    )
    output = tmp_path / "out"
    address = ray.get_runtime_context().gcs_address
    command = [sys.executable, "-m", "minicpm_pcd_adapters.cli", "classify", "--ray",
               "--ray-address", address, "--schema", f"{schema_file}:Route", "--input", str(inputs),
               "--output", str(output),
               "--model", folder, "--batch-size", "2"]  # fmt: skip
    first = subprocess.run(command, capture_output=True, text=True, timeout=600)
    assert first.returncode == 1, first.stderr[-2000:]  # two error rows
    a = pq.read_table(output / "a.jsonl.parquet").to_pylist()
    b = pq.read_table(output / "more" / "b.txt.parquet").to_pylist()
    assert [r["line"] for r in a] == [1, 2, 3] and [r["line"] for r in b] == [1, 2, 3]
    assert a[0]["id"] == "7" and "malformed JSON" in a[1]["pcd_error"] and b[1]["pcd_error"] == "empty line"
    engine = PCDEngine.from_pretrained(folder)
    for row, text in [
        (a[0], "refund me"),
        (a[2], "Where is my parcel?"),
        (b[0], "charged twice"),
        (b[2], "hello"),
    ]:
        assert json.loads(row["pcd_object"]) == engine.classify(text, RouteClass).value.model_dump()
    assert "2 error rows" in first.stderr
    stamp = (output / "a.jsonl.parquet").stat().st_mtime_ns
    again = subprocess.run(command, capture_output=True, text=True, timeout=600)
    assert again.returncode == 0 and "2 shards, 2 already complete" in again.stderr
    assert (output / "a.jsonl.parquet").stat().st_mtime_ns == stamp


class RouteClass(BaseModel):
    topic: Literal["billing", "bug", "other"]
    urgent: bool


def test_a_calibration_with_heads_travels_as_a_path_each_actor_loads(folder, tmp_path):
    engine = PCDEngine.from_pretrained(folder)
    texts = [f"{t} #{i}" for i, t in enumerate(TEXTS * 2)]
    labels = [{"topic": t, "urgent": u} for t, u in [("billing", True), ("bug", True), ("other", False)] * 3]
    labels.append({"topic": "billing", "urgent": False})
    cal = engine.calibrate(ROUTE, texts, labels, method="head", folds=2)
    assert cal.needs_hidden
    path = tmp_path / "route.calibration.json"
    cal.save(path)  # and route.calibration.safetensors beside it
    rows = [{"id": i, "text": t} for i, t in enumerate(TEXTS)]
    out = classify_dataset(
        ray.data.from_items(rows), ROUTE, model=folder, batch_size=3, calibration=str(path)
    ).take_all()
    want = engine.classify_batch(TEXTS, ROUTE, calibration=cal)
    for row in out:
        expected = want[row["id"]]
        assert row["pcd_error"] is None and row["pcd.topic"] == expected.value["topic"]
        assert row["pcd.topic.confidence"] == pytest.approx(expected.fields["topic"].confidence, abs=1e-5)


def test_cli_run_batch_on_ray_answers_every_line_once_in_order(folder, tmp_path):
    properties = {"topic": {"enum": ["billing", "bug", "other"]}, "urgent": {"type": "boolean"}}
    schema = {"title": "Route", "type": "object", "required": ["topic", "urgent"], "properties": properties}
    format_ = {"type": "json_schema", "json_schema": {"name": "Route", "schema": schema}}
    lines = []
    for i in range(11):
        body = {
            "model": "tiny",
            "messages": [{"role": "user", "content": TEXTS[i % 5]}],
            "response_format": format_,
        }
        lines.append(
            json.dumps({"custom_id": f"r{i}", "method": "POST", "url": "/v1/chat/completions", "body": body})
        )
    lines[4] = "{not json"
    lines[9] = lines[9].replace('"r9"', '"r1"')  # line 2's custom_id, three parts later
    source, output = tmp_path / "batch.jsonl", tmp_path / "out.jsonl"
    source.write_text("\n".join(lines) + "\n")
    address = ray.get_runtime_context().gcs_address
    command = [sys.executable, "-m", "minicpm_pcd_adapters.cli", "run-batch", "--ray",
               "--ray-address", address, "-i", str(source), "-o", str(output), "--model", folder,
               "--served-model-name", "tiny", "--actors", "2", "--part-lines", "3",
               "--concurrency", "2"]  # fmt: skip
    done = subprocess.run(command, capture_output=True, text=True, timeout=600)
    assert done.returncode == 1, done.stderr[-2000:]  # the broken lines' error records
    records = [json.loads(line) for line in output.read_text().splitlines()]
    ids = [f"r{i}" if i != 9 else "r1" for i in range(11)]
    assert [r["custom_id"] for r in records] == [x if i != 4 else None for i, x in enumerate(ids)]
    assert records[4]["error"]["code"] == "invalid_json" and "line 5" in records[4]["error"]["message"]
    assert (
        records[9]["error"]["code"] == "duplicate_custom_id" and "by line 2" in records[9]["error"]["message"]
    )
    engine = PCDEngine.from_pretrained(folder)
    for i, record in enumerate(records):
        if i not in (4, 9):
            answer = json.loads(record["response"]["body"]["choices"][0]["message"]["content"])
            assert answer == engine.classify(TEXTS[i % 5], schema).value
    assert not (tmp_path / "out.jsonl.parts").exists()
