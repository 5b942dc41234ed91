"""Adapters around the core engine: model defaults and loaders (framework adapters come later)."""

from minicpm_pcd_adapters.minicpm import MINICPM5_2B, ModelDefaults, load_minicpm5
from minicpm_pcd_adapters.smollm2 import load_smollm2, smollm2_gguf_path

__all__ = ["MINICPM5_2B", "ModelDefaults", "load_minicpm5", "load_smollm2", "smollm2_gguf_path"]
