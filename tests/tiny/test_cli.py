"""The `pcd` commands, run as a user runs them (`python -m minicpm_pcd_adapters.cli`). First what
they check before a model loads: label keys and values against the schema (file:line from 1, the
nearest field named), a calibration fitted for other fields, a report folder that already holds a
report, a `--resume` with nothing left; and `--schema` reads JSON files. Each refusal exits 2 with one
`pcd: error:` line, writes nothing, and loads no model. Then `pcd suggest` and `pcd calibrate` on the
tiny random Llama saved as a model folder. (`pcd manifest` is in test_loading.py, `pcd classify` on
SmolLM2, killed and resumed, in smollm2/test_smollm2.py.)"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from minicpm_pcd_adapters.by_name import load_schema
from pcd_engine import Calibration, ModelIdentity
from tests.helpers import LABELED_TEXTS as TEXTS

ROOT = Path(__file__).resolve().parents[2]
LABELED = ROOT / "examples" / "tickets_labeled.jsonl"
TICKET = "examples/ticket.py:Ticket"
LOADING = "Loading weights"  # what loading a model writes to stderr (from a GGUF file or a folder)


def pcd(*args: object) -> subprocess.CompletedProcess[str]:
    command = [sys.executable, "-m", "minicpm_pcd_adapters.cli", *map(str, args), "--model", "smollm2"]
    return subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=300, check=False)


def refused(run: subprocess.CompletedProcess[str], *words: str) -> None:
    assert run.returncode == 2, run.stderr
    errors = [line for line in run.stderr.splitlines() if line.startswith("pcd: error:")]
    assert len(errors) == 1 and "Traceback" not in run.stderr, run.stderr
    for word in words:
        assert word in errors[0]
    assert LOADING not in run.stderr  # no model was loaded


def labeled_copy(tmp_path: Path, edit) -> Path:
    rows = [json.loads(line) for line in LABELED.read_text().splitlines()]
    edit(rows)
    path = tmp_path / "labeled.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def test_a_misspelled_label_key_names_the_line_and_the_nearest_field(tmp_path):
    def misspell(rows):
        rows[2]["label"]["sentimnet"] = rows[2]["label"].pop("sentiment")

    path = labeled_copy(tmp_path, misspell)
    run = pcd("calibrate", "--schema", TICKET, "--input", path, "--output", tmp_path / "cal.json")
    refused(run, f"{path}:3:", "'sentimnet'", "did you mean 'sentiment'?")
    assert not (tmp_path / "cal.json").exists()


def test_a_label_value_the_schema_does_not_allow_names_the_allowed_ones(tmp_path):
    path = labeled_copy(tmp_path, lambda rows: rows[0]["label"].update(sentiment="angry"))
    run = pcd("evaluate", "--schema", TICKET, "--input", path, "--report", tmp_path / "report")
    refused(run, f"{path}:1:", '"angry"', '"positive", "neutral", "negative"')
    path = labeled_copy(tmp_path, lambda rows: rows[4]["label"].update(urgent="yes"))
    refused(
        pcd("evaluate", "--schema", TICKET, "--input", path, "--report", tmp_path / "r"), ":5:", "true, false"
    )


def test_a_calibration_for_other_fields_is_refused_before_the_model_loads(tmp_path):
    calibration = Calibration({}, "0" * 64, ModelIdentity("smollm2", "x", ()), {"tone": "option-cc"})
    calibration.save(tmp_path / "cal.json")
    output = tmp_path / "out.jsonl"
    run = pcd(
        "classify",
        "--schema",
        TICKET,
        "--input",
        LABELED,
        "--output",
        output,
        "--calibration",
        tmp_path / "cal.json",
    )
    refused(run, "another schema", "'tone'")
    assert not output.exists()


def test_a_report_folder_is_never_mixed_with_an_earlier_run(tmp_path):
    report = tmp_path / "report"
    report.mkdir()
    (report / "report.json").write_text("{}")
    (report / "reliability_calibrated.png").write_bytes(b"\x89PNG")
    run = pcd("evaluate", "--schema", TICKET, "--input", LABELED, "--report", report)
    refused(run, "already holds a report", "--overwrite")
    assert (report / "reliability_calibrated.png").exists()
    helped = subprocess.run(
        [sys.executable, "-m", "minicpm_pcd_adapters.cli", "evaluate", "--help"],
        capture_output=True, text=True, check=True, cwd=ROOT,
    )  # fmt: skip
    assert "(default: out/evaluate)" in " ".join(helped.stdout.split())


def test_resume_with_nothing_left_exits_at_once(tmp_path):
    source = tmp_path / "in.txt"
    source.write_text("refund me\nwhere is my parcel\n")
    output = tmp_path / "out.jsonl"
    output.write_text('{"line": 1, "value": {}}\n{"line": 2, "value": {}}\n')
    run = pcd("classify", "--schema", TICKET, "--input", source, "--output", output, "--resume")
    assert run.returncode == 0 and "nothing to resume" in run.stderr and LOADING not in run.stderr


def test_schema_files_in_json(tmp_path):
    development = {  # a development set's NAME.schema.json (../shared/data)
        "description": "a set",
        "fields": {
            "category": {"type": "enum", "values": ["account", "delivery"], "description": "What about."},
            "is_question": {"type": "bool"},
        },
    }
    (tmp_path / "tickets_set.schema.json").write_text(json.dumps(development))
    model = load_schema(str(tmp_path / "tickets_set.schema.json"))
    assert model.__name__ == "TicketsSet"
    assert model(category="delivery", is_question=True).model_dump() == {
        "category": "delivery",
        "is_question": True,
    }
    assert model.model_json_schema()["properties"]["category"]["description"] == "What about."
    standard = {
        "title": "Route",
        "type": "object",
        "properties": {"topic": {"enum": ["a", "b"]}},
        "required": ["topic"],
    }
    (tmp_path / "route.json").write_text(json.dumps(standard))
    assert load_schema(str(tmp_path / "route.json"))(topic="b").model_dump() == {"topic": "b"}
    (tmp_path / "bad.json").write_text("{not json")
    with pytest.raises(ValueError, match="not valid JSON"):
        load_schema(str(tmp_path / "bad.json"))
    path = labeled_copy(tmp_path, lambda rows: None)
    run = pcd(
        "evaluate",
        "--schema",
        tmp_path / "tickets_set.schema.json",
        "--input",
        path,
        "--report",
        tmp_path / "r",
    )
    refused(run, ":1:", "no field 'topic'")


def test_pcd_suggest_writes_a_file_that_pcd_calibrate_reads(tiny_folder, tmp_path):
    source = tmp_path / "unlabeled.jsonl"
    lines = [json.dumps({"text": t}) for t in TEXTS] + ["not json"]
    source.write_text("\n".join(lines) + "\n")
    output = tmp_path / "to_label.jsonl"
    schema = f"{ROOT / 'tests' / 'helpers.py'}:Ticket"  # the labeled tests' schema
    run = [sys.executable, "-m", "minicpm_pcd_adapters.cli"]
    done = subprocess.run(
        [*run, "suggest", "--schema", schema, "--input", str(source), "--count", "6", "--output", str(output),
         "--model", tiny_folder, "--device", "cpu"],
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert done.returncode == 1, done.stderr  # one line could not be read: an error record
    rows = [json.loads(line) for line in output.read_text().splitlines()]
    assert len(rows) == 6 and {r["text"] for r in rows} <= set(TEXTS)
    errors = [json.loads(line) for line in (tmp_path / "to_label.errors.jsonl").read_text().splitlines()]
    assert errors == [{"line": len(TEXTS) + 1, "error": errors[0]["error"]}]
    assert "suggest" in done.stderr  # the progress bar
    calibration = tmp_path / "cal.json"
    fitted = subprocess.run(
        [*run, "calibrate", "--schema", schema, "--input", str(output), "--output", str(calibration),
         "--model", tiny_folder, "--device", "cpu", "--method", "temperature", "--folds", "2"],
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert fitted.returncode == 0, fitted.stderr
    assert Calibration.load(calibration).report["fields"]["topic"]["n"] == 6
    assert sum(r["pcd"]["sampled"] for r in rows) == 2  # the random share: round(0.3 * 6)
    after = tmp_path / "next.jsonl"  # a second round: under the calibration, away from the labeled
    again = subprocess.run(
        [*run, "suggest", "--schema", schema, "--input", str(source), "--count", "3", "--output", str(after),
         "--model", tiny_folder, "--device", "cpu", "--calibration", str(calibration),
         "--labeled", str(output)],
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert again.returncode == 1, again.stderr
    picked = [json.loads(line) for line in after.read_text().splitlines()]
    assert len(picked) == 3 and {p["text"] for p in picked} <= set(TEXTS) - {r["text"] for r in rows}
