"""SHA-256 manifests of a model folder (manifest.py): every file listed, and a changed, missing or
unlisted file refused by name."""

from __future__ import annotations

import pytest

from pcd_engine import ModelIntegrityError
from pcd_engine.manifest import create_manifest, model_files, verify_manifest, write_manifest
from tests.helpers import flip_a_byte


def test_a_manifest_lists_every_model_file_and_accepts_the_folder_it_came_from(folder):
    (folder / "README.md").write_text("not a model file")
    (folder / "__pycache__").mkdir()
    (folder / "__pycache__" / "x.py").write_text("")
    manifest = create_manifest(folder)
    assert set(manifest["files"]) == set(model_files(folder))
    assert "model.safetensors" in manifest["files"] and "config.json" in manifest["files"]
    assert "tokenizer.json" in manifest["files"] and "README.md" not in manifest["files"]
    assert not any("__pycache__" in name for name in manifest["files"])
    verify_manifest(folder, manifest)  # no error
    written = write_manifest(folder)
    assert written.name == "pcd-manifest.json" and "pcd-manifest.json" not in model_files(folder)
    verify_manifest(folder, written)


@pytest.mark.parametrize("change", ["flip a weight byte", "delete the config", "add a pickled weight file"])
def test_a_changed_missing_or_unlisted_file_is_refused_by_name(folder, change):
    manifest = create_manifest(folder)
    if change == "flip a weight byte":
        flip_a_byte(folder / "model.safetensors")
        named, words = "model.safetensors", "differs"
    elif change == "delete the config":
        (folder / "config.json").unlink()
        named, words = "config.json", "missing"
    else:
        (folder / "pytorch_model.bin").write_bytes(b"\x80\x04pickle")
        named, words = "pytorch_model.bin", "not in the manifest"
    with pytest.raises(ModelIntegrityError, match=words) as caught:
        verify_manifest(folder, manifest)
    assert caught.value.file == named and named in str(caught.value)
