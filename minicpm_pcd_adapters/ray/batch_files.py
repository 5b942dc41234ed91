"""OpenAI batch files on a Ray cluster: `pcd run-batch --ray`.

The file is cut into parts of consecutive lines. A pool of actors, each with its own engine, answers
the parts: each part through a fresh app of `pcd serve` on the actor's engine, exactly as `pcd
run-batch` answers a whole file (`server/batch_files.py`), into `OUTPUT.parts/part-NNNNN.jsonl`,
always resuming what that part file already holds. An actor that dies is restarted and its part
retried, resuming, so nothing is lost or doubled; a rerun of the command does the same for parts an
interrupted run left. Once every part is whole, the parts are joined in order into `OUTPUT` (written
under a temporary name, then renamed) and removed: the output is the one a single process writes.
"""

from __future__ import annotations

import shutil
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import ray
from ray.util import ActorPool

from minicpm_pcd_adapters.files import count_lines
from minicpm_pcd_adapters.server.batch_files import (
    BatchSummary,
    answered_records,
    repeated_ids,
    run_batch_file,
)
from minicpm_pcd_adapters.server.settings import ServerSettings

RESTARTS = 3  # an actor that dies is restarted, and its part retried, this many times


@dataclass(frozen=True)
class Part:
    index: int
    start: int  # the first line's index (0-based)
    end: int  # past the last line

    def path(self, folder: Path) -> Path:
        return folder / f"part-{self.index:05d}.jsonl"


@ray.remote(max_restarts=RESTARTS, max_task_retries=RESTARTS)
class BatchWorker:
    """One engine, answering parts of the file: each through a fresh app (its lifespan ends with the
    part)."""

    def __init__(self, model: str, settings: ServerSettings, engine_options: Mapping[str, Any]) -> None:
        from minicpm_pcd_adapters.by_name import load_engine

        self.engine = load_engine(model, **dict(engine_options))
        self.settings = settings

    def answer(
        self, source: str, folder: str, part: Part, concurrency: int, repeated: dict[int, int]
    ) -> BatchSummary:
        from minicpm_pcd_adapters.server.app import create_app

        app = create_app(self.engine, self.settings)
        headers = {"Authorization": f"Bearer {self.settings.api_key}"} if self.settings.api_key else {}
        return run_batch_file(
            app,
            Path(source),
            part.path(Path(folder)),
            headers=headers,
            concurrency=concurrency,
            resume=True,
            lines=(part.start, part.end),
            repeated=repeated,
        )


def run_batch_on_ray(
    model: str,
    settings: ServerSettings,
    engine_options: Mapping[str, Any],
    source: Path,
    output: Path,
    *,
    actors: int = 1,
    num_gpus: float = 0,
    concurrency: int = 64,
    part_lines: int = 1000,
    resume: bool = False,
    progress: Callable[[int], None] | None = None,
) -> BatchSummary:
    """Answer `source` into `output` on the cluster `ray.init` joined; the summary of all parts."""
    total = count_lines(source)
    folder = output.with_name(output.name + ".parts")
    if not resume and folder.exists():
        shutil.rmtree(folder)  # an earlier run's parts, not asked to resume
    folder.mkdir(parents=True, exist_ok=True)
    parts = [
        Part(i, start, min(start + part_lines, total)) for i, start in enumerate(range(0, total, part_lines))
    ]
    skipped = sum(min(answered_records(p.path(folder)), p.end - p.start) for p in parts)
    if progress is not None and skipped:
        progress(skipped)
    worker: Any = BatchWorker  # a Ray actor class
    options = {"num_cpus": 1, "num_gpus": num_gpus}
    workers = [worker.options(**options).remote(model, settings, dict(engine_options)) for _ in range(actors)]
    pool = ActorPool(workers)
    summary = BatchSummary(skipped=skipped)

    repeated = ray.put(repeated_ids(source))  # read once, for every part

    def submit(worker: Any, part: Part) -> Any:
        return worker.answer.remote(str(source), str(folder), part, concurrency, repeated)

    for done in pool.map_unordered(submit, parts):
        summary.written += done.written
        summary.failed += done.failed
        if progress is not None:
            progress(done.written)
    _join(parts, folder, output)
    shutil.rmtree(folder)
    return summary


def _join(parts: list[Part], folder: Path, output: Path) -> None:
    """The parts joined in order into `output`, under a temporary name, then renamed."""
    partial = output.with_name(output.name + ".partial")
    with partial.open("wb") as out:
        for part in parts:
            with part.path(folder).open("rb") as lines:
                shutil.copyfileobj(lines, out)
    partial.replace(output)
