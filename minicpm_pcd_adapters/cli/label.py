"""`pcd label`: labels from a stronger model behind an OpenAI-compatible endpoint (`teacher.py`).

Reads texts (typically `pcd suggest`'s output, or any JSONL or text file `pcd classify` reads) and
writes the file `pcd calibrate` reads, one line per labeled text as its answer arrives:
`{"text", "label", "teacher": {"model", "line", "probabilities" or "confidence"}}`. A text the
teacher could not label gets an error record in `NAME.errors.jsonl` beside the output (rewritten
each run). `--resume` keeps the output's lines and asks only for the texts it lacks. No local model
is loaded.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path
from typing import Any

from tqdm import tqdm

from minicpm_pcd_adapters.by_name import load_schema
from minicpm_pcd_adapters.cli.options import SETUP_ERRORS, check_paths, fail
from minicpm_pcd_adapters.files import iter_inputs, write_errors
from minicpm_pcd_adapters.teacher import KEY_VARIABLE, Answer, Teacher, TeacherLabel, label_texts


def add_parser(sub: Any) -> None:
    parser = sub.add_parser("label", help="label texts with a stronger model behind an OpenAI-compatible URL")
    parser.add_argument("--schema", required=True, help="module:Class, path/to/file.py:Class, or a JSON "
        "file: a JSON Schema object, or a development set's NAME.schema.json")  # fmt: skip
    parser.add_argument("--input", required=True, help="texts to label: JSONL (objects with 'text', or "
                        "strings; `pcd suggest`'s output) or text lines")  # fmt: skip
    parser.add_argument("--output", required=True, help='labeled JSONL to write: {"text", "label", '
                        '"teacher"} per line, what `pcd calibrate` reads')  # fmt: skip
    parser.add_argument("--text-key", default="text", help="key of the text in JSONL objects")
    parser.add_argument("--teacher-url", required=True, help="the endpoint's base URL, e.g. "
                        "https://api.openai.com/v1 or http://127.0.0.1:8000/v1")  # fmt: skip
    parser.add_argument("--teacher-model", required=True, help="the model name the endpoint serves")
    parser.add_argument("--teacher-key-env", default=KEY_VARIABLE, help="environment variable holding "
                        "the API key (default %(default)s; a local server needs none)")  # fmt: skip
    parser.add_argument("--teacher-instructions", default=None, help="system message sent with each text "
                        "(default: none; a calibrated `pcd serve` teacher must get the prompt it was "
                        "calibrated with)")  # fmt: skip
    parser.add_argument("--concurrency", type=int, default=8, help="requests in flight (default 8)")
    parser.add_argument("--retries", type=int, default=5, help="retries of a request on 408, 409, 429, "
                        "5xx, timeouts and lost connections, with backoff (default 5)")  # fmt: skip
    parser.add_argument("--timeout", type=float, default=120.0, help="seconds per request (default 120)")
    parser.add_argument("--no-logprobs", dest="logprobs", action="store_false", help="do not ask for "
                        "token log-probabilities (for servers that refuse them)")  # fmt: skip
    parser.add_argument("--resume", action="store_true", help="keep the output's labels; ask only "
                        "for the texts it lacks")  # fmt: skip


def main(args: argparse.Namespace) -> int:
    """Exit codes: 0 every text labeled, 1 some got error records, 2 bad options (before any request)."""
    try:
        import openai  # noqa: F401  the [teacher] extra, checked before any request
    except ImportError as error:
        return fail(f"{error}; install the teacher client with: pip install 'minicpm-pcd[teacher]'")
    try:
        check_paths(args)
        schema = load_schema(args.schema)
        key_variable = args.teacher_key_env
        teacher = Teacher(
            args.teacher_url,
            args.teacher_model,
            api_key=os.environ.get(key_variable) if key_variable else None,
            instructions=args.teacher_instructions,
            concurrency=args.concurrency,
            max_retries=args.retries,
            timeout=args.timeout,
            logprobs=args.logprobs,
        )
        done = labeled_lines(Path(args.output)) if args.resume else set()
    except SETUP_ERRORS as error:
        return fail(error)
    records = list(iter_inputs(Path(args.input), args.text_key))
    errors = [{"line": r["line"], "error": r["error"]} for r in records if "error" in r]
    todo = [r for r in records if "text" in r and r["line"] not in done]
    output = Path(args.output)
    labeled = 0
    bar = tqdm(total=len(todo), desc=f"label ({args.teacher_model})", unit="text", file=sys.stderr)
    with output.open("a" if args.resume else "w", encoding="utf-8") as handle, bar:

        def write(answer: Answer) -> None:
            nonlocal labeled
            record = todo[answer.index]
            if isinstance(answer, TeacherLabel):
                line = {"text": record["text"], **answer.to_json()}
                line["teacher"]["line"] = record["line"]
                if "id" in record:
                    line["id"] = record["id"]
                handle.write(json.dumps(line, ensure_ascii=False) + "\n")
                handle.flush()  # a killed run keeps every label written so far
                labeled += 1
            else:
                errors.append({"line": record["line"], **answer.to_json()})
            bar.update(1)

        label_texts(teacher, schema, [r["text"] for r in todo], on_answer=write)
    side = write_errors(output, errors)
    print(
        f"pcd: {labeled} texts labeled by {args.teacher_model} -> {output}"
        + (f" ({len(done)} kept from before)" if done else "")
        + (f"; {len(errors)} lines got no label -> {side}" if errors else ""),
        file=sys.stderr,
    )
    return 1 if errors else 0


def labeled_lines(output: Path) -> set[int]:
    """The input lines an earlier run labeled (its output's `teacher.line`); a cut-off last line is
    dropped from the file so that appending continues it cleanly."""
    if not output.exists():
        return set()
    raw = output.read_bytes()
    complete = raw[: raw.rfind(b"\n") + 1]
    if len(complete) != len(raw):
        output.write_bytes(complete)
    done = set()
    for number, line in enumerate(complete.decode("utf-8").splitlines(), start=1):
        try:
            done.add(int(json.loads(line)["teacher"]["line"]))
        except (ValueError, KeyError, TypeError):
            raise ValueError(f"--resume: {output}:{number} is not a line `pcd label` wrote") from None
    return done
