"""Loading a Hugging Face causal LM and its tokenizer from a hub id, a local folder or a GGUF file."""

from __future__ import annotations

import copy
import os
import urllib.error
import urllib.request
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch

from pcd_engine import gguf_cache
from pcd_engine.errors import ModelLoadError
from pcd_engine.manifest import verify_manifest


def resolve_device(device: str | torch.device) -> torch.device:
    if str(device) == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(device)


def native_bf16(device: str | torch.device) -> bool:
    """Whether `device` multiplies bf16 matrices natively: a CUDA GPU with bf16, or a CPU with
    AVX512-BF16 or AMX tiles. Elsewhere PyTorch computes bf16 products through FP32, slower than
    FP32 itself."""
    device = torch.device(device)
    if device.type == "cuda":
        return bool(torch.cuda.is_bf16_supported())
    if device.type != "cpu":
        return False
    probes = ("_is_avx512_bf16_supported", "_is_amx_tile_supported")  # torch.cpu's own CPUID checks
    return any(bool(getattr(torch.cpu, probe, lambda: False)()) for probe in probes)


def resolve_dtype(dtype: str | torch.dtype | None, device: str | torch.device = "cpu") -> torch.dtype:
    """FP32 unless asked otherwise: lower precision must earn its place (see docs/design). "auto" is
    bfloat16 where `device` computes it natively (`native_bf16`), float32 elsewhere."""
    if dtype is None:
        return torch.float32
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype == "auto":
        return torch.bfloat16 if native_bf16(resolve_device(device)) else torch.float32
    try:
        value = getattr(torch, dtype)
    except AttributeError:
        value = None
    if not isinstance(value, torch.dtype):
        raise ValueError(f"dtype={dtype!r} is not a torch dtype name (e.g. 'float32', 'bfloat16') or 'auto'")
    return value


def load_model_and_tokenizer(
    name_or_path: str | os.PathLike[str],
    *,
    revision: str | None = None,
    gguf_file: str | None = None,
    device: str | torch.device = "auto",
    dtype: str | torch.dtype | None = None,
    manifest: str | os.PathLike[str] | Mapping[str, Any] | None = None,
    **model_kwargs: Any,
) -> tuple[Any, Any]:
    """Load (model, tokenizer). `name_or_path` may be a hub id, a folder, or a `.gguf` file.

    A hub id is first resolved to a local snapshot folder (`hub_snapshot`: safetensors weights only,
    the local cache at once when the hub is unreachable). With `manifest` (a `pcd manifest create`
    file or dict), the folder's files are checked against it before anything is loaded. A GGUF file
    is converted once and read from `gguf_cache` afterwards (not when checked against a manifest).
    """
    from transformers import AutoModelForCausalLM, AutoTokenizer

    source = str(name_or_path)
    path = Path(source).expanduser()
    hub_revision = None
    if path.suffix == ".gguf":
        if not path.is_file():
            raise ModelLoadError(f"GGUF file {path} does not exist")
        folder, gguf_file = path.parent, path.name
    elif path.is_dir():
        folder = path
        if gguf_file is not None and not (path / gguf_file).is_file():
            raise ModelLoadError(f"GGUF file {gguf_file!r} is not in folder {path}")
    else:
        folder = hub_snapshot(source, revision, gguf_file, model_kwargs)
        hub_revision = revision
        if gguf_file is None:
            model_kwargs["use_safetensors"] = True  # never unpickle downloaded weights
    if manifest is not None:
        verify_manifest(folder, manifest, revision=hub_revision)
    gguf = folder / gguf_file if gguf_file is not None else None
    source_folder = folder
    if gguf is not None and manifest is None and (kept := gguf_cache.converted(gguf)) is not None:
        folder, gguf, gguf_file = kept, None, None  # converted before: an ordinary folder
    common: dict[str, Any] = {"gguf_file": gguf_file} if gguf_file is not None else {}
    if model_kwargs.get("trust_remote_code"):
        common["trust_remote_code"] = True
    try:
        tokenizer = AutoTokenizer.from_pretrained(str(folder), **common)
        model = AutoModelForCausalLM.from_pretrained(
            str(folder), dtype=resolve_dtype(dtype, device), **common, **model_kwargs
        )
    except OSError as error:
        raise ModelLoadError(f"could not load a model from {folder}: {error}") from error
    if gguf is not None and manifest is None:
        gguf_cache.keep(gguf, model, tokenizer)
    if gguf_file is None and folder != source_folder:  # read from the cache: named by the file's folder
        model.name_or_path = model.config.name_or_path = str(source_folder)
    model.to(resolve_device(device))  # type: ignore[arg-type]
    model.eval()
    return model, tokenizer


