"""The CUTLASS extension builds from an installed package: its C++ sources are package data,
found next to `vllm_mxplus.backends.cutlass.build`, not in the checkout's kernels/ directory."""

from __future__ import annotations

import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import vllm_mxplus
from vllm_mxplus.backends.cutlass import build as cutlass_ext

REPO = Path(__file__).resolve().parents[2]


def test_sources_live_in_the_package():
    pkg = Path(vllm_mxplus.__file__).resolve().parent
    for path in cutlass_ext.source_files():
        assert path.is_file() and path.is_relative_to(pkg), path


def test_wheel_ships_the_sources(tmp_path):
    """Build a wheel from a copy of the project (no build isolation, no network) and look for
    every source the build step needs."""
    src = tmp_path / "src"
    src.mkdir()
    for name in ("pyproject.toml", "README.md"):
        shutil.copy2(REPO / name, src / name)
    shutil.copytree(
        REPO / "vllm_mxplus",
        src / "vllm_mxplus",
        ignore=shutil.ignore_patterns("__pycache__", "*.so"),
    )
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "wheel",
            "--no-deps",
            "--no-build-isolation",
            "-q",
            "-w",
            str(tmp_path / "dist"),
            str(src),
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    (wheel,) = (tmp_path / "dist").glob("*.whl")
    names = set(zipfile.ZipFile(wheel).namelist())
    for path in cutlass_ext.source_files():
        rel = path.relative_to(Path(vllm_mxplus.__file__).resolve().parents[1]).as_posix()
        assert rel in names, f"{rel} missing from {wheel.name}"
