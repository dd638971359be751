"""benchmarks/gpu_measured_vs_static.py on the committed H200 run: every timed case is printed
with its measured and estimated figures from the file (not recomputed or invented), marked
MEASURED and STATIC ESTIMATE, and a file that holds no speed step is refused by name."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
RUN = ROOT / "benchmarks" / "results" / "gpu_check_h200_5788301.json"


def _module():
    spec = importlib.util.spec_from_file_location(
        "gpu_measured_vs_static", ROOT / "benchmarks" / "gpu_measured_vs_static.py"
    )
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_table_carries_the_runs_figures(capsys):
    assert _module().main([str(RUN)]) == 0
    out = capsys.readouterr().out
    assert "MEASURED" in out and "STATIC ESTIMATE" in out and "5788301" in out
    speed = json.loads(RUN.read_text())["speed"]
    timed = [c for c in speed["checks"] if "M" in c and c["ok"]]
    assert len(timed) >= 8
    for c in timed:
        scheme = c["check"].split()[0]
        line = next(ln for ln in out.splitlines() if ln.startswith(f"| {scheme} | {c['M']} |"))
        assert f"{c['ms'] * 1e3:.1f}" in line and f"{c['speedup_vs_bf16']:.2f}×" in line
        if "static_estimate" in c:
            assert f"{c['static_estimate']['speedup_vs_bf16']:.2f}×" in line
    assert "FAILED nvfp4" in out  # the run's failure is shown, not dropped


def test_a_file_without_a_speed_step_is_refused(tmp_path):
    bad = tmp_path / "x.json"
    bad.write_text(json.dumps({"step": "served", "checks": []}))
    with pytest.raises(SystemExit, match="neither a speed step"):
        _module().main([str(bad)])
