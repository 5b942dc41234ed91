"""`pcd run-batch` on the tiny model: an OpenAI batch file of chat, completions and classify lines,
good and bad, answered by the server's own app in process, one record per line in input order, in
OpenAI's batch output shape; scored lines share engine batches across lines; a bad line (or a
repeated custom_id) is one error record and the run goes on; a killed run resumed with `--resume`
loses and repeats nothing."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import pytest

from minicpm_pcd_adapters.server.app import create_app
from minicpm_pcd_adapters.server.batch_files import answered_records, run_batch_file
from minicpm_pcd_adapters.server.settings import ServerSettings

ROUTE = {
    "title": "Route",
    "type": "object",
    "properties": {"topic": {"enum": ["billing", "bug", "other"]}, "urgent": {"type": "boolean"}},
    "required": ["topic", "urgent"],
}
FORMAT = {"type": "json_schema", "json_schema": {"name": "Route", "schema": ROUTE}}
TEXTS = ["refund me", "The app crashes when I log in.", "Where is my parcel?", "charged twice", "hello"]


def chat_line(i: int, text: str) -> dict:
    body = {"model": "tiny", "messages": [{"role": "user", "content": text}], "response_format": FORMAT}
    return {"custom_id": f"chat-{i}", "method": "POST", "url": "/v1/chat/completions", "body": body}


def lines_file(path, count=12):
    lines = [json.dumps(chat_line(i, TEXTS[i % len(TEXTS)])) for i in range(count)]
    lines[3] = "{not json"
    lines[5] = json.dumps({"custom_id": "wrong-url", "method": "POST", "url": "/v1/embeddings", "body": {}})
    hi = [{"role": "user", "content": "hi"}]
    lines[6] = json.dumps({"custom_id": "other-model", "url": "/v1/chat/completions",
                           "body": {"model": "gpt-4o", "messages": hi}})  # fmt: skip
    lines[7] = json.dumps({"custom_id": "text", "method": "POST", "url": "/v1/completions",
                           "body": {"model": "tiny", "prompt": "Hello", "max_tokens": 3}})  # fmt: skip
    lines[8] = json.dumps({"custom_id": "classify", "method": "POST", "url": "/v1/classify",
                           "body": {"model": "tiny", "input": ["refund me", "hello"]}})  # fmt: skip
    lines[9] = json.dumps({"custom_id": "streamed", "url": "/v1/chat/completions",
                           "body": {"model": "tiny", "messages": hi, "stream": True}})  # fmt: skip
    lines[11] = json.dumps(chat_line(1, "a second request under line 2's custom_id"))
    path.write_text("\n".join(lines) + "\n")
    return lines


@pytest.fixture
def schema_file(tmp_path):
    path = tmp_path / "route.json"
    path.write_text(json.dumps(ROUTE))
    return path


def test_every_line_gets_one_record_in_order_and_scored_lines_share_batches(engine, tmp_path, schema_file):
    source, output = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    lines = lines_file(source)
    app = create_app(engine, ServerSettings(model_name="tiny", schema=str(schema_file), batch_window_ms=50))
    summary = run_batch_file(app, source, output, concurrency=16)
    records = [json.loads(line) for line in output.read_text().splitlines()]
    assert len(records) == len(lines) == summary.written
    assert [r["custom_id"] for r in records] == [
        json.loads(line)["custom_id"] if line.startswith('{"') else None for line in lines
    ]
    assert len({r["id"] for r in records}) == len(records) and all(
        r["id"].startswith("batch_req_") for r in records
    )
    for i in (0, 1, 2, 4, 10):  # chat lines: what the engine answers in process
        record = records[i]
        assert record["error"] is None and record["response"]["status_code"] == 200
        choice = record["response"]["body"]["choices"][0]
        want = engine.classify(TEXTS[i % len(TEXTS)], ROUTE)
        assert json.loads(choice["message"]["content"]) == want.to_json()["value"]
        for value, p in want.fields["topic"].to_json()["probabilities"].items():
            assert choice["pcd"]["fields"]["topic"]["probabilities"][value] == pytest.approx(p, abs=1e-4)
    assert records[3]["response"] is None and records[3]["error"]["code"] == "invalid_json"
    assert "line 4" in records[3]["error"]["message"]
    assert records[5]["error"]["message"].startswith("line 6: url must be one of")
    assert records[6]["response"]["status_code"] == 404 and records[6]["error"] is None  # the server's answer
    assert records[7]["response"]["body"]["object"] == "text_completion"
    assert [d["index"] for d in records[8]["response"]["body"]["data"]] == [0, 1]
    assert "stream" in records[9]["error"]["message"]
    assert records[11]["response"] is None and records[11]["error"] == {
        "code": "duplicate_custom_id",
        "message": "line 12: custom_id 'chat-1' is already used by line 2: they must be unique",
        "line": 12,
    }
    assert summary.failed == 5
    metrics = app.state.metrics.registry
    batches = metrics.get_sample_value("pcd_batch_size_count")
    answers = metrics.get_sample_value("pcd_batch_size_sum")
    assert answers / batches > 1.5, (answers, batches)  # lines with one schema answered in shared batches


def test_resume_keeps_whole_records_and_redoes_a_torn_one(engine, tmp_path):
    source, output = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    lines = [json.dumps(chat_line(i, TEXTS[i % len(TEXTS)])) for i in range(7)]
    source.write_text("\n".join(lines) + "\n")
    app = create_app(engine, ServerSettings(model_name="tiny"))
    run_batch_file(app, source, output, concurrency=3)
    whole = output.read_text().splitlines()
    output.write_text("\n".join(whole[:4]) + "\n" + whole[4][:20])  # killed while writing line 5
    assert answered_records(output) == 4 and output.read_text().count("\n") == 4
    summary = run_batch_file(
        create_app(engine, ServerSettings(model_name="tiny")), source, output, resume=True
    )
    assert summary.skipped == 4 and summary.written == 3
    records = [json.loads(line) for line in output.read_text().splitlines()]
    assert [r["custom_id"] for r in records] == [f"chat-{i}" for i in range(7)]
    assert records[:4] == [json.loads(line) for line in whole[:4]]  # kept as they were


def test_a_killed_run_resumed_loses_and_repeats_nothing(tiny_folder, tmp_path):
    source, output = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    count = 120
    source.write_text(
        "\n".join(json.dumps(chat_line(i, f"{TEXTS[i % 5]} #{i}")) for i in range(count)) + "\n"
    )
    command = [sys.executable, "-m", "minicpm_pcd_adapters.cli", "run-batch", "-i", str(source),
               "-o", str(output), "--model", tiny_folder, "--served-model-name", "tiny", "--device", "cpu",
               "--concurrency", "8"]  # fmt: skip
    process = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    deadline = time.monotonic() + 240
    while not (output.exists() and output.read_text().count("\n") >= 16):
        assert process.poll() is None, process.stderr.read().decode() if process.stderr else ""
        assert time.monotonic() < deadline, "run-batch wrote nothing"
        time.sleep(0.05)
    os.kill(process.pid, signal.SIGKILL)
    process.wait()
    done = answered_records(output)
    assert 16 <= done < count
    resumed = subprocess.run([*command, "--resume"], capture_output=True, text=True, timeout=600)
    assert resumed.returncode == 0, resumed.stderr
    records = [json.loads(line) for line in output.read_text().splitlines()]
    assert [r["custom_id"] for r in records] == [f"chat-{i}" for i in range(count)]
    assert all(r["response"]["status_code"] == 200 for r in records)
    again = subprocess.run([*command, "--resume"], capture_output=True, text=True, timeout=600)
    assert again.returncode == 0 and "nothing to resume" in again.stderr


def test_bad_options_fail_before_the_model_loads(tmp_path):
    from minicpm_pcd_adapters.cli.main import main

    source = tmp_path / "in.jsonl"
    source.write_text("{}\n")
    assert (
        main(
            [
                "run-batch",
                "-i",
                str(tmp_path / "missing.jsonl"),
                "-o",
                str(tmp_path / "o.jsonl"),
                "--model",
                "x",
            ]
        )
        == 2
    )
    assert main(["run-batch", "-i", str(source), "-o", str(source), "--model", "x"]) == 2
    assert (
        main(
            [
                "run-batch",
                "-i",
                str(source),
                "-o",
                str(tmp_path / "o.jsonl"),
                "--model",
                "x",
                "--concurrency",
                "0",
            ]
        )
        == 2
    )
