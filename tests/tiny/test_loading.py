"""Loading a model as users do: a hub id resolved offline from the local cache (at once when the hub is
unreachable), safetensors only for downloaded weights, and manifests of SHA-256 hashes checked before
anything loads (the manifests themselves: test_manifest.py). The model is the tiny random Llama,
saved as a folder and as hub cache snapshots."""

from __future__ import annotations

import copy
import shutil
import subprocess
import sys
import time
import urllib.request
from pathlib import Path
from typing import Literal

import pytest
import torch
from huggingface_hub import constants
from pydantic import BaseModel

from minicpm_pcd_adapters.minicpm import MINICPM5_2B, load_minicpm5
from pcd_engine import ModelIntegrityError, ModelLoadError, PCDEngine
from pcd_engine.manifest import create_manifest, verify_manifest
from tests.helpers import flip_a_byte

COMMIT = "0123456789abcdef0123456789abcdef01234567"


class Ticket(BaseModel):
    topic: Literal["billing", "bug", "other"]
    urgent: bool


def _snapshot(cache: Path, repo_id: str, source: str | Path, commit: str = COMMIT) -> Path:
    """Lay a model folder out as huggingface_hub's cache does: models--owner--name/snapshots/<commit>."""
    target = cache / f"models--{repo_id.replace('/', '--')}" / "snapshots" / commit
    shutil.copytree(source, target)
    return target


@pytest.fixture
def unreachable_hub(monkeypatch):
    """Network allowed as far as the settings go, but nothing answers at the hub's address."""
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    monkeypatch.setattr(constants, "ENDPOINT", "http://127.0.0.1:9")  # the discard port: refused


def test_loading_with_a_manifest_checks_the_files_before_the_weights_load(folder, tiny_tokenizer):
    manifest = create_manifest(folder)
    engine = PCDEngine.from_pretrained(folder, device="cpu", manifest=manifest)
    assert engine.classify("I was charged twice", Ticket).value.topic in {"billing", "bug", "other"}
    flip_a_byte(folder / "model.safetensors")  # still loadable: only the manifest can tell
    with pytest.raises(ModelIntegrityError, match=r"model\.safetensors"):
        PCDEngine.from_pretrained(folder, device="cpu", manifest=manifest)
    with pytest.raises(ModelIntegrityError, match="not a pcd-manifest/1 manifest"):
        PCDEngine.from_pretrained(folder, device="cpu", manifest={"files": {}})


def test_a_hub_id_loads_from_the_cache_at_once_when_the_hub_is_unreachable(folder, tmp_path, unreachable_hub):
    cache = tmp_path / "hub"
    snapshot = _snapshot(cache, "pcd-test/tiny", folder)
    started = time.perf_counter()
    engine = PCDEngine.from_pretrained(
        "pcd-test/tiny", revision=COMMIT, device="cpu", model_kwargs={"cache_dir": cache}
    )
    assert time.perf_counter() - started < 20
    local = PCDEngine.from_pretrained(folder, device="cpu")
    text = "The app crashes when I log in"
    assert engine.classify(text, Ticket).value == local.classify(text, Ticket).value
    manifest = create_manifest(snapshot)
    assert manifest["revision"] == COMMIT  # read from the snapshot folder's name
    with pytest.raises(ModelIntegrityError, match="revision"):
        verify_manifest(snapshot, manifest, revision="f" * 40)


def test_an_uncached_hub_id_fails_at_once_when_the_hub_is_unreachable(tmp_path, unreachable_hub):
    started = time.perf_counter()
    with pytest.raises(ModelLoadError) as caught:
        PCDEngine.from_pretrained("pcd-test/absent", revision=COMMIT, model_kwargs={"cache_dir": tmp_path})
    assert time.perf_counter() - started < 10
    message = str(caught.value)
    assert "hub cannot be used" in message and "127.0.0.1:9" in message
    assert "not in the local cache" in message
    assert "hf download pcd-test/absent --revision" in message


