"""What `pcd serve` is configured with: kept apart from the server so that the CLI can read and check
its options without the `[server]` extra installed."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class ServerSettings:
    """What `pcd serve` is configured with (each is a command-line option of the same name)."""

    model_name: str  # the id clients send as `model` and /v1/models lists
    api_key: str | None = None  # required as `Authorization: Bearer <key>` on all but /health
    batch_window_ms: float = 5.0  # how long a classify request waits for others with its schema
    max_batch: int = 64  # requests per engine batch
    max_queue: int = 256  # requests waiting for the model; beyond it: 503 with Retry-After
    request_timeout_s: float = 300.0  # a request not answered by then gets 504
    max_body_bytes: int = 2_000_000
    max_text_chars: int = 100_000  # all message contents of a request together
    max_tokens: int = 512  # default answer length of plain chat
    max_completion_tokens: int = 4096  # the most a request may ask for (max_tokens); more: 400
    cors_origins: tuple[str, ...] = ()  # CORS is off unless origins are given
    calibrations: tuple[str, ...] = ()  # calibration files (`pcd calibrate`), checked at start-up
    schema: str | None = None  # what /classify answers with: module:Class, file.py:Class or a .json file

    def check(self) -> None:
        """ValueError naming the first option out of range."""
        checks = {
            "batch_window_ms": self.batch_window_ms >= 0,
            "max_batch": self.max_batch >= 1,
            "max_queue": self.max_queue >= 1,
            "request_timeout_s": self.request_timeout_s > 0,
            "max_body_bytes": self.max_body_bytes >= 1024,
            "max_text_chars": self.max_text_chars >= 1,
            "max_tokens": 1 <= self.max_tokens <= self.max_completion_tokens,
        }
        for name, ok in checks.items():
            if not ok:
                raise ValueError(f"server option {name}={getattr(self, name)!r} is out of range")
        if not self.model_name:
            raise ValueError("the server needs a model name")