def hub_snapshot(
    repo_id: str, revision: str | None, gguf_file: str | None, model_kwargs: dict[str, Any]
) -> Path:
    """The local folder of `repo_id` at `revision`, downloaded if needed (huggingface_hub's
    `snapshot_download`). Only safetensors weights (or the named GGUF file), configs and tokenizer
    files are fetched: no pickled weights. When the hub does not answer one quick probe (or
    HF_HUB_OFFLINE is set), only the local cache is looked at, so an offline machine gets its answer
    at once. Hub options (`cache_dir`, `token`, `local_files_only`) are taken out of `model_kwargs`."""
    from huggingface_hub import snapshot_download

    patterns = [gguf_file] if gguf_file is not None else ["*.safetensors", "*.safetensors.index.json"]
    patterns += ["*.json", "*.model", "*.tiktoken", "*.txt", "*.jinja"]
    if model_kwargs.get("trust_remote_code"):
        patterns.append("*.py")
    local_only = model_kwargs.pop("local_files_only", False)
    offline = "local_files_only=True was asked" if local_only else hub_offline_reason()
    try:
        return Path(
            snapshot_download(
                repo_id,
                revision=revision,
                allow_patterns=patterns,
                local_files_only=offline is not None,
                cache_dir=model_kwargs.pop("cache_dir", None),
                token=model_kwargs.pop("token", None),
            )
        )
    except ValueError as error:  # huggingface_hub's HFValidationError: not a repo id
        raise ModelLoadError(
            f"{repo_id!r} is not a local folder, a .gguf file or a hub id (owner/name): {error}"
        ) from error
    except OSError as error:
        raise ModelLoadError(_load_hint(repo_id, revision, offline, error)) from error


def hub_offline_reason(timeout: float = 3.0) -> str | None:
    """Why the hub cannot be used now (HF_HUB_OFFLINE set, or no answer to one HEAD request within
    `timeout` seconds), or None when it answered. Any HTTP answer counts as reachable."""
    from huggingface_hub import constants

    if (
        constants.is_offline_mode()
        or os.environ.get("HF_HUB_OFFLINE", "").upper() in constants.ENV_VARS_TRUE_VALUES
    ):
        return "HF_HUB_OFFLINE is set"
    request = urllib.request.Request(constants.ENDPOINT, method="HEAD")
    try:
        urllib.request.urlopen(request, timeout=timeout).close()
    except urllib.error.HTTPError:
        return None
    except (OSError, ValueError) as error:
        reason = getattr(error, "reason", error)
        return f"no answer from {constants.ENDPOINT} within {timeout:g} s: {reason}"
    return None


def load_with_reference(
    name_or_path: str | os.PathLike[str],
    revision: str | None,
    gguf_file: str | None,
    device: str | torch.device,
    dtype: str | torch.dtype | None,
    fp32_reference: bool,
    model_kwargs: Mapping[str, Any],
    manifest: str | os.PathLike[str] | Mapping[str, Any] | None = None,
) -> tuple[Any, Any, Any]:
    """(model, tokenizer, FP32 reference or None). With `fp32_reference` and a `dtype` below float32,
    the weights are loaded in float32, kept as the reference, and copied into `dtype` for the work."""
    wanted = resolve_dtype(dtype, device)
    keep_fp32 = fp32_reference and wanted != torch.float32
    model, tokenizer = load_model_and_tokenizer(
        name_or_path,
        revision=revision,
        gguf_file=gguf_file,
        device=device,
        dtype=torch.float32 if keep_fp32 else wanted,
        manifest=manifest,
        **model_kwargs,
    )
    if not keep_fp32:
        return model, tokenizer, None
    return copy.deepcopy(model).to(wanted), tokenizer, model


def _load_hint(repo_id: str, revision: str | None, offline: str | None, error: OSError) -> str:
    rev = f" --revision {revision}" if revision else ""
    at = f" at revision {revision}" if revision else ""
    if offline:  # huggingface_hub's own text then only suggests going online
        problem = f"the hub cannot be used ({offline}), and {repo_id!r}{at} is not in the local cache"
    else:
        problem = f"{repo_id!r}{at} could not be fetched from the hub: {error}"
    return (
        f"{problem}. On a machine with network, run `hf download {repo_id}{rev} --local-dir DIR`, copy "
        f"DIR here and pass DIR (a local folder) or a .gguf file path instead of the hub id."
    )
