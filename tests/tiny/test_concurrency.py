"""One engine, many threads: the same answers as sequential calls, and a request that fails or is
interrupted in the middle of model work leaves the prefix cache usable (tiny random Llama)."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import pytest
from pydantic import BaseModel

from pcd_engine import PCDEngine
from tests.helpers import TEXTS, Shipping, Ticket, assert_same_scores


def test_eight_threads_on_a_cold_engine_give_the_sequential_answers(tiny_model, tiny_tokenizer):
    jobs = [(text, schema) for text in TEXTS for schema in (Ticket, Shipping)]
    reference = PCDEngine(tiny_model, tiny_tokenizer)
    want = [reference.classify(text, schema) for text, schema in jobs]
    shared = PCDEngine(tiny_model, tiny_tokenizer)  # cold: threads race to compute each schema's head
    with ThreadPoolExecutor(8) as pool:
        got = list(pool.map(lambda job: shared.classify(*job), jobs))
    assert_same_scores(got, want, tol=1e-5)
    batches = list(pool_map_batches(shared, Ticket))
    assert_same_scores([r for batch in batches for r in batch], want[::2] * 2, tol=1e-5)


def pool_map_batches(engine: PCDEngine, schema: type[BaseModel]):
    with ThreadPoolExecutor(2) as pool:
        yield from pool.map(lambda _: engine.classify_batch(TEXTS, schema), range(2))


@pytest.mark.parametrize("interruption", [RuntimeError("out of memory"), KeyboardInterrupt()])
def test_a_request_stopped_during_model_work_leaves_the_prefix_cache_usable(
    tiny_model, tiny_tokenizer, monkeypatch, interruption
):
    engine = PCDEngine(tiny_model, tiny_tokenizer)
    want = PCDEngine(tiny_model, tiny_tokenizer, prefix_cache=False).classify(TEXTS[1], Ticket)
    engine.classify(TEXTS[0], Ticket)  # the head is cached now
    real_run = engine.runner.run

    def fails_midway(*args, **kwargs):
        real_run(*args, **kwargs)  # the forward call ran on the cached head ...
        raise interruption  # ... and then the request was stopped

    monkeypatch.setattr(engine.runner, "run", fails_midway)
    with pytest.raises(type(interruption)):
        engine.classify(TEXTS[1], Ticket)
    monkeypatch.undo()
    again = engine.classify(TEXTS[1], Ticket)
    assert again.diagnostics.prefix_cache_hit
    assert_same_scores([again], [want], tol=1e-5)
