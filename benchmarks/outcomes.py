"""What every system the benchmarks time returns for one text (`Outcome`), the answer parsed from a
generated string, and the exact prompt our engine feeds (so that other systems get the same tokens).
Shared by `accuracy_latency.py` and `llamacpp.py`, which would otherwise import each other."""

from __future__ import annotations

import json
from typing import Any

from pydantic import BaseModel, ValidationError

from pcd_engine import PCDEngine


class Outcome:
    def __init__(self, seconds: float, value: dict[str, Any] | None, calls: int) -> None:
        self.seconds, self.value, self.calls = seconds, value, calls


def prompt_ids(engine: PCDEngine, schema: type[BaseModel], text: str) -> list[int]:
    plan = engine.plan(schema)
    return [*plan.head, *engine.prompt.encode_text(text), *engine.prompt.tail]


def parse_object(raw: str, schema: type[BaseModel]) -> dict[str, Any] | None:
    start = raw.find("{")
    if start < 0:
        return None
    try:
        data, _ = json.JSONDecoder().raw_decode(raw[start:])
        return schema.model_validate(data).model_dump()
    except (json.JSONDecodeError, ValidationError):
        return None
