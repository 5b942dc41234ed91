"""A GGUF file converted once. transformers reads a GGUF file's metadata three times per load (for the
config, the tokenizer and the weights) and rebuilds its tensor-name map for every tensor: about 25 s
for SmolLM2-135M on a 2-core CPU, of which de-quantizing the weights is under 2 s. So the converted
model (the de-quantized float32 weights as safetensors, the config and the tokenizer files) is kept in
a folder named by the GGUF file's SHA-256, and the next load of the same file reads that folder as an
ordinary model folder, in a few seconds. A model loaded from the folder equals one loaded from the file
(tests/smollm2/test_gguf_cache.py).

The folders live in `$MINICPM_PCD_CACHE/gguf/` (default `~/.cache/minicpm-pcd/gguf/`);
`MINICPM_PCD_CACHE=off` turns the cache off. A folder is written under a temporary name and renamed
once whole, so a load never reads a half-written one. Only a float32 load is kept (a lower precision
would round the weights every later load reads); a load checked against a manifest bypasses the cache
and reads the checked file itself.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import warnings
from functools import lru_cache
from pathlib import Path
from typing import Any

import torch

OFF = ("off", "0", "false", "no")
WEIGHTS = "model.safetensors"


def cache_root() -> Path | None:
    """Where converted GGUF files are kept; None when the cache is off."""
    setting = os.environ.get("MINICPM_PCD_CACHE", "")
    if setting.strip().lower() in OFF:
        return None
    base = Path(setting).expanduser() if setting else Path.home() / ".cache" / "minicpm-pcd"
    return base / "gguf"


def digest(path: Path) -> str:
    """The file's SHA-256, read a megabyte at a time; once per file version (path, size, mtime), so
    a load that looks the folder up and then keeps it reads the file once."""
    stat = path.stat()
    return _digest(str(path.resolve()), stat.st_size, stat.st_mtime_ns)


@lru_cache(maxsize=16)
def _digest(path: str, size: int, mtime_ns: int) -> str:
    sha = hashlib.sha256()
    with open(path, "rb") as handle:
        while chunk := handle.read(2**20):
            sha.update(chunk)
    return sha.hexdigest()


def converted(gguf: Path) -> Path | None:
    """The folder holding `gguf` converted, if a whole one is kept."""
    root = cache_root()
    if root is None:
        return None
    folder = root / digest(gguf)
    return folder if (folder / WEIGHTS).is_file() else None


def keep(gguf: Path, model: Any, tokenizer: Any) -> Path | None:
    """Write the converted model of `gguf` to the cache (float32 weights only); the folder, or None
    when the cache is off, the weights are not float32 or the folder cannot be written."""
    from safetensors.torch import save_model

    root = cache_root()
    if root is None or next(model.parameters()).dtype != torch.float32:
        return None
    folder = root / digest(gguf)
    partial = root / f".{folder.name}.{os.getpid()}.partial"
    try:
        partial.mkdir(parents=True, exist_ok=True)
        save_model(model, str(partial / WEIGHTS))  # tied weights (embeddings, LM head) stored once
        model.config.save_pretrained(partial)
        if getattr(model, "generation_config", None) is not None:
            model.generation_config.save_pretrained(partial)
        tokenizer.save_pretrained(partial)
        if not folder.exists():
            partial.rename(folder)
    except Exception as error:  # a read-only or full disk, or anything else: the load goes on without it
        warnings.warn(f"the converted GGUF file was not kept in {root}: {error}", stacklevel=3)
        return None
    finally:
        shutil.rmtree(partial, ignore_errors=True)
    return folder
