"""Linear layers on the CPU through oneDNN, with each weight laid out for its kernels once.

On a CPU every forward call this engine makes is short (a prompt's tail and its branches: a few
dozen to a few hundred tokens), and there `nn.Linear` costs far more than its arithmetic: measured on
SmolLM2's shapes (2 cores, PyTorch 2.13), all 210 decoder products took 35 ms for 1 token, 74 ms for
32 and 225 ms for 128 through `nn.Linear`, against 21, 46 and 143 ms through oneDNN with packed
weights (`mkldnn._reorder_linear_weight` once, then `mkldnn._linear_pointwise`, what `torch.compile`
does on a CPU); the LM head's 25 rows 31 against 10 ms. The arithmetic is the same (float32 stays
float32, bf16 stays bf16); only the order of the sums differs, so outputs agree to float32 rounding
(about 1e-6 relative), as they do between two batch sizes.

`pack_linears(model)` swaps the model's `nn.Linear` layers for `PackedLinear` in place:

- the decoder's hold their weights packed only, as parameters (no extra memory; `dense_weight`
  reads one back);
- the LM head keeps its weight, which the input embeddings may share and `projection.py` reads rows
  of, and gains a packed copy: memory grows by the head's size (113 MB for SmolLM2 in float32).

Only where it applies: weights on the CPU in float32 or bfloat16, in a PyTorch built with oneDNN.
`PCDEngine(..., pack_weights=False)` leaves the model as given.
"""

from __future__ import annotations

import copy
import math
import time
from typing import Any

import torch

DTYPES = (torch.float32, torch.bfloat16)


