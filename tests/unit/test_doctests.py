"""The examples in the docstrings run (those marked `+SKIP` need a model or a cluster): the core's
modules, the server's and the adapters' message converters, which load no model."""

from __future__ import annotations

import ast
import doctest
import importlib
import pkgutil
from pathlib import Path

import pytest

import pcd_engine
from minicpm_pcd_adapters import server

MODULES = sorted(
    [f"pcd_engine.{m.name}" for m in pkgutil.iter_modules(pcd_engine.__path__)]
    + [f"minicpm_pcd_adapters.server.{m.name}" for m in pkgutil.iter_modules(server.__path__)]
    + [
        "minicpm_pcd_adapters.local_engine",
        "minicpm_pcd_adapters.langchain.messages",
        "minicpm_pcd_adapters.llama_index.messages",
    ]
)


@pytest.mark.parametrize("name", MODULES)
def test_the_module_s_examples_run(name):
    result = doctest.testmod(importlib.import_module(name), optionflags=doctest.ELLIPSIS)
    assert result.failed == 0


def docstrings(path: Path) -> list[tuple[str, str]]:
    tree = ast.parse(path.read_text())
    found = []
    for node in ast.walk(tree):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
            text = ast.get_docstring(node)  # cleaned: the common indentation removed
            if text:
                found.append((getattr(node, "name", path.name), text))
    return found


def test_examples_are_code_blocks_on_the_api_page():
    """mkdocstrings renders docstrings as markdown: a `>>>` line at the text's own indentation would
    be a block quote of run-together text; indented by four spaces it is a code block."""
    root = Path(pcd_engine.__file__).parents[1]
    flat = [
        f"{path.relative_to(root)}: {name}"
        for package in ("pcd_engine", "minicpm_pcd_adapters")
        for path in (root / package).rglob("*.py")
        for name, text in docstrings(path)
        if any(line.startswith(">>>") for line in text.splitlines())
    ]
    assert flat == []
