"""Issue-33 benchmark: a student calibrated on a teacher's labels (`pcd label`) against the same student
calibrated on true labels, and the teacher's own accuracy (SmolLM2-135M-Instruct, CPU, FP32).

Per development set, the rows are scored once with hidden states (`benchmarks/labels.py`'s cache,
shared). The last `--test` rows (100) are never fitted on. The teacher is a calibrated `pcd serve`
on 127.0.0.1: SmolLM2 with `auto` (heads allowed) fitted on the true labels of the first 200 rows.
Its labels come through HTTP, exactly as `pcd label` gets them (`teacher.label_texts`, the openai
SDK). The student is SmolLM2 again, `auto` fitted on 50 or 200 of those rows, once with the teacher's
labels and once with the true labels. Printed: test-row field accuracy / ECE of each, the teacher's
own on the test rows, and how often the teacher's labels were right on the texts it labeled (these
are the rows its head was fitted on, so this is in-sample for the teacher).

    python benchmarks/teacher.py --json out/teacher.json
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.labels import figures, scored_set
from minicpm_pcd_adapters import load_smollm2
from minicpm_pcd_adapters.server.app import create_app
from minicpm_pcd_adapters.server.settings import ServerSettings
from minicpm_pcd_adapters.teacher import Teacher, TeacherLabel, label_texts
from pcd_engine import PCDEngine
from pcd_engine.fitting import decision_labels, fit
from pcd_engine.results import json_key
from tests.helpers import served


def student(engine: PCDEngine, plan: Any, scored: list, labels: Any, fit_idx: list[int], test_idx: list[int]):
    """`auto` fitted on `labels[i]` of the rows i in `fit_idx`, its answers on the rows `test_idx`."""
    cal = fit(
        plan,
        engine.model_identity,
        [scored[i][0] for i in fit_idx],
        [labels[i] for i in fit_idx],
        "auto",
        hidden=[scored[i][1] for i in fit_idx],
    )
    return [cal.apply(scored[i][0], scored[i][1]) for i in test_idx], cal


def run_set(engine: PCDEngine, name: str, args: argparse.Namespace) -> dict[str, Any]:
    schema, rows, plan, scored, truth = scored_set(engine, name, Path(args.cache))
    test_idx = list(range(len(rows) - args.test, len(rows)))
    pool = list(range(args.teacher_labels))
    teacher_answers, teacher_cal = student(engine, plan, scored, truth, pool, test_idx)
    out: dict[str, Any] = {"teacher": figures(plan, teacher_answers, [truth[i] for i in test_idx])["mean"]}
    with tempfile.TemporaryDirectory() as folder:
        path = Path(folder) / f"{name}.json"
        teacher_cal.save(path)
        settings = ServerSettings(model_name="teacher", calibrations=(str(path),))
        with served(create_app(engine, settings)) as base:
            started = time.perf_counter()
            answers = label_texts(
                Teacher(base + "/v1", "teacher", concurrency=4), schema, [rows[i]["text"] for i in pool]
            )
            seconds = time.perf_counter() - started
    failed = [a for a in answers if not isinstance(a, TeacherLabel)]
    if failed:
        raise RuntimeError(f"{name}: the teacher could not label {len(failed)} texts: {failed[0]}")
    taught = {i: decision_labels(plan.compiled, a.label, i) for i, a in zip(pool, answers, strict=True)}
    paths = [dp.decision.path for dp in plan.scored_decisions]
    agreement = statistics.fmean(
        statistics.fmean(json_key(taught[i][p]) == json_key(truth[i][p]) for p in paths) for i in pool
    )
    in_process = [teacher_cal.apply(scored[i][0], scored[i][1]) for i in pool]  # what it should answer
    same = statistics.fmean(
        json_key(taught[i][p]) == json_key(fields[p].value)
        for i, fields in zip(pool, in_process, strict=True)
        for p in paths
    )
    if same < 0.99:
        raise RuntimeError(f"{name}: the served teacher agrees with its calibration in-process on {same:.3f}")
    out["teacher_label_accuracy"] = agreement
    out["label_seconds"] = seconds
    print(
        f"{name}: teacher (auto on {len(pool)} true labels) on the test rows: "
        f"{out['teacher']['accuracy']:.3f} / ECE {out['teacher']['ece']:.3f}; its labels of the "
        f"{len(pool)} texts agree with the truth on {agreement:.3f} of fields (in-sample); "
        f"labeled over HTTP in {seconds:.0f} s",
        flush=True,
    )
    for count in args.counts:
        draws = 1 if count >= len(pool) else args.seeds
        result: dict[str, list[dict[str, float]]] = {"teacher_labels": [], "true_labels": []}
        for seed in range(draws):
            fit_idx = sorted(random.Random(seed).sample(pool, count))
            for kind, labels in (("teacher_labels", taught), ("true_labels", truth)):
                answers_test, _ = student(engine, plan, scored, labels, fit_idx, test_idx)
                result[kind].append(figures(plan, answers_test, [truth[i] for i in test_idx])["mean"])
        means = {
            kind: {k: statistics.fmean(r[k] for r in runs) for k in ("accuracy", "macro_f1", "ece")}
            for kind, runs in result.items()
        }
        out[str(count)] = means
        taught_fig, true_fig = means["teacher_labels"], means["true_labels"]
        print(
            f"{name} {count:>4} labels: student on teacher labels {taught_fig['accuracy']:.3f} / "
            f"ECE {taught_fig['ece']:.3f}; on true labels {true_fig['accuracy']:.3f} / "
            f"ECE {true_fig['ece']:.3f} ({draws} draw{'s' if draws > 1 else ''})",
            flush=True,
        )
    return out


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--sets", nargs="+", default=["bitext_customer_support", "banking77"])
    parser.add_argument("--test", type=int, default=100, help="rows never fitted on (the last ones)")
    parser.add_argument(
        "--teacher-labels", type=int, default=200, help="true labels the teacher is fitted on"
    )
    parser.add_argument("--counts", type=int, nargs="+", default=[50, 200], help="teacher labels per student")
    parser.add_argument("--seeds", type=int, default=3, help="random draws below the whole pool")
    parser.add_argument("--cache", default="out/labels-cache", help="benchmarks/labels.py's scored rows")
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    engine = load_smollm2()
    results = {name: run_set(engine, name, args) for name in args.sets}
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
