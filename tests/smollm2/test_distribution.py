"""`python -m build` makes a wheel and an sdist that install into a fresh virtual environment and
import from there, type markers included (no network: the build runs without isolation and the wheel
installs without dependencies, which the test's own environment lends)."""

from __future__ import annotations

import subprocess
import sys
import sysconfig
import tarfile
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.slow
def test_wheel_and_sdist_build_install_and_import(tmp_path):
    dist = tmp_path / "dist"
    built = subprocess.run(
        [sys.executable, "-m", "build", "--no-isolation", "--outdir", str(dist), str(ROOT)],
        capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert built.returncode == 0, built.stderr[-3000:]
    (wheel,) = dist.glob("*.whl")
    (sdist,) = dist.glob("*.tar.gz")
    names = zipfile.ZipFile(wheel).namelist()
    for package in ("pcd_engine", "minicpm_pcd_adapters"):
        assert f"{package}/py.typed" in names
    assert "minicpm_pcd_adapters/cli/main.py" in names
    assert any(n.endswith("entry_points.txt") for n in names)
    with tarfile.open(sdist) as archive:
        members = archive.getnames()
    assert any(m.endswith("/README.md") for m in members) and any(
        m.endswith("/CHANGELOG.md") for m in members
    )

    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True, timeout=300)
    python = venv / "bin" / "python"
    subprocess.run(
        [str(python), "-m", "pip", "install", "-q", "--no-deps", "--no-index", str(wheel)],
        check=True,
        timeout=300,
    )
    lend = sysconfig.get_paths()["purelib"]  # dependencies from this environment, after the venv's own
    code = (
        f"import sys; sys.path.append({lend!r})\n"
        "import pcd_engine, minicpm_pcd_adapters, minicpm_pcd_adapters.cli\n"
        "from pathlib import Path\n"
        f"assert Path(pcd_engine.__file__).is_relative_to({str(venv)!r}), pcd_engine.__file__\n"
        "assert (Path(pcd_engine.__file__).parent / 'py.typed').exists()\n"
        "print(pcd_engine.PCDEngine.__name__)\n"
    )
    run = subprocess.run([str(python), "-c", code], capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert run.returncode == 0 and run.stdout.strip() == "PCDEngine", run.stderr[-3000:]
    assert (venv / "bin" / "pcd").exists()
