"""MiniCPM5-2B defaults and loader. The engine knows no model; these are the product's defaults."""

from __future__ import annotations

import os
import threading
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # imported where an engine is built: `pcd` answers before PyTorch loads
    import torch

    from pcd_engine import PCDEngine


@dataclass(frozen=True)
class ModelDefaults:
    hub_id: str
    revision: str | None
    chat_template_kwargs: dict[str, Any] = field(default_factory=dict)
    eos_token_ids: tuple[int, ...] = ()
    dtype: str = "float32"  # FP32 is the safe default; lower precision must prove equal decisions


MINICPM5_2B = ModelDefaults(
    hub_id="openbmb/MiniCPM5-2B",
    revision="12a3808a956f869c767195e9266b59c4d21d92e2",
    chat_template_kwargs={"enable_thinking": False},
    eos_token_ids=(1, 130073),  # </s>, <|im_end|>
)


def load_minicpm5(
    name_or_path: str | os.PathLike[str] | None = None,
    *,
    revision: str | None = None,
    device: str | torch.device = "auto",
    dtype: str | torch.dtype | None = None,
    **options: Any,
) -> PCDEngine:
    """A PCDEngine over MiniCPM5-2B: the pinned hub revision, or a local folder / GGUF file.
    The hub id is downloaded on first use (safetensors only); a folder loads as it is:

        >>> engine = load_minicpm5()  # doctest: +SKIP
        >>> engine = load_minicpm5("/models/MiniCPM5-2B")  # doctest: +SKIP
    """
    source = name_or_path or MINICPM5_2B.hub_id
    pinned = revision or (MINICPM5_2B.revision if source == MINICPM5_2B.hub_id else None)
    options.setdefault("chat_template_kwargs", MINICPM5_2B.chat_template_kwargs)
    options.setdefault("stop_token_ids", MINICPM5_2B.eos_token_ids)
    from pcd_engine import PCDEngine

    return PCDEngine.from_pretrained(
        source, revision=pinned, device=device, dtype=dtype or MINICPM5_2B.dtype, **options
    )


class EngineSlot:
    """The engine an adapter loads on first use: loaded once, however many threads ask (both adapters,
    LangChain and LlamaIndex, hold one; an adapter given an engine never asks).

        >>> EngineSlot().load("openbmb/MiniCPM5-2B")  # doctest: +SKIP
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._loaded: PCDEngine | None = None

    def load(
        self,
        model: str,
        *,
        revision: str | None = None,
        gguf_file: str | None = None,
        options: Mapping[str, Any] | None = None,
    ) -> PCDEngine:
        with self._lock:
            if self._loaded is None:
                self._loaded = engine_for_model(
                    model, revision=revision, gguf_file=gguf_file, **dict(options or {})
                )
            return self._loaded


def engine_for_model(
    model: str, *, revision: str | None = None, gguf_file: str | None = None, **options: Any
) -> PCDEngine:
    """The adapters' loader: MiniCPM5-2B's defaults for its hub id, any other hub id, folder or GGUF
    file as it is."""
    if model == MINICPM5_2B.hub_id and gguf_file is None:
        return load_minicpm5(revision=revision, **options)
    from pcd_engine import PCDEngine

    return PCDEngine.from_pretrained(model, revision=revision, gguf_file=gguf_file, **options)
