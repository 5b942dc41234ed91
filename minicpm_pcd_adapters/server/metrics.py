"""The server's Prometheus metrics (`GET /metrics`), in a registry of the app's own."""

from __future__ import annotations

from collections.abc import Callable, Iterator

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector

CacheSizes = Callable[[], dict[str, tuple[int, int]]]


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

    def on_batch(self, size: int, dropped: int) -> None:
        if size:
            self.batch_size.observe(size)
        if dropped:
            self.dropped.inc(dropped)
