"""The import graph of both packages and the benchmarks, read from their source with `ast`: no cycles
(imports inside functions and type-only imports count too), a core that imports no framework, server
or Ray, and no module over 450 lines."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("pcd_engine", "minicpm_pcd_adapters", "benchmarks")
OUTSIDE_THE_CORE = {
    "minicpm_pcd_adapters",
    "langchain",
    "langchain_core",
    "llama_index",
    "fastapi",
    "starlette",
    "uvicorn",
    "prometheus_client",
    "openai",
    "ray",
    "pyarrow",
    "matplotlib",
}  # fmt: skip  (jinja2 is the core's: chat templates are Jinja, and their switches are read with it)


def module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def modules() -> dict[str, Path]:
    return {module_name(p): p for package in PACKAGES for p in (ROOT / package).rglob("*.py")}


def imports_of(path: Path, known: dict[str, Path]) -> set[str]:
    """Every module a file imports, anywhere in it; `from package import name` counts as the
    submodule `package.name` when there is one, else as the package."""
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            for alias in node.names:
                sub = f"{node.module}.{alias.name}"
                found.add(sub if sub in known else node.module)
    return found


def graph() -> dict[str, set[str]]:
    known = modules()
    return {name: {m for m in imports_of(path, known) if m in known} for name, path in known.items()}


def cycle_in(edges: dict[str, set[str]]) -> list[str] | None:
    """One import cycle of the graph (its modules, the first repeated at the end), or None."""
    done: set[str] = set()

    def visit(module: str, path: tuple[str, ...]) -> list[str] | None:
        if module in path:
            return [*path[path.index(module) :], module]
        if module in done:
            return None
        for dependency in sorted(edges.get(module, ())):
            found = visit(dependency, (*path, module))
            if found:
                return found
        done.add(module)
        return None

    return next((c for c in (visit(m, ()) for m in sorted(edges)) if c), None)


def test_no_import_cycles_in_either_package():
    edges = graph()
    assert len(edges) > 50
    cycle = cycle_in(edges)
    assert cycle is None, "import cycle: " + " -> ".join(cycle or ())


def test_the_core_imports_no_framework_server_or_ray_module():
    known = modules()
    for name, path in known.items():
        if name.startswith("pcd_engine"):
            bad = {m for m in imports_of(path, known) if m.split(".")[0] in OUTSIDE_THE_CORE}
            assert not bad, f"{name} imports {sorted(bad)}"


def test_errors_is_a_leaf():
    known = modules()
    assert not {m for m in imports_of(known["pcd_engine.errors"], known) if m.startswith("pcd_engine")}


def test_the_walk_sees_imports_in_functions_and_type_checking_blocks_and_finds_cycles(tmp_path):
    a, b = tmp_path / "a.py", tmp_path / "b.py"
    a.write_text("def f():\n    from pcd_engine import engine\n")
    b.write_text("import typing\nif typing.TYPE_CHECKING:\n    from pcd_engine.results import X\n")
    known = {"pcd_engine.engine": a, "pcd_engine.results": b}
    assert imports_of(a, known) == {"pcd_engine.engine"}
    assert imports_of(b, known) == {"typing", "pcd_engine.results"}
    edges = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
    assert cycle_in(edges) == ["a", "b", "c", "a"]
    assert cycle_in({"a": {"b"}, "b": set()}) is None


def test_no_module_over_450_lines():
    long = {name: n for name, path in modules().items() if (n := len(path.read_text().splitlines())) > 450}
    assert not long, f"modules over 450 lines: {long}"
