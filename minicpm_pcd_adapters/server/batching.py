"""Batching across callers: requests that can share one engine batch wait a few milliseconds for company.

The server's event loop never runs the model. Work goes to one model worker thread, one job at a
time, in the order jobs asked for it (a FIFO lock). A classify request joins the pending group of its
key (same schema and options); the group's first request starts a short window (`window_s`, at most
half the time that request can still wait), then the whole group, up to `max_batch`, becomes one job.
Requests that arrive while the model is busy join the next group, so batches grow with the load.
A request whose caller gave up (disconnected, timed out) before its job starts is dropped from it;
more than `max_queue` requests waiting raises `QueueFull` at once (the server answers 503).

    >>> async def main():
    ...     batcher = Batcher(lambda key, items: [item * 2 for item in items], window_s=0.01)
    ...     return await asyncio.gather(*(batcher.submit("k", n, timeout=5) for n in range(3)))
    >>> asyncio.run(main())
    [0, 2, 4]
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Hashable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, Literal, TypeVar

R = TypeVar("R")
State = Literal["starting", "ok", "stopped"]


class QueueFull(Exception):
    """More requests are waiting than the batcher holds."""


@dataclass
class _Waiting:
    payload: Any
    future: asyncio.Future[Any]
    deadline: float  # loop time after which the caller no longer waits


class Batcher:
    """Groups payloads by key and runs `run(key, payloads) -> results` (one result per payload, in
    order) on the model worker. `on_batch(size, dropped)` reports each job run; `after_job()` runs on
    the worker after each job, batched or exclusive (memory.MemoryReleaser)."""

    def __init__(
        self,
        run: Callable[[Hashable, list[Any]], Sequence[Any]],
        *,
        window_s: float = 0.005,
        max_batch: int = 64,
        max_queue: int = 256,
        on_batch: Callable[[int, int], None] | None = None,
        after_job: Callable[[], None] | None = None,
    ) -> None:
        if window_s < 0 or max_batch < 1 or max_queue < 1:
            raise ValueError("window_s must be >= 0, max_batch and max_queue >= 1")
        self._run = run
        self.window_s, self.max_batch, self.max_queue = window_s, max_batch, max_queue
        self._on_batch = on_batch
        self._after_job = after_job
        self._pending: dict[Hashable, list[_Waiting]] = {}
        self._waiting = 0  # requests queued and not yet handed to the model
        self._worker = ThreadPoolExecutor(1, thread_name_prefix="pcd-model")
        self._turn: asyncio.Lock | None = None  # created on the server's loop
        self._tasks: set[asyncio.Task[None]] = set()
        self._started = self._closed = False

    @property
    def state(self) -> State:
        """ "starting" until `start()` (the server's start-up), "ok" while the worker takes work,
        "stopped" once it has been closed (what /health answers)."""
        return "stopped" if self._closed else "ok" if self._started else "starting"

    def start(self) -> None:
        self._started = True

    @property
    def depth(self) -> int:
        """Requests waiting for the model (queued or in a window)."""
        return self._waiting

    async def submit(self, key: Hashable, payload: Any, timeout: float) -> Any:
        """The payload's result once its group has run; QueueFull when the queue is full."""
        self._admit()
        loop = asyncio.get_running_loop()
        waiting = _Waiting(payload, loop.create_future(), loop.time() + timeout)
        group = self._pending.get(key)
        if group is None:
            group = self._pending[key] = []
            self._spawn(self._drain(key, self.window_s))
        group.append(waiting)
        self._waiting += 1
        return await asyncio.wait_for(waiting.future, timeout)  # cancelled on timeout: dropped

    async def exclusive(self, work: Callable[[], R]) -> R:
        """Run `work()` alone on the model worker, in turn with the batches."""
        self._admit()
        self._waiting += 1
        started = False
        try:
            async with self._lock():
                self._waiting -= 1
                started = True
                return await asyncio.get_running_loop().run_in_executor(self._worker, self._job, work)
        finally:
            if not started:
                self._waiting -= 1

    def _job(self, work: Callable[..., R], *args: Any) -> R:
        """`work(*args)` on the model worker, then `after_job`, whatever became of the work."""
        try:
            return work(*args)
        finally:
            if self._after_job is not None:
                self._after_job()

    def close(self) -> None:
        self._closed = True
        self._worker.shutdown(wait=False, cancel_futures=True)

    def _admit(self) -> None:
        if self._waiting >= self.max_queue:
            raise QueueFull(f"{self._waiting} requests are waiting (max_queue={self.max_queue})")

    def _lock(self) -> asyncio.Lock:
        if self._turn is None:
            self._turn = asyncio.Lock()
        return self._turn

    def _spawn(self, coroutine: Any) -> None:
        task = asyncio.get_running_loop().create_task(coroutine)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _drain(self, key: Hashable, window: float) -> None:
        loop = asyncio.get_running_loop()
        first = self._pending[key][0]
        await asyncio.sleep(max(0.0, min(window, (first.deadline - loop.time()) / 2)))
        async with self._lock():
            group = self._pending.pop(key)
            taken, rest = group[: self.max_batch], group[self.max_batch :]
            if rest:  # the overflow forms the next group at once
                self._pending[key] = rest
                self._spawn(self._drain(key, 0.0))
            self._waiting -= len(taken)
            live = [w for w in taken if not w.future.done()]
            if self._on_batch is not None:
                self._on_batch(len(live), len(taken) - len(live))
            if not live:
                return
            try:
                payloads = [w.payload for w in live]
                results = await loop.run_in_executor(self._worker, self._job, self._run, key, payloads)
            except asyncio.CancelledError:  # the server is shutting down
                for w in live:
                    w.future.cancel()
                raise
            except Exception as error:  # the job failed as a whole: every caller in it hears why
                for w in live:
                    if not w.future.done():
                        w.future.set_exception(error)
                return
            for w, result in zip(live, results, strict=True):
                if not w.future.done():
                    w.future.set_result(result)