def test_hf_hub_offline_skips_the_probe(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")

    def no_network(*args, **kwargs):
        raise AssertionError("the hub was probed although HF_HUB_OFFLINE is set")

    monkeypatch.setattr(urllib.request, "urlopen", no_network)
    with pytest.raises(ModelLoadError, match="HF_HUB_OFFLINE is set"):
        PCDEngine.from_pretrained("pcd-test/absent", model_kwargs={"cache_dir": tmp_path})


def test_downloaded_weights_must_be_safetensors(tiny_model, tiny_tokenizer, tmp_path, unreachable_hub):
    pickled = tmp_path / "pickled"
    pickled.mkdir()
    tiny_model.config.save_pretrained(pickled)
    tiny_tokenizer.save_pretrained(pickled)
    torch.save(tiny_model.state_dict(), pickled / "pytorch_model.bin")
    cache = tmp_path / "hub"
    _snapshot(cache, "pcd-test/pickled", pickled)
    with pytest.raises(ModelLoadError, match="safetensors"):
        PCDEngine.from_pretrained("pcd-test/pickled", revision=COMMIT, model_kwargs={"cache_dir": cache})


def test_the_minicpm5_default_checks_a_manifest_for_its_pinned_revision(folder, tmp_path, unreachable_hub):
    """The default model's own path: hub id, pinned revision, cache snapshot, manifest. The weights
    are the tiny model's, laid out where MiniCPM5-2B's pinned snapshot would be."""
    cache = tmp_path / "hub"
    assert MINICPM5_2B.revision is not None
    snapshot = _snapshot(cache, MINICPM5_2B.hub_id, folder, MINICPM5_2B.revision)
    manifest = create_manifest(snapshot)
    engine = load_minicpm5(device="cpu", manifest=manifest, model_kwargs={"cache_dir": cache})
    assert engine.classify("refund me", Ticket).value.topic in {"billing", "bug", "other"}
    flip_a_byte(snapshot / "tokenizer.json")
    with pytest.raises(ModelIntegrityError, match=r"tokenizer\.json"):
        load_minicpm5(device="cpu", manifest=manifest, model_kwargs={"cache_dir": cache})


def test_pcd_manifest_create_and_verify_and_classify_refusing_a_changed_model(folder, tmp_path):
    manifest = tmp_path / "model.manifest.json"

    def pcd(*args: str) -> subprocess.CompletedProcess[str]:
        command = [sys.executable, "-m", "minicpm_pcd_adapters.cli", *args]
        return subprocess.run(command, capture_output=True, text=True, timeout=300)

    created = pcd("manifest", "create", str(folder), "--output", str(manifest))
    assert created.returncode == 0, created.stderr
    assert pcd("manifest", "verify", str(folder), "--manifest", str(manifest)).returncode == 0
    flip_a_byte(folder / "model.safetensors")
    refused = pcd("manifest", "verify", str(folder), "--manifest", str(manifest))
    assert refused.returncode == 2 and "model.safetensors" in refused.stderr
    texts = tmp_path / "texts.txt"
    texts.write_text("refund me\n")
    classify = pcd(
        "classify", "--schema", f"{__file__}:Ticket", "--input", str(texts), "--output",
        str(tmp_path / "out.jsonl"), "--model", str(folder), "--device", "cpu", "--manifest", str(manifest),
    )  # fmt: skip
    assert classify.returncode == 2 and "model.safetensors" in classify.stderr
    assert not (tmp_path / "out.jsonl").exists()


def test_a_kept_conversion_is_found_by_the_files_digest_and_a_cache_that_cannot_be_written_is_skipped(
    tiny_model, tiny_tokenizer, tmp_path, monkeypatch
):
    from pcd_engine import gguf_cache

    source = tmp_path / "model.gguf"  # what `keep` reads of it: its bytes, for the digest
    source.write_bytes(b"GGUF" + bytes(range(256)) * 64)
    monkeypatch.setenv("MINICPM_PCD_CACHE", str(tmp_path / "cache"))
    assert gguf_cache.converted(source) is None
    folder = gguf_cache.keep(source, tiny_model, tiny_tokenizer)
    assert folder == gguf_cache.converted(source) == tmp_path / "cache" / "gguf" / gguf_cache.digest(source)
    assert not [p for p in folder.parent.iterdir() if p.name.endswith(".partial")]
    loaded = PCDEngine.from_pretrained(folder, device="cpu").model
    for name, weight in tiny_model.state_dict().items():
        assert torch.equal(loaded.state_dict()[name], weight)
    source.write_bytes(source.read_bytes() + b"changed")
    assert gguf_cache.converted(source) is None  # another file: another digest
    blocked = tmp_path / "a-file"
    blocked.write_text("")
    monkeypatch.setenv("MINICPM_PCD_CACHE", str(blocked))  # its gguf/ folder cannot be made
    with pytest.warns(UserWarning, match="was not kept"):
        assert gguf_cache.keep(source, tiny_model, tiny_tokenizer) is None
    lower = copy.deepcopy(tiny_model).to(torch.bfloat16)
    assert gguf_cache.keep(source, lower, tiny_tokenizer) is None  # float32 only
