"""Import hygiene, public API, and model-loading errors (no network needed)."""

from __future__ import annotations

import subprocess
import sys

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
