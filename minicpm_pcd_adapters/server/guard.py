"""The server's guard in front of every route: the API key, then a bounded body."""

from __future__ import annotations

import hmac
from collections.abc import Callable
from typing import Any

from fastapi.responses import JSONResponse

from minicpm_pcd_adapters.server.errors import APIError
from minicpm_pcd_adapters.server.settings import ServerSettings


class Guard:
    """ASGI middleware: the API key, then the body (read whole, at most `max_body_bytes`)."""

    def __init__(self, app: Any, settings: ServerSettings, on_refused: Callable[[str], None]) -> None:
        self.app, self.settings, self.on_refused = app, settings, on_refused
        self.key = settings.api_key.encode() if settings.api_key else None

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        headers = dict(scope["headers"])
        if self.key is not None and scope["path"] != "/health":
            given = headers.get(b"authorization", b"")
            if not hmac.compare_digest(given, b"Bearer " + self.key):
                error = APIError(401, "missing or incorrect API key", code="invalid_api_key")
                return await self._refuse(send, error)
        body, more = b"", scope["method"] in ("POST", "PUT", "PATCH")
        declared = headers.get(b"content-length", b"0")
        if declared.isdigit() and int(declared) > self.settings.max_body_bytes:
            more = False
            return await self._refuse(send, self._too_large())
        while more:
            message = await receive()
            if message["type"] == "http.disconnect":
                return None
            body += message.get("body", b"")
            more = message.get("more_body", False)
            if len(body) > self.settings.max_body_bytes:
                return await self._refuse(send, self._too_large())
        replayed = False

        async def replay() -> dict[str, Any]:
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": body, "more_body": False}
            return await receive()  # then the client's disconnect

        return await self.app(scope, replay, send)

    def _too_large(self) -> APIError:
        return APIError(
            413, f"the request body is over {self.settings.max_body_bytes} bytes", code="request_too_large"
        )

    async def _refuse(self, send: Any, error: APIError) -> None:
        self.on_refused(error.code or "error")
        await JSONResponse(error.body(), status_code=error.status)({"type": "http"}, _no_body, send)


async def _no_body() -> dict[str, Any]:
    return {"type": "http.request", "body": b"", "more_body": False}
