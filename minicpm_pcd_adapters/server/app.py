"""`pcd serve`: an OpenAI-compatible HTTP server (FastAPI + uvicorn) in front of one PCDEngine.

    POST /v1/chat/completions   structured answers scored by PCD, plain chat, JSON mode, streaming
    POST /v1/completions        the same after raw prompts (no chat template), a list in one batch
    POST /classify, /v1/classify  vLLM's classification API, with the schema of `--schema`
    POST /tokenize, /detokenize   vLLM's shapes: a prompt or chat messages as the engine renders them
    GET  /v1/models, /v1/models/{id}, /v1/calibrations, /health, /metrics (Prometheus)
    /api/chat, /api/generate, /api/tags, /api/show, /api/version   Ollama's API (server/ollama.py)
    GET  /openapi.json (the request and response bodies, `server/openapi.py`)

What a request asks is read by `server/calls.py` (its body's model: `server/protocol.py`);
concurrent classify requests with the same schema and options are batched into one `classify_batch`
by `server/batching.py` on the model worker thread, so the event loop keeps answering while the
model works. `Guard` (an ASGI middleware) checks the API key (every path but /health, compared in
constant time) and the body size before any route runs. Schemas are JSON only: nothing in a request
is imported or executed, and user text reaches the engine as data (its control-token rule holds here
as everywhere).

    >>> app = create_app(load_smollm2(), ServerSettings(model_name="smollm2"))  # doctest: +SKIP
    >>> uvicorn.run(app, host="127.0.0.1", port=8000)  # doctest: +SKIP
"""

from __future__ import annotations

import functools
import logging
import time
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.exceptions import HTTPException as StarletteHTTPException

from minicpm_pcd_adapters.by_name import load_schema
from minicpm_pcd_adapters.server.batching import Batcher
from minicpm_pcd_adapters.server.calibrations import Calibrations
from minicpm_pcd_adapters.server.classification import ClassificationEndpoint, ServedSchema
from minicpm_pcd_adapters.server.endpoints import ClassifyRunner, CompletionEndpoints
from minicpm_pcd_adapters.server.errors import APIError
from minicpm_pcd_adapters.server.guard import Guard
from minicpm_pcd_adapters.server.memory import MemoryReleaser
from minicpm_pcd_adapters.server.metrics import ServerMetrics
from minicpm_pcd_adapters.server.ollama import OllamaEndpoints, OllamaReader
from minicpm_pcd_adapters.server.openapi import openapi_document
from minicpm_pcd_adapters.server.protocol import (
    Health,
    ModelCard,
    ModelList,
    dump,
)
from minicpm_pcd_adapters.server.settings import ServerSettings
from minicpm_pcd_adapters.server.tokens import TokenEndpoints
from pcd_engine import (
    PCDEngine,
    __version__,
)

log = logging.getLogger("minicpm_pcd.server")


