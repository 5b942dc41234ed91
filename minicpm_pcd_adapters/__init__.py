"""Adapters around the core engine: model defaults and loaders, the CLI, LangChain and LlamaIndex.

`ChatMiniCPM` (LangChain), `MiniCPMLLM` and `MiniCPMPCDProgram` (LlamaIndex) are imported on first
use, so that the package works without those frameworks installed.
"""

from typing import Any

from minicpm_pcd_adapters.minicpm import MINICPM5_2B, ModelDefaults, load_minicpm5
from minicpm_pcd_adapters.smollm2 import load_smollm2, smollm2_gguf_path

__all__ = [
    "MINICPM5_2B",
    "ChatMiniCPM",
    "MiniCPMLLM",
    "MiniCPMPCDProgram",
    "ModelDefaults",
    "load_minicpm5",
    "load_smollm2",
    "smollm2_gguf_path",
]


def __getattr__(name: str) -> Any:
    if name == "ChatMiniCPM":
        from minicpm_pcd_adapters.langchain import ChatMiniCPM

        return ChatMiniCPM
    if name in ("MiniCPMLLM", "MiniCPMPCDProgram"):
        from minicpm_pcd_adapters import llama_index

        return getattr(llama_index, name)
    raise AttributeError(f"module 'minicpm_pcd_adapters' has no attribute {name!r}")
