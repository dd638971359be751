"""scripts/gpu_check.py rehearsed on the CPU (GPU_CHECK_REHEARSE=1, Triton interpreter, toy
shapes): the `served`, `stack` and `correct` steps run their real checks (selection and
self-test of linears and of every expert kind; the 8B-shaped stack loaded, traced by
torch.compile and equal to eager bit for bit; QLinear through the `linear_dispatch` op against
float64) so that the first GPU call does not fail on an API that moved. CUDA graphs and
timings need the GPU: those checks say "skipped" here."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

pytestmark = pytest.mark.slow


@pytest.mark.parametrize(
    "step,least",
    [("served", 1 + 8), ("stack", 3), ("correct", 4)],
    ids=["served", "stack", "correct"],
)
def test_rehearsal_step_passes(tmp_path, step, least):
    env = {
        **os.environ,
        "GPU_CHECK_REHEARSE": "1",
        "TRITON_INTERPRET": "1",
        "GPU_CHECK_SCHEMES": "mxfp4-mbs",
        "PYTHONPATH": str(ROOT),
    }
    proc = subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "gpu_check.py"), step, "--out", str(tmp_path)],
        capture_output=True,
        text=True,
        env=env,
        timeout=600,
    )
    rec = json.loads((tmp_path / f"{step}.json").read_text())
    failed = [c for c in rec["checks"] if not c["ok"]]
    assert proc.returncode == 0 and rec["status"] == "ok", failed or proc.stderr[-2000:]
    assert len(rec["checks"]) >= least, rec["checks"]
