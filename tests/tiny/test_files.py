"""`pcd classify` on files: lazy chunks written as they complete, one record per line, resume after a
torn write, stop after the current chunk; and the input policy (empty text, invalid Unicode). Tiny
random Llama; the kill-and-resume run on SmolLM2 is in test_smollm2.py."""

from __future__ import annotations

import json
import threading

import pytest

from minicpm_pcd_adapters.files import answered_lines, classify_file, count_lines
from pcd_engine import InputError, PCDEngine
from tests.helpers import Ticket

LINES = [
    '{"text": "I was charged twice", "id": "a1"}',
    '"The app crashes"',
    "not json",
    '{"text": "   "}',
    '{"text": "Where is my parcel?", "id": 7}',
    "",
    '{"text": "refund me"}',
]


@pytest.fixture
def source(tmp_path):
    path = tmp_path / "in.jsonl"
    path.write_text("\n".join(LINES))  # no newline at the end: the last line still counts
    return path


def read(path):
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_every_line_gets_one_record_in_order_written_chunk_by_chunk(engine, source, tmp_path):
    out = tmp_path / "out.jsonl"
    sizes = []
    summary = classify_file(engine, Ticket, source, out, batch_size=3, progress=sizes.append)
    records = read(out)
    assert [r["line"] for r in records] == list(range(1, 8)) and count_lines(source) == 7
    assert sizes == [3, 3, 1] and summary.written == 7
    assert records[0]["id"] == "a1" and records[4]["id"] == 7
    assert "malformed JSON" in records[2]["error"]["message"]
    assert records[3]["error"]["type"] == "InputError" and "empty" in records[3]["error"]["message"]
    assert records[5]["error"]["message"] == "empty line"
    assert summary.errors == 3 and {"value", "fields"} <= set(records[6])
    alone = engine.classify("refund me", Ticket)
    assert records[6]["value"] == alone.value.model_dump()


def test_resume_cuts_a_torn_record_and_finishes_like_one_run(engine, source, tmp_path):
    whole = tmp_path / "whole.jsonl"
    classify_file(engine, Ticket, source, whole, batch_size=2)
    out = tmp_path / "out.jsonl"
    text = whole.read_text()
    out.write_text(text[: text.index("\n", text.index('"line": 3')) + 1] + '{"line": 4, "val')  # torn
    assert answered_lines(out) == {1, 2, 3} and out.read_text().endswith("\n")
    summary = classify_file(engine, Ticket, source, out, batch_size=2, resume=True)
    assert summary.skipped == 3 and summary.written == 4
    got, want = read(out), read(whole)
    assert [r["line"] for r in got] == list(range(1, 8))
    for a, b in zip(got, want, strict=True):
        assert a.get("value") == b.get("value") and a.get("error") == b.get("error")


def test_a_stop_request_ends_the_run_after_the_current_chunk(engine, source, tmp_path):
    out = tmp_path / "out.jsonl"
    stop = threading.Event()
    summary = classify_file(
        engine, Ticket, source, out, batch_size=2, stop=stop, progress=lambda n: stop.set()
    )
    assert summary.stopped and summary.written == 2 and len(read(out)) == 2
    rest = classify_file(engine, Ticket, source, out, batch_size=2, resume=True)
    assert not rest.stopped and rest.written == 5 and len(read(out)) == 7


def test_empty_and_invalid_unicode_texts_are_input_errors_before_model_work(
    engine, tiny_model, tiny_tokenizer
):
    with pytest.raises(InputError, match="empty or only whitespace"):
        engine.classify(" \n\t", Ticket)
    with pytest.raises(
        InputError, match=r"text #1 is not valid Unicode: surrogates not allowed at character 3"
    ):
        engine.classify_batch(["fine", "bad\udc80text"], Ticket)
    out = engine.classify_batch(["", "fine"], Ticket, return_exceptions=True)
    assert isinstance(out[0], InputError) and not isinstance(out[1], InputError)
    lenient = PCDEngine(tiny_model, tiny_tokenizer, allow_empty_text=True)
    assert lenient.classify("", Ticket).value.topic in {"billing", "crash", "other"}