def create_app(engine: PCDEngine, settings: ServerSettings) -> FastAPI:
    """The ASGI app serving `engine` (run it with uvicorn)."""
    settings.check()
    calibrations = Calibrations(engine, settings.calibrations)  # a mismatch fails before serving
    metrics = ServerMetrics(queue_depth=lambda: batcher.depth, cache_sizes=engine.cache_sizes)
    batcher = Batcher(
        ClassifyRunner(engine, calibrations),
        window_s=settings.batch_window_ms / 1000,
        max_batch=settings.max_batch,
        max_queue=settings.max_queue,
        on_batch=metrics.on_batch,
        after_job=(memory := MemoryReleaser(engine.prefix_cache)),
    )
    completions = CompletionEndpoints(engine, settings, batcher, metrics, calibrations)
    served = ServedSchema.of(load_schema(settings.schema), engine) if settings.schema else None
    classification = ClassificationEndpoint(
        served, settings, completions.limits, batcher, metrics, calibrations, completions.template,
    )  # fmt: skip
    tokens = TokenEndpoints(engine, settings.model_name, completions.limits)
    created = int(time.time())
    reader = OllamaReader(settings, completions.limits, completions.template)
    ollama = OllamaEndpoints(completions, reader, engine, metrics, created)

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        hook = engine.model.register_forward_pre_hook(lambda *_: metrics.forward_calls.inc())
        batcher.start()
        try:
            yield
        finally:
            hook.remove()
            batcher.close()

    app = FastAPI(title="minicpm-pcd", lifespan=lifespan, docs_url=None, redoc_url=None)
    app.state.engine, app.state.batcher, app.state.metrics = engine, batcher, metrics
    app.state.memory = memory
    app.openapi = functools.cache(lambda: openapi_document(app.routes, settings, __version__))  # type: ignore[method-assign]

    @app.exception_handler(APIError)
    async def api_error(request: Request, error: APIError) -> JSONResponse:
        metrics.errors.labels(error.code or error.type).inc()
        headers = {"Retry-After": "1"} if error.status == 503 else None
        body = {"error": error.message} if request.url.path.startswith("/api/") else error.body()  # Ollama's
        return JSONResponse(body, status_code=error.status, headers=headers)

    @app.exception_handler(StarletteHTTPException)
    async def route_error(request: Request, error: StarletteHTTPException) -> JSONResponse:  # 404, 405
        code = {404: "not_found", 405: "method_not_allowed"}.get(error.status_code, "http_error")
        message = f"{request.method} {request.url.path}: {error.detail}"
        return await api_error(request, APIError(error.status_code, message, code=code))

    @app.exception_handler(Exception)
    async def server_error(request: Request, error: Exception) -> JSONResponse:
        log.exception("request failed")
        metrics.errors.labels("server_error").inc()
        body = APIError(500, f"internal error: {type(error).__name__}", type="server_error").body()
        return JSONResponse(body, status_code=500)

    @app.get("/health", responses={503: {"model": Health}})
    async def health() -> JSONResponse:
        """200 while the model worker takes work; 503 before the server has started or once the
        worker has stopped, so that a load balancer or Kubernetes probe takes it out of rotation."""
        state = batcher.state
        answer = Health(status=state, model=settings.model_name, queue_depth=batcher.depth)
        return JSONResponse(dump(answer), status_code=200 if state == "ok" else 503)

    @app.get("/metrics")
    async def prometheus() -> Response:
        return Response(generate_latest(metrics.registry), media_type=CONTENT_TYPE_LATEST)

    def model_card() -> ModelCard:
        return ModelCard(
            id=settings.model_name,
            object="model",
            created=created,
            owned_by="minicpm-pcd",
            max_model_len=engine.limits.max_prompt_tokens,
        )

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        return dump(ModelList(object="list", data=[model_card()]))

    @app.get("/v1/models/{model_id:path}")
    async def model(model_id: str) -> dict[str, Any]:
        if model_id != settings.model_name:
            message = f"the model {model_id!r} does not exist"
            raise APIError(404, message, param="model", code="model_not_found")
        return dump(model_card())

    @app.get("/v1/calibrations")
    async def calibration_list() -> dict[str, Any]:
        return dump(calibrations.listing())

    app.post("/v1/chat/completions")(completions.answer)
    app.post("/v1/completions")(completions.answer_text)
    app.post("/classify")(classification)
    app.post("/v1/classify")(classification)
    app.post("/tokenize")(tokens.tokenize)
    app.post("/detokenize")(tokens.detokenize)
    ollama_routes: list[tuple[str, str, Callable[..., Any]]] = [  # Ollama's, not in /openapi.json
        ("/api/chat", "POST", ollama.chat),
        ("/api/generate", "POST", ollama.generate),
        ("/api/show", "POST", ollama.show),
        ("/api/tags", "GET", ollama.tags),
        ("/api/version", "GET", ollama.version),
    ]
    for path, method, route in ollama_routes:
        app.add_api_route(path, route, methods=[method], include_in_schema=False)
    if settings.cors_origins:
        from fastapi.middleware.cors import CORSMiddleware

        origins = list(settings.cors_origins)
        app.add_middleware(CORSMiddleware, allow_origins=origins, allow_methods=["*"], allow_headers=["*"])
    app.add_middleware(Guard, settings=settings, on_refused=lambda code: metrics.errors.labels(code).inc())
    return app
