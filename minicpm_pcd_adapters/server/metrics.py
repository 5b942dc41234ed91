"""The server's Prometheus metrics (`GET /metrics`), in a registry of the app's own."""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector

from pcd_engine import PCDResult

CacheSizes = Callable[[], dict[str, tuple[int, int]]]
MAX_SCHEMA_LABELS = 64  # distinct schema titles on /metrics; the rest are counted as "other"


class CacheCollector(Collector):
    """`pcd_cache_size` and `pcd_cache_limit` per cache keyed by what clients send (entries, or
    bytes for the prefix cache and the compiled grammars), read when /metrics is scraped."""

    def __init__(self, sizes: CacheSizes) -> None:
        self.sizes = sizes

    def collect(self) -> Iterator[GaugeMetricFamily]:
        size = GaugeMetricFamily("pcd_cache_size", "What a cache holds (entries or bytes)", labels=["cache"])
        limit = GaugeMetricFamily(
            "pcd_cache_limit", "The bound of a cache (entries or bytes)", labels=["cache"]
        )
        for name, (held, bound) in self.sizes().items():
            size.add_metric([name], held)
            limit.add_metric([name], bound)
        yield size
        yield limit


class ServerMetrics:
    """Prometheus metrics in a registry of the app's own (several apps can live in one process)."""

    def __init__(self, queue_depth: Callable[[], int], cache_sizes: CacheSizes | None = None) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        if cache_sizes is not None:
            r.register(CacheCollector(cache_sizes))
        self.requests = Counter(
            "pcd_requests", "Chat completion requests answered", ["kind", "status"], registry=r
        )
        self.errors = Counter("pcd_request_errors", "Requests answered with an error", ["code"], registry=r)
        self.latency = Histogram(
            "pcd_request_latency_seconds",
            "Time from request to answer",
            ["kind"],
            buckets=(0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 300),
            registry=r,
        )
        self.batch_size = Histogram(
            "pcd_batch_size", "Requests per engine batch", buckets=(1, 2, 4, 8, 16, 32, 64, 128), registry=r
        )
        self.dropped = Counter("pcd_dropped_requests", "Queued requests whose caller left first", registry=r)
        self.forward_calls = Counter("pcd_forward_calls", "Forward calls of the model", registry=r)
        queue = Gauge("pcd_queue_depth", "Requests waiting for the model", registry=r)
        queue.set_function(queue_depth)
        self.prompt_tokens = Counter("pcd_prompt_tokens", "Prompt tokens of answered requests", registry=r)
        self.generation_tokens = Counter(
            "pcd_generation_tokens", "Tokens generated (open fields, text answers)", registry=r
        )
        self.answers = Counter(
            "pcd_structured_answers",
            "Structured answers (/classify, response_format)",
            ["schema"],
            registry=r,
        )
        self.needs_review = Counter(
            "pcd_needs_review_answers", "Structured answers with a field below its threshold", ["schema"],
            registry=r,
        )  # fmt: skip
        self.abstained = Counter(
            "pcd_abstained_fields", "Scored fields abstained on (below abstain_below)", ["schema"], registry=r
        )
        self._schemas: set[str] = set()

    def on_tokens(self, prompt: int, generated: int) -> None:
        self.prompt_tokens.inc(prompt)
        self.generation_tokens.inc(generated)

    def on_answers(self, schema: Mapping[str, Any], results: Sequence[PCDResult[Any]]) -> None:
        """Count structured answers, those needing review and the fields abstained on, by the schema's
        title (the first `MAX_SCHEMA_LABELS` titles seen; later ones as "other", so that clients
        sending many schemas cannot grow /metrics without bound)."""
        name = str(schema.get("title") or "untitled")[:64]
        if name not in self._schemas:
            if len(self._schemas) >= MAX_SCHEMA_LABELS:
                name = "other"
            else:
                self._schemas.add(name)
        self.answers.labels(name).inc(len(results))
        self.needs_review.labels(name).inc(sum(r.needs_review for r in results))
        self.abstained.labels(name).inc(sum(len(r.abstained_fields) for r in results))

    def on_batch(self, size: int, dropped: int) -> None:
        if size:
            self.batch_size.observe(size)
        if dropped:
            self.dropped.inc(dropped)
