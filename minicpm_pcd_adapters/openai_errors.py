"""OpenAI's error body, which every non-2xx answer of `pcd serve` carries (a leaf: no other import)."""

from __future__ import annotations

from typing import Any


class APIError(Exception):
    """An error answered with OpenAI's body: `{"error": {"message", "type", "param", "code"}}`."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        type: str = "invalid_request_error",
        param: str | None = None,
        code: str | None = None,
    ) -> None:
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type, param, code

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}
