"""`pcd label` and `teacher.label_texts`: labels from a second `pcd serve` on 127.0.0.1 (SmolLM2 with a
calibration, so its answers carry calibrated probabilities), through the official openai SDK. The
teacher's queue holds one request, so concurrent labeling meets real 503s that the SDK retries."""

from __future__ import annotations

import json
import re
import sys
import urllib.request
from pathlib import Path

import pytest

from minicpm_pcd_adapters.cli import main
from minicpm_pcd_adapters.cli.options import read_labeled
from minicpm_pcd_adapters.server.app import create_app
from minicpm_pcd_adapters.server.settings import ServerSettings
from minicpm_pcd_adapters.teacher import Teacher, TeacherError, TeacherLabel, label_texts, value_confidence
from tests.helpers import served

pytestmark = pytest.mark.slow
ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "examples"))
from ticket import Ticket  # noqa: E402

LABELED = ROOT / "examples/tickets_labeled.jsonl"
TEXTS = [json.loads(line)["text"] for line in LABELED.read_text().splitlines()]


@pytest.fixture(scope="module")
def calibration(engine, tmp_path_factory):
    labels = [json.loads(line)["label"] for line in LABELED.read_text().splitlines()]
    fitted = engine.calibrate(Ticket, TEXTS, labels, method="bias", folds=4)
    path = tmp_path_factory.mktemp("teacher") / "tickets.json"
    fitted.save(path)
    return fitted, path


@pytest.fixture(scope="module")
def teacher_url(engine, calibration):
    settings = ServerSettings(
        model_name="teacher",
        calibrations=(str(calibration[1]),),
        max_queue=1,  # a second waiting request gets 503 with Retry-After
        batch_window_ms=50,
        max_text_chars=2000,
    )
    with served(create_app(engine, settings)) as base:
        yield base


def overloaded(base: str) -> float:
    """How many requests the teacher refused with 503 (overloaded) so far, from its /metrics."""
    text = urllib.request.urlopen(base + "/metrics", timeout=10).read().decode()
    found = re.search(r'^pcd_request_errors_total\{code="overloaded"\} (\S+)$', text, re.MULTILINE)
    return float(found.group(1)) if found else 0.0


@pytest.fixture
def pcd_label(capsys, monkeypatch):
    """Run `pcd label` through the command's own entry point, in this process (no model loads:
    nothing to gain from a fresh interpreter), from the project root; (exit code, stderr)."""
    monkeypatch.chdir(ROOT)

    def run(*args: object) -> tuple[int, str]:
        code = main(["label", *map(str, args)])
        return code, capsys.readouterr().err

    return run


def test_labels_are_the_calibrated_teachers_answers_with_its_probabilities(engine, calibration, teacher_url):
    refused_before = overloaded(teacher_url)
    arrived = []
    teacher = Teacher(teacher_url + "/v1", "teacher", concurrency=6, max_retries=20)
    answers = label_texts(teacher, Ticket, TEXTS[:8], on_answer=arrived.append)
    assert overloaded(teacher_url) > refused_before  # the queue refused some, and the SDK retried them
    assert [a.index for a in answers] == list(range(8)) and sorted(a.index for a in arrived) == list(range(8))
    direct = engine.classify_batch(TEXTS[:8], Ticket, calibration=calibration[0])
    for answer, want in zip(answers, direct, strict=True):
        assert isinstance(answer, TeacherLabel) and answer.model == "teacher"
        assert answer.label == want.value.model_dump(mode="json")
        assert answer.probabilities is not None and answer.confidence is None
        for path, field in want.fields.items():
            assert field.calibrated
            for value, p in field.to_json()["probabilities"].items():
                assert answer.probabilities[path][value] == pytest.approx(p, abs=1e-4)


