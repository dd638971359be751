"""A 60-second run of the soak test (`scripts/soak_server.py`) on the tiny model: the same
script, criteria and report as the 10-minute study in eval/soak/, shorter and smaller.

Slow (vLLM start-up + 60 s of load + 2 disconnect waves and bursts), so it is marked `slow`
as well as `vllm`.
"""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = [pytest.mark.vllm, pytest.mark.slow]

REPO = Path(__file__).resolve().parents[2]


def test_soak_smoke_passes(tmp_path: Path, subprocess_env) -> None:
    from tiny_models import build_tiny_llama

    # without the +inf "poison" embedding row of the shared tiny256: that one is the NaN test
    # of test_vllm_server.py, which accepts a 500 for it; the soak accepts no 5xx at all
    model = build_tiny_llama(tmp_path / "tiny256")
    report = tmp_path / "soak-smoke.md"
    log = tmp_path / "server.log"
    cmd = [
        sys.executable,
        str(REPO / "scripts" / "soak_server.py"),
        *("--model", str(model), "--quantization", "mxfp4-mbs"),
        *("--duration", "60", "--wave-every", "25", "--clients", "4"),
        *("--wave-size", "8", "--burst", "64", "--max-model-len", "256"),
        # the tiny model generates a wave's streams to the end before any disconnect reaches
        # it, so aborts are judged by the drain to zero running requests (the 10-minute
        # SmolLM2 study keeps the token check too)
        "--no-abort-token-check",
        *("--out", str(report), "--server-log", str(log)),
    ]
    r = subprocess.run(cmd, env=subprocess_env, capture_output=True, text=True, timeout=900)
    text = report.read_text() if report.exists() else ""
    assert r.returncode == 0, f"{r.stderr[-3000:]}\n{text}"
    assert "Verdict: **PASS**" in text
    # the run exercised what the criteria count: waves, bursts, streams, body checks
    assert re.search(r"^\| 2 \| 8 \| ", text, re.MULTILINE), text  # >= 2 waves of 8 streams
    for kind in ("stream-completion", "n-best", "logprobs", "over-length", "numeric-stress"):
        assert f"| {kind} |" in text, f"{kind} never ran:\n{text}"
