"""The labeled development sets in ../shared/data: rows and a Pydantic model built from the schema file."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, Field, create_model

DATA_DIR = Path(__file__).resolve().parents[2] / "shared" / "data"


def load_set(
    name: str, limit: int | None = None, data_dir: Path = DATA_DIR
) -> tuple[type[BaseModel], list[dict[str, Any]]]:
    schema_file, rows_file = data_dir / f"{name}.schema.json", data_dir / f"{name}.jsonl"
    if not rows_file.exists():
        raise FileNotFoundError(f"{rows_file} is absent: the development data lives in ../shared/data")
    spec = json.loads(schema_file.read_text())
    fields: dict[str, Any] = {}
    for field_name, field in spec["fields"].items():
        if field["type"] == "enum":
            annotation: Any = Literal[tuple(field["values"])]  # type: ignore[valid-type]
        elif field["type"] == "bool":
            annotation = bool
        else:
            raise ValueError(f"{name}: unknown field type {field['type']!r}")
        fields[field_name] = (annotation, Field(description=field.get("description")))
    model = create_model(_class_name(name), **fields)  # the set description is not a task prompt
    rows = [json.loads(line) for line in rows_file.read_text().splitlines() if line.strip()]
    return model, rows[:limit]


def _class_name(name: str) -> str:
    return "".join(part.capitalize() for part in name.split("_"))
