"""What every entry point (the `pcd` commands, the server, Ray actors and replicas) loads: a model
by short name, hub id, folder or GGUF file, and a schema by import path or JSON file."""

from __future__ import annotations

import importlib
import importlib.util
import json
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any

from pydantic import BaseModel

from minicpm_pcd_adapters.minicpm import load_minicpm5
from minicpm_pcd_adapters.smollm2 import load_smollm2
from pcd_engine import output_type

if TYPE_CHECKING:  # imported where the engine is built: `pcd` answers before PyTorch loads
    from pcd_engine import PCDEngine

MODELS = {"minicpm5-2b": load_minicpm5, "smollm2": load_smollm2}


def load_schema(spec: str) -> type[BaseModel]:
    """A schema by `module:Class`, `file.py:Class`, or a `.json` file: a JSON Schema object, or a
    development set's `{"fields": {name: {"type": "enum", "values": [...]} | {"type": "bool"}}}`."""
    if spec.endswith(".json"):
        return _json_file_schema(Path(spec))
    module_name, sep, attr = spec.rpartition(":")
    if not sep or not module_name or not attr:
        raise ValueError(f"--schema must be module:Class, file.py:Class or file.json, got {spec!r}")
    if module_name.endswith(".py"):
        path = Path(module_name)
        loader_spec = importlib.util.spec_from_file_location(path.stem, path)
        if loader_spec is None or loader_spec.loader is None:
            raise ImportError(f"cannot import {path}")
        module = importlib.util.module_from_spec(loader_spec)
        sys.modules[path.stem] = module
        loader_spec.loader.exec_module(module)
    else:
        sys.path.insert(0, str(Path.cwd()))
        module = importlib.import_module(module_name)
    schema = getattr(module, attr)
    if not (isinstance(schema, type) and issubclass(schema, BaseModel)):
        raise TypeError(f"{spec} is not a pydantic BaseModel subclass")
    return schema


def _json_file_schema(path: Path) -> type[BaseModel]:
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except ValueError as error:
        raise ValueError(f"--schema {path}: not valid JSON: {error}") from None
    if not isinstance(data, dict):
        raise ValueError(f"--schema {path}: expected a JSON object")
    if "fields" in data and "properties" not in data:  # a development set's schema file
        properties = {}
        for name, field in data["fields"].items():
            kind = field.get("type")
            if kind not in ("enum", "bool"):
                raise ValueError(f"--schema {path}: field {name!r} has type {kind!r}; expected enum or bool")
            properties[name] = {"enum": field["values"]} if kind == "enum" else {"type": "boolean"}
            if field.get("description"):
                properties[name]["description"] = field["description"]
        title = "".join(part.capitalize() for part in path.name.split(".")[0].split("_"))
        data = {"title": title, "type": "object", "properties": properties, "required": list(properties)}
    return output_type(data).model


def load_engine(model: str, **options: Any) -> PCDEngine:
    options = {k: v for k, v in options.items() if v is not None}
    if model.lower() in MODELS:
        return MODELS[model.lower()](**options)
    from pcd_engine import PCDEngine

    return PCDEngine.from_pretrained(model, **options)
