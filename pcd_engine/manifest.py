"""Model integrity: a manifest of the SHA-256 of every weight, config and tokenizer file of a model
folder, written once (`pcd manifest create DIR`) and checked before loading (`manifest=`).

A manifest lists files by their path relative to the folder. The check refuses, naming the file: a
listed file that is missing or differs, and a model file in the folder that the manifest does not list
(an extra weight file could be the one that loads). Keep the manifest where the weights cannot be
rewritten by whoever could tamper with them (in your repository, next to your deploy config).

    >>> manifest = create_manifest("/models/MiniCPM5-2B")  # doctest: +SKIP
    >>> verify_manifest("/models/MiniCPM5-2B", manifest)  # doctest: +SKIP
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from pcd_engine.errors import ModelIntegrityError

FORMAT = "pcd-manifest/1"
MANIFEST_NAME = "pcd-manifest.json"
# What a loader may read: weights, configs, tokenizers, chat templates and remote code.
MODEL_FILE_PATTERNS = (
    "*.safetensors",
    "*.gguf",
    "*.bin",
    "*.pt",
    "*.pth",
    "*.ckpt",
    "*.json",
    "*.model",
    "*.tiktoken",
    "*.txt",
    "*.jinja",
    "*.py",
)


def model_files(folder: str | os.PathLike[str]) -> list[str]:
    """The model files under `folder`, as sorted POSIX paths relative to it (hidden files and folders,
    `__pycache__` and the manifest itself left out)."""
    root = Path(folder)
    found = set()
    for pattern in MODEL_FILE_PATTERNS:
        for path in root.rglob(pattern):
            relative = path.relative_to(root)
            hidden = any(part.startswith(".") or part == "__pycache__" for part in relative.parts)
            if path.is_file() and not hidden and relative.name != MANIFEST_NAME:
                found.add(relative.as_posix())
    return sorted(found)


def sha256_file(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as handle:
        while chunk := handle.read(1 << 20):
            digest.update(chunk)
    return digest.hexdigest()


def create_manifest(folder: str | os.PathLike[str], *, revision: str | None = None) -> dict[str, Any]:
    """The manifest of `folder`. `revision` (the hub commit the files come from) is recorded; for a
    hub cache snapshot folder (`.../snapshots/<commit>`) it is that commit."""
    root = Path(folder)
    if not root.is_dir():
        raise ModelIntegrityError(f"{root} is not a folder", str(root))
    names = model_files(root)
    if not names:
        raise ModelIntegrityError(f"{root} holds no weight, config or tokenizer file", str(root))
    if revision is None and root.resolve().parent.name == "snapshots":
        revision = root.resolve().name
    files = {
        name: {"sha256": sha256_file(root / name), "size": (root / name).stat().st_size} for name in names
    }
    return {"format": FORMAT, "revision": revision, "files": files}


def write_manifest(
    folder: str | os.PathLike[str],
    output: str | os.PathLike[str] | None = None,
    *,
    revision: str | None = None,
) -> Path:
    """Write the manifest of `folder` as JSON to `output` (default: `folder/pcd-manifest.json`)."""
    target = Path(output) if output is not None else Path(folder) / MANIFEST_NAME
    manifest = create_manifest(folder, revision=revision)
    target.write_text(json.dumps(manifest, indent=2, sort_keys=True) + "\n", encoding="utf-8")
    return target


def read_manifest(manifest: str | os.PathLike[str] | Mapping[str, Any]) -> dict[str, Any]:
    """A manifest from a JSON file or a dict, its shape checked."""
    where = "the manifest"
    if not isinstance(manifest, Mapping):
        where = str(manifest)
        try:
            manifest = json.loads(Path(manifest).read_text(encoding="utf-8"))
        except (OSError, ValueError) as error:
            raise ModelIntegrityError(f"cannot read manifest {where}: {error}", where) from error
    files = manifest.get("files") if isinstance(manifest, Mapping) else None
    if (
        not isinstance(manifest, Mapping)
        or manifest.get("format") != FORMAT
        or not isinstance(files, Mapping)
    ):
        raise ModelIntegrityError(f"{where} is not a {FORMAT} manifest (from `pcd manifest create`)", where)
    for name, entry in files.items():
        if not (isinstance(entry, Mapping) and isinstance(entry.get("sha256"), str)):
            raise ModelIntegrityError(f"{where}: entry {name!r} has no sha256", where)
    return dict(manifest)


def verify_manifest(
    folder: str | os.PathLike[str],
    manifest: str | os.PathLike[str] | Mapping[str, Any],
    *,
    revision: str | None = None,
) -> None:
    """Raise ModelIntegrityError, naming the file, unless `folder` holds exactly the manifest's model
    files with its hashes (and, when both are known, comes from the manifest's revision)."""
    expected = read_manifest(manifest)
    root = Path(folder)
    recorded = expected.get("revision")
    if revision is not None and recorded is not None and revision != recorded:
        raise ModelIntegrityError(
            f"the manifest is for revision {recorded}, but revision {revision} is being loaded", str(root)
        )
    files: Mapping[str, Mapping[str, Any]] = expected["files"]
    for name in model_files(root):
        if name not in files:
            raise ModelIntegrityError(f"{root / name} is not in the manifest (an unlisted model file)", name)
    for name, entry in sorted(files.items()):
        path = root / name
        if not path.is_file():
            raise ModelIntegrityError(f"{path} is listed in the manifest but missing", name)
        size = entry.get("size")
        if size is not None and path.stat().st_size != size:
            raise ModelIntegrityError(
                f"{path} is {path.stat().st_size} bytes; the manifest says {size} (the file differs)", name
            )
        actual = sha256_file(path)
        if actual != entry["sha256"]:
            raise ModelIntegrityError(
                f"{path} has SHA-256 {actual}; the manifest says {entry['sha256']} (the file differs)", name
            )
