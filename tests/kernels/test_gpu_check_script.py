"""scripts/gpu_check.sh, rehearsed on a machine without a GPU: the dry run checks the
prerequisites and prints the plan (the build step says why it cannot build here), the
script parses, and a wrong option is an error."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
SCRIPT = REPO / "scripts" / "gpu_check.sh"

pytestmark = pytest.mark.skipif(shutil.which("bash") is None, reason="needs bash")


def _run(*args: str, **env: str) -> subprocess.CompletedProcess:
    full = {**os.environ, "PYTHON": sys.executable, "PYTHONPATH": str(REPO), **env}
    return subprocess.run(
        ["bash", str(SCRIPT), *args],
        capture_output=True,
        text=True,
        env=full,
        timeout=120,
        cwd=REPO,
    )


def test_script_parses():
    assert subprocess.run(["bash", "-n", str(SCRIPT)]).returncode == 0


def test_dry_run_prints_the_plan_and_runs_nothing(tmp_path):
    proc = _run("--dry-run", OUT=str(tmp_path / "out"))
    out = proc.stdout
    assert proc.returncode == 0, out + proc.stderr
    # the steps in the order the one device call runs them, each with its time box
    steps = [
        "0. prereq",
        "1. build",
        "2. served",
        "3. speed",
        "4. sweep",
        "5. stack",
        "6. pytest_gpu",
        "7. cutlass",
    ]
    at = [out.find(step) for step in steps]
    assert -1 not in at and at == sorted(at), out
    assert "dry run: nothing executed" in out
    assert not (tmp_path / "out").exists(), "a dry run must not write results"


def test_unknown_option_is_an_error():
    proc = _run("--bogus")
    assert proc.returncode == 2 and "unknown option --bogus" in proc.stderr


def _has_cuda() -> bool:
    import torch

    return torch.cuda.is_available()
