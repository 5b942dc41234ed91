"""`pcd serve`: the OpenAI-compatible server (server/app.py; the [server] extra), or its Ray Serve
deployment (`--ray`; the [ray] extra)."""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path
from typing import Any

from minicpm_pcd_adapters.by_name import load_engine, load_schema
from minicpm_pcd_adapters.cli.options import (
    SETUP_ERRORS,
    engine_options,
    fail,
    model_options,
    portable_schema,
)
from minicpm_pcd_adapters.server.settings import ServerSettings
from pcd_engine import Calibration


def add_parser(sub: Any) -> None:
    parser = sub.add_parser("serve", help="serve the model over an OpenAI-compatible HTTP API")
    defaults = ServerSettings(model_name="")
    model_options(parser)
    add = parser.add_argument
    add("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1: this machine only)")
    add("--port", type=int, default=8000, help="port to listen on (default 8000)")
    add("--api-key", default=os.environ.get("PCD_API_KEY"), help="require 'Authorization: Bearer KEY' on "
        "every endpoint but /health (default: $PCD_API_KEY; none: no key)")  # fmt: skip
    add("--served-model-name", default=None, help="the model id clients send and /v1/models lists "
        "(default: the --model value)")  # fmt: skip
    add("--instructions", default=None, help="system instructions for requests without a system message")
    add("--abstain-below", type=float, default=None, help="flag scored fields below this confidence "
        "(choice.pcd.abstained_fields); a request can set its own in its 'pcd' object")  # fmt: skip
    add("--no-generation", action="store_true", help="refuse schemas with open fields")
    add("--batch-window-ms", type=float, default=defaults.batch_window_ms, help="how long a structured "
        "request waits for others with the same schema to share its batch (default %(default)s)")  # fmt: skip
    add("--max-batch", type=int, default=defaults.max_batch, help="requests per batch (default %(default)s)")
    add("--max-queue", type=int, default=defaults.max_queue, help="requests waiting for the model; more get "
        "503 with Retry-After (default %(default)s)")  # fmt: skip
    add("--request-timeout", type=float, default=defaults.request_timeout_s, help="seconds before an "
        "unanswered request gets 504 (default %(default)s)")  # fmt: skip
    add("--max-body-bytes", type=int, default=defaults.max_body_bytes, help="larger bodies get 413 "
        "(default %(default)s)")  # fmt: skip
    add("--max-text-chars", type=int, default=defaults.max_text_chars, help="characters of all messages "
        "of a request together (default %(default)s)")  # fmt: skip
    add("--max-tokens", type=int, default=defaults.max_tokens, help="default answer length of plain chat "
        "(default %(default)s)")  # fmt: skip
    add("--max-completion-tokens", type=int, default=defaults.max_completion_tokens, help="the most a "
        "request may ask for as max_tokens; more get 400 (default %(default)s)")  # fmt: skip
    add("--ray", action="store_true", help="run as a Ray Serve deployment (the [ray] extra): Serve's proxy "
        "listens on --host/--port and spreads requests over --replicas copies, each with its own "
        "engine")  # fmt: skip
    add("--replicas", type=int, default=1, help="with --ray: server replicas (default 1)")
    add("--ray-address", default=None, help="with --ray: the cluster to join (default: a local one)")
    add("--num-gpus", type=float, default=0, help="with --ray: GPUs per replica (default 0)")
    add("--cors-origin", action="append", default=[], help="allow browser calls from this origin "
        "(repeatable; default: CORS off)")  # fmt: skip
    add("--schema", default=None, help="the schema POST /classify answers with (vLLM's classification "
        "API): module:Class, path/to/file.py:Class or a JSON-schema file; planned before the port "
        "opens")  # fmt: skip
    add("--calibration", nargs="+", default=[], metavar="FILE", help="calibration files (`pcd calibrate`): "
        "each is checked against the model before the port opens (a mismatch exits 2); a structured "
        "request uses the one fitted for its schema and instructions (GET /v1/calibrations)")  # fmt: skip


def main(args: argparse.Namespace) -> int:
    """Load the model, then serve until interrupted (exit 0), or exit 2 before loading on bad options."""
    try:
        import uvicorn

        from minicpm_pcd_adapters.server.app import create_app
    except ImportError as error:
        print(
            f"pcd: error: {error}; install the server extra: pip install 'minicpm-pcd[server]'",
            file=sys.stderr,
        )
        return 2
    settings = ServerSettings(
        model_name=args.served_model_name or args.model,
        api_key=args.api_key or None,
        batch_window_ms=args.batch_window_ms,
        max_batch=args.max_batch,
        max_queue=args.max_queue,
        request_timeout_s=args.request_timeout,
        max_body_bytes=args.max_body_bytes,
        max_text_chars=args.max_text_chars,
        max_tokens=args.max_tokens,
        max_completion_tokens=args.max_completion_tokens,
        cors_origins=tuple(args.cors_origin),
        calibrations=tuple(str(Path(f).resolve()) for f in args.calibration),  # for Ray replicas too
        schema=portable_schema(args.schema),
    )
    options = {
        **engine_options(args),
        "instructions": args.instructions,
        "abstain_below": args.abstain_below,
        "allow_generation": False if args.no_generation else None,
    }
    if settings.api_key is None and not _loopback(args.host):
        print(f"pcd: warning: serving on {args.host} without --api-key: anyone who reaches it can use it",
              file=sys.stderr)  # fmt: skip
    if args.ray:
        return _serve_on_ray(args, settings, options)  # each replica's load_engine drops Nones
    try:  # options, schema and calibration files before the model loads; the model's match before serving
        settings.check()
        if settings.schema is not None:
            load_schema(settings.schema)
        for path in settings.calibrations:
            Calibration.load(path)
        engine = load_engine(args.model, **options)
        app = create_app(engine, settings)
    except SETUP_ERRORS as error:
        return fail(error)
    uvicorn.run(app, host=args.host, port=args.port, log_level="info")
    return 0


def _serve_on_ray(args: argparse.Namespace, settings: ServerSettings, options: dict[str, Any]) -> int:
    try:
        import ray
        from ray import serve

        from minicpm_pcd_adapters.ray.serve import pcd_application

        application = pcd_application(
            args.model,
            settings,
            replicas=args.replicas,
            num_gpus=args.num_gpus,
            engine_options=options,
        )
    except (ImportError, ValueError) as error:
        print(f"pcd: error: {error} (pcd serve --ray needs the [ray] extra)", file=sys.stderr)
        return 2
    ray.init(address=args.ray_address)
    try:
        serve.start(http_options={"host": args.host, "port": args.port})
        serve.run(application, name="pcd", route_prefix="/", blocking=True)
    except KeyboardInterrupt:
        pass
    finally:
        serve.shutdown()
        ray.shutdown()
    return 0


def _loopback(host: str) -> bool:
    return host in ("localhost", "::1") or host.startswith("127.")
