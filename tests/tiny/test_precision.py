"""Lower precision: the load-time self-check and FP32 re-scoring of close calls (tiny random Llama)."""

from __future__ import annotations

import copy
import warnings

import pytest
import torch

from pcd_engine import PCDEngine, PrecisionCheckError
from pcd_engine import packing as packing_module
from tests.helpers import TEXTS, Wide, assert_same_scores


@pytest.fixture(scope="module")
def bf16_model(tiny_model):
    return copy.deepcopy(tiny_model).to(torch.bfloat16)


def test_a_bf16_model_passes_the_self_check_at_start_up(tiny_tokenizer, bf16_model, tiny_model):
    engine = PCDEngine(bf16_model, tiny_tokenizer)
    check = engine.precision_check
    assert check is not None and check.passed and check.dtype == "bfloat16"
    assert 0.0 < check.max_abs_diff <= check.tolerance  # bf16 rounding shows, within tolerance
    assert check.candidates == 2 * 8  # two texts x (3 topics + 3 sentiments + 2 booleans)
    assert PCDEngine(tiny_model, tiny_tokenizer).precision_check is None  # fp32 needs no check


def test_the_self_check_fails_when_the_packed_path_is_broken(tiny_tokenizer, bf16_model, monkeypatch):
    real = packing_module.pack_rows

    def leaky(prompts, past_len, trees):  # every token may see every other: a broken mask
        packed = real(prompts, past_len, trees)
        return packed._replace(allowed=torch.ones_like(packed.allowed))

    monkeypatch.setattr(packing_module, "pack_rows", leaky)
    with pytest.raises(PrecisionCheckError, match="self-check failed in bfloat16") as caught:
        PCDEngine(bf16_model, tiny_tokenizer)
    assert caught.value.check.max_abs_diff > caught.value.check.tolerance
    assert PCDEngine(bf16_model, tiny_tokenizer, self_check=False).precision_check is None


def test_rescoring_everything_gives_the_fp32_results(tiny_tokenizer, tiny_model, bf16_model):
    fp32 = PCDEngine(tiny_model, tiny_tokenizer)
    mixed = PCDEngine(bf16_model, tiny_tokenizer, reference_model=tiny_model, rescore_margin=1.0)
    want = [fp32.classify(text, Wide) for text in TEXTS]
    got = mixed.classify_batch(TEXTS, Wide)
    assert_same_scores(got, want)
    scored = [f for r in got for f in r.fields.values() if f.rule not in ("fixed", "generated")]
    assert scored and all(f.rescored for f in scored)
    assert all(r.diagnostics.rescored_fields == len(r.fields) for r in got)
    assert mixed.rescorer is not None and mixed.rescorer.rescored_fields == len(scored)


def test_only_fields_below_the_margin_are_rescored(tiny_tokenizer, tiny_model, bf16_model):
    fp32 = PCDEngine(tiny_model, tiny_tokenizer)
    alone = PCDEngine(bf16_model, tiny_tokenizer, self_check=False)
    lows = [alone.classify(text, Wide) for text in TEXTS]
    margins = sorted(f.margin for r in lows for f in r.fields.values() if f.margin)
    margin = margins[len(margins) // 2]  # half the fields are close calls
    mixed = PCDEngine(bf16_model, tiny_tokenizer, reference_model=tiny_model, rescore_margin=margin)
    seen = set()
    for text, low in zip(TEXTS, lows, strict=True):
        result, reference = mixed.classify(text, Wide), fp32.classify(text, Wide)
        for path, field in result.fields.items():
            close = low.fields[path].margin < margin
            seen.add(close)
            assert field.rescored == close
            if close:  # decided as FP32 decides it
                assert field.value == reference.fields[path].value
                assert field.log_scores == pytest.approx(reference.fields[path].log_scores, abs=1e-4)
            else:
                assert field.log_scores == low.fields[path].log_scores
    assert seen == {True, False}  # the texts exercise both branches


def test_bad_rescoring_options_are_rejected(tiny_tokenizer, tiny_model, bf16_model):
    with pytest.raises(ValueError, match="rescore_margin"):
        PCDEngine(bf16_model, tiny_tokenizer, reference_model=tiny_model, rescore_margin=0.0)
    with pytest.raises(ValueError, match="float32"):
        PCDEngine(tiny_model, tiny_tokenizer, reference_model=bf16_model, self_check=False)


def test_from_pretrained_keeps_an_fp32_reference_beside_the_bf16_copy(tmp_path, tiny_tokenizer, tiny_model):
    tiny_model.save_pretrained(tmp_path)
    tiny_tokenizer.save_pretrained(tmp_path)
    engine = PCDEngine.from_pretrained(tmp_path, device="cpu", dtype="bfloat16", fp32_rescore=True)
    assert engine.runner.dtype == torch.bfloat16
    assert engine.rescorer is not None and engine.rescorer.runner.dtype == torch.float32
    assert engine.precision_check is not None and engine.precision_check.passed
    plain = PCDEngine.from_pretrained(tmp_path, device="cpu", dtype="bfloat16")
    assert plain.rescorer is None and plain.runner.dtype == torch.bfloat16


def test_auto_dtype_and_the_warning_follow_the_cpus_native_bf16(tiny_tokenizer, bf16_model, monkeypatch):
    from pcd_engine import loading

    for native in (True, False):
        monkeypatch.setattr(torch.cpu, "_is_avx512_bf16_supported", lambda native=native: native)
        monkeypatch.setattr(torch.cpu, "_is_amx_tile_supported", lambda: False)
        assert loading.native_bf16("cpu") is native
        assert loading.resolve_dtype("auto", "cpu") == (torch.bfloat16 if native else torch.float32)
        with warnings.catch_warnings(record=True) as seen:
            warnings.simplefilter("always")
            PCDEngine(bf16_model, tiny_tokenizer, self_check=False)
        emulated = [w for w in seen if "no native bf16" in str(w.message)]
        assert len(emulated) == (0 if native else 1)
    assert loading.resolve_dtype("float32", "cpu") == torch.float32
    with pytest.raises(ValueError, match="or 'auto'"):
        loading.resolve_dtype("fast", "cpu")