class PackedLinear(torch.nn.Module):
    """`nn.Linear`'s function with its weight in oneDNN's layout: `weight` is that packed weight
    (the decoder's), or the original with the packed copy in `packed` (`keep_weight`: the LM head).
    Converted (`.to`, `.float()`, ...), copied (`copy.deepcopy`), pickled or loaded, it unpacks,
    converts and packs again where packing applies; elsewhere (a GPU, float16) it runs as
    `nn.Linear`. Its state dict is `nn.Linear`'s (the weight saved unpacked). For inference: the
    packed weights take no gradients."""

    def __init__(self, linear: torch.nn.Linear, keep_weight: bool = False) -> None:
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.keep_weight = keep_weight
        self.weight = linear.weight
        self.bias = linear.bias
        self.register_buffer("packed", None, persistent=False)
        self._pack()

    def _pack(self) -> None:
        weight = self.weight
        if not (weight.device.type == "cpu" and weight.dtype in DTYPES and available()):
            return
        packed = torch.ops.mkldnn._reorder_linear_weight(weight.detach(), None)
        if self.keep_weight:
            self.packed = packed
        else:
            self.weight = torch.nn.Parameter(packed, requires_grad=False)

    def _unpack(self) -> None:
        self.packed = None
        if self.weight.is_mkldnn:
            self.weight = torch.nn.Parameter(self.weight.to_dense(), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weight = self.packed if self.packed is not None else self.weight
        if weight.is_mkldnn:
            return torch.ops.mkldnn._linear_pointwise(x, weight, self.bias, "none", [], "")
        return torch.nn.functional.linear(x, weight, self.bias)

    def _apply(self, fn: Any, recurse: bool = True) -> PackedLinear:
        self._unpack()
        super()._apply(fn, recurse)  # the weight (shared with the embeddings, maybe) and bias
        self._pack()
        return self

    def _save_to_state_dict(self, destination: Any, prefix: str, keep_vars: bool) -> None:
        super()._save_to_state_dict(destination, prefix, keep_vars)
        if self.weight.is_mkldnn:  # saved as nn.Linear saves it
            destination[prefix + "weight"] = self.weight.detach().to_dense()

    def _load_from_state_dict(self, state_dict: Any, prefix: str, *args: Any) -> None:
        self._unpack()
        super()._load_from_state_dict(state_dict, prefix, *args)
        self._pack()

    def __getstate__(self) -> dict[str, Any]:  # pickled (torch.save, Ray) unpacked
        state = self.__dict__.copy()
        weight = state["_parameters"]["weight"]
        if weight.is_mkldnn:
            weight = torch.nn.Parameter(weight.to_dense(), requires_grad=False)
        state["_parameters"] = {**state["_parameters"], "weight": weight}
        state["_buffers"] = {**state["_buffers"], "packed": None}
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        super().__setstate__(state)
        self._pack()

    def __deepcopy__(self, memo: dict[int, Any]) -> PackedLinear:
        linear = torch.nn.Linear(self.in_features, self.out_features, bias=self.bias is not None)
        linear.weight = (
            copy.deepcopy(self.weight, memo)
            if not self.weight.is_mkldnn
            else (torch.nn.Parameter(self.weight.to_dense(), requires_grad=False))
        )
        linear.bias = copy.deepcopy(self.bias, memo)
        twin = PackedLinear(linear, self.keep_weight)
        memo[id(self)] = twin
        return twin

    def extra_repr(self) -> str:
        packed = self.packed is not None or self.weight.is_mkldnn
        return f"in_features={self.in_features}, out_features={self.out_features}, packed={packed}"


def available() -> bool:
    """Whether this PyTorch has oneDNN's linear operators."""
    return (
        torch.backends.mkldnn.is_available()
        and hasattr(torch.ops.mkldnn, "_linear_pointwise")
        and hasattr(torch.ops.mkldnn, "_reorder_linear_weight")
    )


def applies(model: Any) -> bool:
    """Whether `pack_linears` would pack this model: weights on the CPU in float32 or bfloat16, and
    PyTorch built with oneDNN's linear operators."""
    weight = next(model.parameters())
    return weight.device.type == "cpu" and weight.dtype in DTYPES and available()


def pack_linears(model: Any) -> int:
    """Swap the model's `nn.Linear` layers (on the CPU, float32 or bfloat16) for `PackedLinear`, in
    place; returns how many were swapped (0 where it does not apply, or already done)."""
    if not applies(model):
        return 0
    head = model.get_output_embeddings()
    swapped = 0
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if type(child) is torch.nn.Linear and child is not head and child.weight.dtype in DTYPES:
                setattr(parent, name, PackedLinear(child))
                swapped += 1
    if type(head) is torch.nn.Linear and head.weight.dtype in DTYPES:
        model.set_output_embeddings(PackedLinear(head, keep_weight=True))
        swapped += 1
    return swapped


def dense_weight(p: torch.Tensor) -> torch.Tensor:
    """A parameter as an ordinary tensor (a packed weight read back in its logical layout)."""
    return p.to_dense() if p.is_mkldnn else p


def pays(model: Any, rows: tuple[int, ...] = (1, 24, 96), repeats: int = 9) -> bool:
    """Whether packing makes this model's linear layers faster on this machine: the distinct shapes
    of its first decoder layer's `nn.Linear`s timed both ways on inputs of `rows` tokens (one: a
    generated token; dozens: a request's text and branches), the median of `repeats` runs each; packed
    pays where the geometric mean over `rows` of plain / packed exceeds 1, so that no workload is
    traded for another. Which is faster depends on the CPU and on the BLAS PyTorch ships. Measured
    with PyTorch 2.13 on 2 cores: on an AMD EPYC packed was faster at every size (requests 1.25-1.45x,
    generation 1.44x); on an Intel Xeon (AVX512-FP16), where MKL's own products are fast, it was 2x
    slower for one token, 1.4x faster for 24 and even from 96, so requests ran alike and generation
    1.18x slower. Once per engine: 60-90 ms for SmolLM2 on 2 cores."""
    if not applies(model):
        return False
    shapes: dict[tuple[int, ...], torch.nn.Linear] = {}
    decoder_layers = [m for m in model.modules() if isinstance(m, torch.nn.ModuleList)]
    first = decoder_layers[0][0] if decoder_layers and len(decoder_layers[0]) else model
    for module in first.modules():
        if type(module) is torch.nn.Linear and module.weight.dtype in DTYPES:
            shapes.setdefault(tuple(module.weight.shape), module)
    if not shapes:
        return False
    twins = [(linear, PackedLinear(linear)) for linear in shapes.values()]  # the model is untouched
    log_ratio = 0.0
    with torch.inference_mode():
        for count in rows:
            plain = packed = 0.0
            for linear, twin in twins:
                x = torch.randn(1, count, linear.in_features, dtype=linear.weight.dtype)
                plain += _median_seconds(lambda: linear(x), repeats)  # noqa: B023 (called here)
                packed += _median_seconds(lambda: twin(x), repeats)  # noqa: B023
            log_ratio += math.log(plain / packed)
    return log_ratio > 0


def _median_seconds(call: Any, repeats: int) -> float:
    call()  # warm
    times = []
    for _ in range(repeats):
        started = time.perf_counter()
        call()
        times.append(time.perf_counter() - started)
    return sorted(times)[len(times) // 2]
