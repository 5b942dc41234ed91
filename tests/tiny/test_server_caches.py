"""Caches keyed by what clients send stay bounded: 1,000 distinct schemas and system texts through a
real `pcd serve` (tiny model) leave every cache at its limit, as /metrics says, and the memory the
prefix cache evicted is handed back to the system; `clear_caches` empties them and the next request is
answered as before."""

from __future__ import annotations

import asyncio

import httpx
import pytest

from minicpm_pcd_adapters.server.app import create_app
from minicpm_pcd_adapters.server.settings import ServerSettings
from pcd_engine import PCDEngine, PrefixCache
from pcd_engine.output_types import DICT_MODELS
from tests.helpers import served

REQUESTS = 1_000


def body(i: int) -> dict:
    schema = {
        "type": "object",
        "properties": {"label": {"enum": [f"yes{i}", f"no{i}"]}, "urgent": {"type": "boolean"}},
        "required": ["label", "urgent"],
    }
    return {
        "model": "tiny",
        "messages": [{"role": "system", "content": f"Route message {i}."}, {"role": "user", "content": "hi"}],
        "response_format": {"type": "json_schema", "json_schema": {"name": f"S{i}", "schema": schema}},
    }


def cache_metrics(url: str) -> dict[str, dict[str, float]]:
    out: dict[str, dict[str, float]] = {"pcd_cache_size": {}, "pcd_cache_limit": {}}
    for line in httpx.get(url + "/metrics").text.splitlines():
        for name, found in out.items():
            if line.startswith(name + "{"):
                label = line.split('cache="', 1)[1].split('"', 1)[0]
                found[label] = float(line.rsplit(" ", 1)[1])
    return out


def test_a_thousand_distinct_schemas_and_system_texts_leave_the_caches_at_their_limits(
    tiny_model, tiny_tokenizer
):
    measured = PCDEngine(tiny_model, tiny_tokenizer, rule="option")
    measured.classify("hi", body(0)["response_format"]["json_schema"]["schema"])
    head_bytes = measured.prefix_cache.nbytes  # one head's KV: the cache below keeps 8 and evicts
    engine = PCDEngine(tiny_model, tiny_tokenizer, rule="option", prefix_cache=PrefixCache(8 * head_bytes))
    app = create_app(engine, ServerSettings(model_name="tiny", batch_window_ms=1))
    app.state.memory.every_bytes = 100 * head_bytes
    with served(app) as url:

        async def send_all() -> list[int]:
            limit = asyncio.Semaphore(8)
            async with httpx.AsyncClient(base_url=url, timeout=120) as client:

                async def one(i: int) -> int:
                    async with limit:
                        return (await client.post("/v1/chat/completions", json=body(i))).status_code

                return await asyncio.gather(*(one(i) for i in range(REQUESTS)))

        statuses = asyncio.run(send_all())
        assert statuses == [200] * REQUESTS
        sizes = engine.cache_sizes()
        for name in ("plans", "json_schema_models"):  # more distinct keys than room: full
            held, bound = sizes[name]
            assert held == bound < REQUESTS, name
        assert sizes["prefix_bytes"][0] <= sizes["prefix_bytes"][1]
        evicted = engine.prefix_cache.stats.evicted_bytes
        assert evicted > REQUESTS // 2 * head_bytes  # most heads were dropped again: the cache stays full
        assert 5 <= app.state.memory.trims <= evicted // (100 * head_bytes)  # a trim per 100 heads dropped
        assert sizes["grammar_bytes"][0] <= sizes["grammar_bytes"][1]
        published = cache_metrics(url)
        assert published["pcd_cache_size"]["plans"] == sizes["plans"][0]
        assert published["pcd_cache_limit"]["plans"] == sizes["plans"][1]
        assert set(published["pcd_cache_size"]) == set(sizes)

        engine.clear_caches()
        assert all(held == 0 for held, _ in engine.cache_sizes().values())
        again = httpx.post(url + "/v1/chat/completions", json=body(REQUESTS - 1), timeout=60)
        assert again.status_code == 200 and again.json()["choices"][0]["message"]["content"]
    assert len(DICT_MODELS) >= 1


@pytest.mark.parametrize("bound", [0, -1, True])
def test_a_cache_bound_must_be_a_positive_count(bound):
    from pcd_engine.bounded_cache import BoundedCache

    with pytest.raises(ValueError, match="max_entries"):
        BoundedCache(bound)


def test_priors_are_bounded_and_an_evicted_plan_s_are_computed_again(tiny_model, tiny_tokenizer):
    from pcd_engine.bounded_cache import BoundedCache

    engine = PCDEngine(tiny_model, tiny_tokenizer, rule="option-cc")
    engine.scorer.priors_cache = BoundedCache(2)
    engine.pipeline.plans.plans = BoundedCache(2)
    schemas = [body(i)["response_format"]["json_schema"]["schema"] for i in range(3)]
    first = engine.classify("hi", schemas[0])
    for schema in schemas[1:]:
        engine.classify("hi", schema)
    assert engine.cache_sizes()["priors"] == (2, 2) and engine.cache_sizes()["plans"] == (2, 2)
    again = engine.classify("hi", schemas[0])  # its plan and priors were evicted: built again
    for path, field in first.fields.items():
        assert again.fields[path].log_scores == pytest.approx(field.log_scores, abs=1e-5)
