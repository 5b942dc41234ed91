"""Import hygiene, public API, and model-loading errors (no network needed)."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

import minicpm_pcd_adapters
import pcd_engine
from pcd_engine import ModelLoadError, PCDEngine


def test_core_imports_no_framework():
    code = (
        "import sys, pcd_engine, minicpm_pcd_adapters\n"
        "frameworks = ('langchain', 'langchain_core', 'llama_index')\n"
        "bad = [m for m in sys.modules if m.split('.')[0] in frameworks]\n"
        "assert not bad, bad\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


ROOT = Path(__file__).resolve().parents[2]
HEAVY = ("transformers", "pcd_engine.engine", "pcd_engine.generate")
SHOW_HEAVY = (
    "import sys\n"
    "from minicpm_pcd_adapters.cli.main import main\n"
    "try:\n"
    "    main(sys.argv[1:])\n"
    "except SystemExit:\n"
    "    pass\n"
    f"print('heavy:', sorted(m for m in {HEAVY!r} if m in sys.modules))\n"
)


def test_the_pcd_command_refuses_bad_input_before_transformers_is_imported(tmp_path):
    """pcd_engine's names load on first use (lazy_loader, from __init__.pyi): `pcd --help` and a
    refusal before the model loads import neither transformers nor the engine."""
    missing = ["--input", str(tmp_path / "missing.txt"), "--output", str(tmp_path / "o.jsonl")]
    for args in (["--help"], ["classify", "--schema", "examples/ticket.py:Ticket", *missing]):
        command = [sys.executable, "-c", SHOW_HEAVY, *args]
        done = subprocess.run(command, capture_output=True, text=True, cwd=ROOT)  # a relative schema path
        assert "heavy: []" in done.stdout, (args, done.stdout[-500:], done.stderr[-2000:])
    assert "no such file" in done.stderr


def test_every_public_name_resolves_and_the_stub_lists_them_all():
    stub = ast.parse((Path(pcd_engine.__file__).parent / "__init__.pyi").read_text())
    assigned = [n for n in stub.body if isinstance(n, ast.Assign) and ast.unparse(n.targets[0]) == "__all__"]
    assert set(ast.literal_eval(assigned[0].value)) == set(pcd_engine.__all__)
    for name in pcd_engine.__all__:
        assert getattr(pcd_engine, name) is not None, name
    with pytest.raises(AttributeError):
        pcd_engine.NotAName  # noqa: B018


def test_public_api_is_pinned():
    assert set(pcd_engine.__all__) >= {
        "PCDEngine",
        "PCDResult",
        "FieldResult",
        "Diagnostics",
        "PCDError",
        "UnsupportedSchemaError",
        "SchemaLimitError",
        "InputError",
        "ModelLoadError",
        "Limits",
        "compile_schema",
    }
    assert set(minicpm_pcd_adapters.__all__) == {
        "MINICPM5_2B",
        "ChatMiniCPM",
        "MiniCPMLLM",
        "MiniCPMPCDProgram",
        "ModelDefaults",
        "load_minicpm5",
        "load_smollm2",
        "smollm2_gguf_path",
    }


def test_minicpm_defaults_match_the_design_brief():
    d = minicpm_pcd_adapters.MINICPM5_2B
    assert d.hub_id == "openbmb/MiniCPM5-2B"
    assert d.revision == "12a3808a956f869c767195e9266b59c4d21d92e2"
    assert d.chat_template_kwargs == {"enable_thinking": False}
    assert d.eos_token_ids == (1, 130073)


def test_unreachable_hub_says_how_to_point_at_a_local_copy(monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(ModelLoadError) as info:
        minicpm_pcd_adapters.load_minicpm5(device="cpu")
    message = str(info.value)
    assert (
        "openbmb/MiniCPM5-2B" in message and "--revision 12a3808a956f869c767195e9266b59c4d21d92e2" in message
    )
    assert "local folder" in message and ".gguf" in message


def test_missing_gguf_file(tmp_path):
    with pytest.raises(ModelLoadError, match="does not exist"):
        PCDEngine.from_pretrained(tmp_path / "model.gguf")
    with pytest.raises(ModelLoadError, match="not in folder"):
        PCDEngine.from_pretrained(tmp_path, gguf_file="model.gguf")


def test_bad_dtype_name():
    from pcd_engine.loading import resolve_dtype

    with pytest.raises(ValueError, match="dtype='fp99'"):
        resolve_dtype("fp99")


def test_an_adapter_s_engine_slot_loads_once_for_all_threads(tmp_path, tiny_tokenizer, tiny_model):
    from concurrent.futures import ThreadPoolExecutor

    from minicpm_pcd_adapters.minicpm import EngineSlot

    tiny_model.save_pretrained(tmp_path)
    tiny_tokenizer.save_pretrained(tmp_path)
    slot = EngineSlot()
    with ThreadPoolExecutor(4) as pool:
        engines = list(pool.map(lambda _: slot.load(str(tmp_path), options={"device": "cpu"}), range(8)))
    assert all(engine is engines[0] for engine in engines)
    assert isinstance(engines[0], PCDEngine) and engines[0].runner.device.type == "cpu"


def _imports(package: str) -> dict[str, set[str]]:
    """Per module of `package`, the modules it imports at run time (TYPE_CHECKING blocks left out)."""
    import ast
    from pathlib import Path

    folder = Path(__import__(package).__file__).parent
    graph: dict[str, set[str]] = {}
    for path in folder.glob("*.py"):
        tree = ast.parse(path.read_text())
        checking = {
            id(n)
            for node in ast.walk(tree)
            if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test)
            for n in ast.walk(node)
        }
        found = set()
        for node in ast.walk(tree):
            if id(node) in checking or not isinstance(node, ast.ImportFrom) or not node.module:
                continue
            if node.module == package:  # `from pcd_engine import packing`
                found |= {f"{package}.{a.name}" for a in node.names if (folder / f"{a.name}.py").exists()}
            found.add(node.module)
        graph[f"{package}.{path.stem}"] = found
    return graph


def test_the_core_s_imports_have_no_cycle():
    graph = {
        m: {d for d in deps if d.startswith("pcd_engine.")} for m, deps in _imports("pcd_engine").items()
    }
    del graph["pcd_engine.__init__"]
    done: set[str] = set()

    def visit(module: str, path: tuple[str, ...]) -> None:
        assert module not in path, " -> ".join((*path, module))
        if module not in done:
            for dependency in graph.get(module, ()):
                visit(dependency, (*path, module))
            done.add(module)

    for module in graph:
        visit(module, ())
    assert len(done) == len(graph) > 15


def test_adapters_use_only_the_core_s_public_names():
    import ast
    from pathlib import Path

    for path in Path(minicpm_pcd_adapters.__file__).parent.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("pcd_engine"):
                assert node.module == "pcd_engine", f"{path.name} imports {node.module}"
                assert {a.name for a in node.names} <= set(pcd_engine.__all__), path.name