def test_pcd_label_writes_what_calibrate_reads_and_an_error_record_per_failed_text(
    teacher_url, tmp_path, pcd_label
):
    source = tmp_path / "to_label.jsonl"
    rows = [{"text": t, "id": f"t{i}"} for i, t in enumerate(TEXTS[:5])]
    rows.insert(2, {"text": "x" * 3000, "id": "long"})  # over the teacher's limit: a 400, not retried
    source.write_text("".join(json.dumps(r) + "\n" for r in rows) + "not json\n")
    output = tmp_path / "labeled.jsonl"
    common = ["--schema", "examples/ticket.py:Ticket", "--input", source, "--output", output]
    teacher = ["--teacher-url", teacher_url + "/v1", "--teacher-model", "teacher", "--retries", "20"]
    code, stderr = pcd_label(*common, *teacher, "--concurrency", "4")
    assert code == 1, stderr  # some lines got no label
    labeled = [json.loads(line) for line in output.read_text().splitlines()]
    assert sorted(r["id"] for r in labeled) == [f"t{i}" for i in range(5)]
    assert {r["teacher"]["line"] for r in labeled} == {1, 2, 4, 5, 6}
    assert all(r["teacher"]["model"] == "teacher" and set(r["teacher"]["probabilities"]) for r in labeled)
    assert len(read_labeled(output, "text", "label", Ticket)) == 5  # what `pcd calibrate` reads
    errors = [json.loads(line) for line in (tmp_path / "labeled.errors.jsonl").read_text().splitlines()]
    assert [e["line"] for e in errors] == [3, 7]
    assert errors[0]["error"]["type"] == "BadRequestError" and "2000" in errors[0]["error"]["message"]
    assert errors[1]["error"]["type"] == "InputError"
    assert "5 texts labeled by teacher" in stderr and "2 lines got no label" in stderr


def test_pcd_label_resumes_where_a_run_stopped(teacher_url, tmp_path, pcd_label):
    source = tmp_path / "to_label.txt"
    source.write_text("".join(t + "\n" for t in TEXTS[:6]))
    output = tmp_path / "labeled.jsonl"
    common = ["--schema", "examples/ticket.py:Ticket", "--input", source, "--output", output]
    teacher = ["--teacher-url", teacher_url + "/v1", "--teacher-model", "teacher", "--retries", "20"]
    code, stderr = pcd_label(*common, *teacher, "--concurrency", "1")
    assert code == 0, stderr
    whole = {
        json.loads(line)["teacher"]["line"]: json.loads(line) for line in output.read_text().splitlines()
    }
    kept = output.read_text().splitlines()[:2]
    output.write_text("\n".join(kept) + "\n" + kept[0][:20])  # two lines, and a cut-off third
    code, stderr = pcd_label(*common, *teacher, "--resume")
    assert code == 0, stderr
    assert "4 texts labeled by teacher" in stderr and "(2 kept from before)" in stderr
    resumed = [json.loads(line) for line in output.read_text().splitlines()]
    assert sorted(r["teacher"]["line"] for r in resumed) == [1, 2, 3, 4, 5, 6]
    assert {r["teacher"]["line"]: r["label"] for r in resumed} == {k: r["label"] for k, r in whole.items()}


def test_bad_options_exit_2_before_any_request(tmp_path, pcd_label):
    source = tmp_path / "in.txt"
    source.write_text("hello\n")
    base = ["--input", source, "--output", tmp_path / "o.jsonl", "--teacher-url", "http://127.0.0.1:9/v1"]
    code, stderr = pcd_label("--schema", "examples/ticket.py:Nope", *base, "--teacher-model", "m")
    assert code == 2 and "Nope" in stderr
    code, stderr = pcd_label("--schema", "no_such_module:Ticket", *base, "--teacher-model", "m")
    assert code == 2 and "no_such_module" in stderr and "[teacher]" not in stderr  # not a missing extra
    code, stderr = pcd_label(
        "--schema", "examples/ticket.py:Ticket", *base, "--teacher-model", "m", "--concurrency", "0"
    )
    assert code == 2 and "concurrency" in stderr
    assert not (tmp_path / "o.jsonl").exists()


def test_an_unreachable_teacher_gives_every_text_an_error():
    teacher = Teacher("http://127.0.0.1:9/v1", "m", max_retries=0, timeout=5)
    answers = label_texts(teacher, Ticket, ["a", "b"])
    assert [type(a) for a in answers] == [TeacherError, TeacherError]
    assert answers[0].type == "APIConnectionError"


def test_confidence_is_the_probability_of_the_tokens_that_wrote_each_value():
    content = '{"topic": "billing", "urgent": true}'
    tokens = [('{"', -0.1), ("topic", -0.2), ('":', 0.0), (' "', -0.3), ("bill", -0.5), ("ing", -0.25),
              ('",', -0.1), (' "urgent', 0.0), ('":', 0.0), (" true", -0.7), ("}", 0.0)]  # fmt: skip
    got = value_confidence(content, tokens)
    assert got is not None
    assert got["topic"] == pytest.approx(2.718281828 ** (-0.3 - 0.5 - 0.25 - 0.1))  # ' "', bill, ing, '",'
    assert got["urgent"] == pytest.approx(2.718281828**-0.7)
    assert value_confidence(content, tokens[:-1]) is None  # the tokens do not spell the content
