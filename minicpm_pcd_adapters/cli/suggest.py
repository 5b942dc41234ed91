"""`pcd suggest`: the texts of a file most worth labeling next, written ready to label.

Each suggestion is a line `pcd calibrate` reads once its label is corrected:
`{"text": ..., "label": {...the current best guess...}, "pcd": {"line", "field", "uncertainty",
"sampled"}}` (`sampled`: one of the random share). Rounds: label, `pcd calibrate`, then `pcd suggest
--calibration CAL --labeled LABELED` for the next texts.
An input line that cannot be scored gets an error record (`{"line", "error"}`) in a file beside the
output (`NAME.errors.jsonl`), so that the output stays a clean labeling file.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from tqdm import tqdm

from minicpm_pcd_adapters.cli.options import SETUP_ERRORS, Setup, fail, input_options, set_up
from minicpm_pcd_adapters.files import iter_inputs, write_errors
from pcd_engine import SUGGESTION_SHARE


def add_parser(sub: Any) -> None:
    parser = sub.add_parser("suggest", help="pick the texts most worth labeling next, ready to label")
    input_options(parser, "JSONL file of unlabeled texts (objects with 'text', or strings) or text lines")
    parser.add_argument("--output", required=True, help='JSONL file to write: {"text", "label": the '
                         'current best guess to correct, "pcd"} per suggested text')  # fmt: skip
    parser.add_argument("--count", type=int, default=50, help="how many texts to suggest (default 50)")
    parser.add_argument("--by", choices=("margin", "entropy"), default="margin", help="uncertainty: the "
                         "lowest margin (default) or highest entropy over the fields")  # fmt: skip
    parser.add_argument("--calibration", default=None, help="judge certainty under this calibration")
    parser.add_argument("--labeled", default=None, help="JSONL of texts labeled so far (a labeled file, "
                        "or earlier suggestions): never suggested again, and the new texts are picked "
                        "unlike them (a round: --calibration fitted on them, --labeled)")  # fmt: skip
    parser.add_argument("--share", type=float, default=SUGGESTION_SHARE, help="share of the texts drawn at "
                        f"random, which keeps the labels a sample (default {SUGGESTION_SHARE})")  # fmt: skip
    parser.add_argument("--seed", type=int, default=0, help="seed of the random draws (default 0)")


def main(args: argparse.Namespace) -> int:
    try:
        if args.count < 1:
            raise ValueError(f"--count must be at least 1, got {args.count}")
        if not 0.0 <= args.share <= 1.0:
            raise ValueError(f"--share must be between 0 and 1, got {args.share}")
        if args.labeled is not None and not Path(args.labeled).is_file():
            raise FileNotFoundError(f"--labeled {args.labeled} is not a file")
        setup = set_up(args)
    except SETUP_ERRORS as error:
        return fail(error)
    return run(setup, args)


def run(setup: Setup, args: argparse.Namespace) -> int:
    """Exit codes: 0 every line scored, 1 some lines got error records."""
    records = list(iter_inputs(Path(args.input), args.text_key))
    readable = [r for r in records if "text" in r]
    labeled = []
    if args.labeled is not None:
        labeled = [r["text"] for r in iter_inputs(Path(args.labeled), args.text_key) if "text" in r]
    errors: list[dict[str, Any]] = [{"line": r["line"], "error": r["error"]} for r in records if "error" in r]
    with tqdm(total=len(readable), desc="suggest", unit="text", file=sys.stderr) as bar:
        found = setup.engine.suggest_labels(
            setup.schema,
            [r["text"] for r in readable],
            args.count,
            by=args.by,
            calibration=setup.calibration,
            labeled=labeled,
            share=args.share,
            seed=args.seed,
            progress=bar.update,
            **setup.options,
        )
    for index, error in found.errors.items():
        errors.append(
            {"line": readable[index]["line"], "error": {"type": type(error).__name__, "message": str(error)}}
        )
    output = Path(args.output)
    with output.open("w", encoding="utf-8") as handle:
        for s in found.picked:
            record = s.to_json()
            record["pcd"] = {"line": readable[s.index]["line"], **record["pcd"]}
            del record["pcd"]["index"]
            handle.write(json.dumps(record, ensure_ascii=False) + "\n")
    side = write_errors(output, errors)
    print(
        f"pcd: {len(found.picked)} texts to label -> {output}"
        + (f"; {len(errors)} lines could not be scored -> {side}" if errors else ""),
        file=sys.stderr,
    )
    return 1 if errors else 0
