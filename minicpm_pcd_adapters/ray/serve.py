"""`pcd serve` as a Ray Serve deployment: N replicas of the same app, each with its own engine, batcher
and metrics (the `[ray]` extra). Ray Serve's proxy spreads requests over the replicas; the HTTP API is
the plain server's (docs/server.md), so the same clients work.

    >>> from ray import serve
    >>> serve.start(http_options={"host": "127.0.0.1", "port": 8000})  # doctest: +SKIP
    >>> settings = ServerSettings(model_name="minicpm5-2b")
    >>> serve.run(pcd_application("minicpm5-2b", settings, replicas=2))  # doctest: +SKIP

From the command line: `pcd serve --ray --replicas 2 [--ray-address ADDR] [--num-gpus 1]`.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from ray import serve

from minicpm_pcd_adapters.server.settings import ServerSettings


@serve.ingress()
class PCDReplica:
    """One replica: loads the engine, then serves `create_app(engine, settings)` (built on the replica)."""

    def __init__(self, model: str, settings: ServerSettings, engine_options: Mapping[str, Any]) -> None:
        from minicpm_pcd_adapters.by_name import load_engine
        from minicpm_pcd_adapters.server.app import create_app

        self.asgi = create_app(load_engine(model, **dict(engine_options)), settings)

    def __serve_build_asgi_app__(self) -> Any:
        return self.asgi


def pcd_application(
    model: str,
    settings: ServerSettings,
    *,
    replicas: int = 1,
    num_cpus: float = 1,
    num_gpus: float = 0,
    engine_options: Mapping[str, Any] | None = None,
) -> Any:
    """The Ray Serve application to `serve.run`: `replicas` copies of the server, each with `num_cpus`
    CPUs and `num_gpus` GPUs; a replica that dies is replaced by Serve."""
    settings.check()
    if replicas < 1:
        raise ValueError(f"replicas must be at least 1, got {replicas}")
    deployment: Any = serve.deployment(
        PCDReplica,
        name="pcd",
        num_replicas=replicas,
        ray_actor_options={"num_cpus": num_cpus, "num_gpus": num_gpus},
        max_ongoing_requests=settings.max_queue,  # the replica's own queue answers 503 beyond it
    )
    return deployment.bind(model, settings, dict(engine_options or {}))
