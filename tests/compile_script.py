"""Run a script that compiles kernels with Triton's own compiler (no interpreter) in a
subprocess, and return the JSON it prints last: the tests set TRITON_INTERPRET=1 in-process."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest


def compiled(script: str, tmp_path: Path, argv: list[str]) -> dict:
    """The JSON `script` prints on its last line, run with `argv` as sys.argv[1:], without the
    interpreter, its Triton cache in tmp_path."""
    pytest.importorskip("triton")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["TRITON_CACHE_DIR"] = str(tmp_path)
    # the script may import test modules, which import this one
    env["PYTHONPATH"] = os.pathsep.join([str(Path(__file__).parent), env.get("PYTHONPATH", "")])
    proc = subprocess.run(
        [sys.executable, "-c", script, *argv], capture_output=True, text=True, env=env,
        timeout=900,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])
