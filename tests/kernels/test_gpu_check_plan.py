"""scripts/gpu_check.sh / gpu_check.py planned for one device call, checked on the CPU: the
dry run prints the steps in order with boxes inside the budget, runs nothing, and a step
that cannot run still leaves its JSON record (status "failed", the reason)."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
ORDER = ["prereq", "build", "served", "speed", "sweep", "stack", "pytest_gpu", "cutlass", "correct"]


def _module():
    spec = importlib.util.spec_from_file_location("gpu_check", ROOT / "scripts" / "gpu_check.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@pytest.mark.parametrize("budget", [570, 300, 120])
def test_boxes_fit_the_budget_in_order(budget):
    boxes = _module().time_boxes(budget)
    assert [name for name, _, _ in boxes] == ORDER
    assert sum(b for _, b, _ in boxes) <= budget
    assert all(b >= 5 for name, b, _ in boxes if name not in ("build", "correct"))


@pytest.mark.parametrize("budget", ["570", "300"])
def test_shell_dry_run_prints_the_plan_and_runs_nothing(tmp_path, budget):
    out = tmp_path / "out"
    env = {**os.environ, "OUT": str(out), "PYTHON": sys.executable}
    res = subprocess.run(
        ["bash", str(ROOT / "scripts" / "gpu_check.sh"), "--dry-run", "--budget", budget],
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
        check=True,
    )
    text = res.stdout
    pos = [text.index(f" {name} ") for name in ORDER]
    assert pos == sorted(pos), text
    assert f"plan for a {budget} s budget" in text and "nothing executed" in text
    assert not out.exists()


def test_shell_rejects_a_bad_budget():
    res = subprocess.run(
        ["bash", str(ROOT / "scripts" / "gpu_check.sh"), "--budget", "ten"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert res.returncode == 2 and "whole seconds" in res.stderr


def test_step_record_lifecycle(tmp_path):
    mod = _module()
    st = mod.Step("served", tmp_path)
    assert json.loads((tmp_path / "served.json").read_text())["status"] == "started"
    st.check("good", lambda: {"value": 1})
    assert json.loads((tmp_path / "served.json").read_text())["status"] == "running"
    st.check("bad", lambda: 1 / 0)
    assert st.finish() == 1
    rec = json.loads((tmp_path / "served.json").read_text())
    assert rec["status"] == "failed" and rec["failed"] == ["bad"]
    assert rec["checks"][0]["ok"] and "ZeroDivisionError" in rec["checks"][1]["error"]


def test_step_without_cuda_records_why(tmp_path):
    """On this CPU machine a step cannot start: its JSON says so (never a missing file)."""
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    res = subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "gpu_check.py"), "served", "--out", str(tmp_path)],
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
    )
    rec = json.loads((tmp_path / "served.json").read_text())
    assert res.returncode == 1 and rec["status"] == "failed"
    assert "CUDA" in rec["checks"][0]["error"]


def test_speed_step_finds_the_static_estimate_of_each_timed_case():
    """The speed step's side-by-side figure is the committed static model's case for the same
    GPU, scheme and M (one layer: the whole forward / the layer count), and none elsewhere."""
    mod = _module()
    static = json.loads(mod.STATIC_JSON.read_text())
    assert "static estimate" in static["what"] and static["commit"]
    from benchmarks import gpu_static_model as gsm

    for m in (1, 16, 128, 256, 4096):
        row = next(r for r in static["estimates"]["H200"] if r["M"] == m)
        est = mod.static_beside(static, 90, "mxfp4-mbs", m)
        assert est["ms"] == pytest.approx(row["estimate_ms"] / gsm.LAYERS)
        assert est["bf16_ms"] / est["ms"] == pytest.approx(row["speedup_vs_bf16"])
    for fmt in ("mxfp4-16-oas", "nvfp4", "mxplus"):
        row = next(r for r in static["decode_per_format_m1"]["H200"] if r["format"] == fmt)
        assert mod.static_beside(static, 90, fmt, 1)["speedup_vs_bf16"] == row["speedup_vs_bf16"]
        assert mod.static_beside(static, 90, fmt, 16) is None  # not modelled per format
    assert mod.static_beside(static, 80, "mxfp4-mbs", 1) is None  # no A100 in the model
    assert mod.static_beside(None, 90, "mxfp4-mbs", 1) is None
    assert set(mod.SPEED_MS) <= set(mod.ALL_SCHEMES)
