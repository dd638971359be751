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


def test_speed_helpers_run_on_toy_shapes(monkeypatch):
    """The speed step's breakdowns (the decode sweep, the prefill pipeline apart, the replay
    floor) run end to end on toy shapes under the interpreter, each replay timed once on the
    CPU instead of captured: an API they call that moved fails here, not on the GPU."""
    import importlib.util
    import time

    import torch

    monkeypatch.setenv("TRITON_INTERPRET", "1")
    spec = importlib.util.spec_from_file_location("gpu_check", ROOT / "scripts" / "gpu_check.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)

    def once_ms(fn, x, reps=1):
        t0 = time.perf_counter()
        fn(x)
        return (time.perf_counter() - t0) * 1e3

    monkeypatch.setattr(mod, "_device", lambda: torch.device("cpu"))
    monkeypatch.setattr(mod, "_capability", lambda: 90)
    monkeypatch.setattr(mod, "_graph_replay_ms", once_ms)
    monkeypatch.setattr(mod, "SWEEP_SPLITS", (1, 2))
    monkeypatch.setattr(mod, "SWEEP_BLOCK_NS", (32,))
    monkeypatch.setattr(mod, "SWEEP_WARPS", (4,))
    monkeypatch.setattr(mod, "SWEEP_STAGES", (2,))
    monkeypatch.setattr(mod, "APART_NKM", (64, 256, 32))
    monkeypatch.setenv("VLLM_MXPLUS_BACKEND", "linear:reference")
    for m in (1, 16):
        case = mod.decode_sweep_case(("qkv", 64, 256), m)
        assert case["weight_bytes"] == 64 * 128 + 64 * 16 + 64 * 2  # codes, E8M0, MBS bytes
        assert isinstance(case["bn32 w4 s2 sk2"], float) and case["best"][0].startswith("bn32")
        assert isinstance(case["weight_a True"], float) and isinstance(
            case["weight_a False"], float
        )
    apart = mod.prefill_apart()["results"]
    assert set(apart) == {"mxfp4-mbs", "mxfp4-16-oas"}
    assert all(r["exact_rows"] == 32 and r["fp8_gemm_us"] > 0 for r in apart.values())
    assert all(r["whole_weight_held_us"] > 0 for r in apart.values())
    assert all(
        r["packed_gemm_m32_us"] > 0 and r["reencode_gemm_m32_us"] > 0 for r in apart.values()
    )
    assert mod.replay_floor()["ms"] > 0
    monkeypatch.setattr(mod, "SHAPES", mod.TOY_SHAPES)
    monkeypatch.setattr(mod, "SWEEP_PER_SM", (2, 4))
    per_sm = mod.layer_per_sm()
    assert set(per_sm) == {f"per_sm{p} M{m}_us" for p in (2, 4) for m in (1, 16)}
    assert "VLLM_MXPLUS_GPU_PROGRAMS_PER_SM" not in os.environ
    pdl = mod.layer_pdl()
    assert set(pdl) == {f"pdl{p} M{m}_us" for p in (1, 0) for m in (1, 16)}
    assert all(v > 0 for v in pdl.values()) and "VLLM_MXPLUS_GPU_PDL" not in os.environ
    monkeypatch.setattr(mod, "BORDER_MS", (8, 24))
    monkeypatch.setenv("VLLM_MXPLUS_BACKEND", mod.TRITON_ONLY)
    border = mod.border_case()
    assert set(border) == {"M8", "M24"}
    for row in border.values():
        assert row["decode_us"] > 0 and row["served_us"] > 0 and row["bf16_us"] > 0
        assert len(row["served_by"]) == len(mod.TOY_SHAPES)
        assert row["decode_vs_bf16"] == pytest.approx(row["bf16_us"] / row["decode_us"])
    assert border["M8"]["served_by"][0] == "triton-decode"
    monkeypatch.setenv("VLLM_MXPLUS_BACKEND", "linear:reference")
    monkeypatch.setattr(mod, "SWEEP_SHAPES", (("qkv", 64, 256),))
    monkeypatch.setenv("VLLM_MXPLUS_BACKEND", mod.TRITON_ONLY)
    for scheme in ("mxplus", "nvfp4"):
        r = mod.decode_vs_mx_gemm(scheme)
        assert r["backend"] == "triton-decode" and all(
            r[f"M{m}"]["mx_gemm_us"] > 0 for m in (1, 4, 16)
        )
