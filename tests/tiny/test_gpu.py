"""CUDA: the packed and batched paths on the GPU kernels (SDPA with 4-D masks), fp32 and bf16.

Skipped without CUDA. Timing lives in benchmarks/gpu.py; these only check results.
"""

from __future__ import annotations

import copy

import pytest
import torch

from pcd_engine import PCDEngine
from tests.helpers import TEXT, TEXTS, Wide, assert_same_scores, packed_and_separate

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
]


@pytest.fixture(scope="module")
def cuda_model(tiny_model):
    torch.backends.cuda.matmul.allow_tf32 = False  # exact fp32 comparisons
    return copy.deepcopy(tiny_model).to("cuda")


def test_packed_scores_equal_separate_passes_on_cuda(tiny_tokenizer, cuda_model):
    engine = PCDEngine(cuda_model, tiny_tokenizer)
    assert engine.runner.max_tokens_per_forward == 32768  # the CUDA default
    for _ in range(2):
        pairs = packed_and_separate(engine, Wide, TEXT)
        assert max(float((got - want).abs().max()) for got, want in pairs) < 1e-4


def test_batched_scores_equal_one_by_one_on_cuda(tiny_tokenizer, cuda_model):
    engine = PCDEngine(cuda_model, tiny_tokenizer, max_tokens_per_forward=300)
    assert_same_scores(engine.classify_batch(TEXTS, Wide), [engine.classify(t, Wide) for t in TEXTS])


def test_bf16_on_cuda_passes_the_self_check_and_rescoring_restores_fp32(tiny_tokenizer, cuda_model):
    fast = copy.deepcopy(cuda_model).to(torch.bfloat16)
    mixed = PCDEngine(fast, tiny_tokenizer, reference_model=cuda_model, rescore_margin=1.0)
    assert mixed.precision_check is not None and mixed.precision_check.passed
    fp32 = PCDEngine(cuda_model, tiny_tokenizer)
    assert_same_scores(mixed.classify_batch(TEXTS, Wide), [fp32.classify(t, Wide) for t in TEXTS])


def test_a_gpu_request_keeps_one_forward_call_on_a_many_valued_field(tiny_tokenizer, cuda_model):
    from typing import Literal

    from pydantic import BaseModel

    values = tuple(f"{w}_{k}_request" for w in ("billing", "bug", "refund", "parcel") for k in range(20))

    class Routing(BaseModel):
        queue: Literal[values]  # type: ignore[valid-type]

    engine = PCDEngine(cuda_model, tiny_tokenizer)  # the default shortlist policy, for CUDA
    assert engine.shortlist is not None and engine.shortlist.call_cost == 4096
    assert not engine.plan(Routing).shortlisted
    engine.classify(TEXT, Routing)
    assert engine.classify(TEXTS[0], Routing).diagnostics.forward_calls == 1
