"""Loading a Hugging Face causal LM and its tokenizer from a hub id, a local folder or a GGUF file."""

from __future__ import annotations

import copy
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch

from pcd_engine.errors import ModelLoadError


def resolve_device(device: str | torch.device) -> torch.device:
    if str(device) == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(device)


def resolve_dtype(dtype: str | torch.dtype | None) -> torch.dtype:
    """FP32 unless asked otherwise: lower precision must earn its place (see docs/design)."""
    if dtype is None:
        return torch.float32
    if isinstance(dtype, torch.dtype):
        return dtype
    try:
        value = getattr(torch, dtype)
    except AttributeError:
        value = None
    if not isinstance(value, torch.dtype):
        raise ValueError(f"dtype={dtype!r} is not a torch dtype name (e.g. 'float32', 'bfloat16')")
    return value


def load_model_and_tokenizer(
    name_or_path: str | os.PathLike[str],
    *,
    revision: str | None = None,
    gguf_file: str | None = None,
    device: str | torch.device = "auto",
    dtype: str | torch.dtype | None = None,
    **model_kwargs: Any,
) -> tuple[Any, Any]:
    """Load (model, tokenizer). `name_or_path` may be a hub id, a folder, or a `.gguf` file."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    source = str(name_or_path)
    path = Path(source).expanduser()
    if path.suffix == ".gguf":
        if not path.is_file():
            raise ModelLoadError(f"GGUF file {path} does not exist")
        source, gguf_file = str(path.parent), path.name
    elif gguf_file is not None and not (path / gguf_file).is_file() and path.is_dir():
        raise ModelLoadError(f"GGUF file {gguf_file!r} is not in folder {path}")
    common: dict[str, Any] = {"revision": revision}
    if gguf_file is not None:
        common["gguf_file"] = gguf_file
    try:
        tokenizer = AutoTokenizer.from_pretrained(source, **common)
        model = AutoModelForCausalLM.from_pretrained(
            source, dtype=resolve_dtype(dtype), **common, **model_kwargs
        )
    except OSError as error:
        raise ModelLoadError(_load_hint(source, revision, path, error)) from error
    model.to(resolve_device(device))  # type: ignore[arg-type]
    model.eval()
    return model, tokenizer


def load_with_reference(
    name_or_path: str | os.PathLike[str],
    revision: str | None,
    gguf_file: str | None,
    device: str | torch.device,
    dtype: str | torch.dtype | None,
    fp32_reference: bool,
    model_kwargs: Mapping[str, Any],
) -> tuple[Any, Any, Any]:
    """(model, tokenizer, FP32 reference or None). With `fp32_reference` and a `dtype` below float32,
    the weights are loaded in float32, kept as the reference, and copied into `dtype` for the work."""
    wanted = resolve_dtype(dtype)
    keep_fp32 = fp32_reference and wanted != torch.float32
    model, tokenizer = load_model_and_tokenizer(
        name_or_path,
        revision=revision,
        gguf_file=gguf_file,
        device=device,
        dtype=torch.float32 if keep_fp32 else wanted,
        **model_kwargs,
    )
    if not keep_fp32:
        return model, tokenizer, None
    return copy.deepcopy(model).to(wanted), tokenizer, model


def _load_hint(source: str, revision: str | None, path: Path, error: OSError) -> str:
    if path.exists():
        return f"could not load a model from {path}: {error}"
    rev = f" --revision {revision}" if revision else ""
    return (
        f"could not load {source!r} from the Hugging Face hub or its local cache ({error}). "
        f"If this machine has no network, download it elsewhere with "
        f"`hf download {source}{rev} --local-dir DIR`, copy DIR here and pass DIR (a local folder) "
        f"or a .gguf file path instead of the hub id."
    )
