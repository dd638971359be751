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


def _border_sweep(times: dict[int, tuple[float, float]]) -> dict:
    """A sweep step record whose border case has (decode µs, served µs) per M."""
    case = {"check": "batched decode border: decode path vs served path vs bf16", "ok": True}
    for m, (dec, served) in times.items():
        case[f"M{m}"] = {"decode_us": dec, "served_us": served, "bf16_us": 100.0,
                         "served_by": ["triton-decode" if m <= 128 else "triton-fp8-prefill"],
                         "decode_vs_bf16": 100.0 / dec, "served_vs_bf16": 100.0 / served}  # fmt: skip
    return {"step": "sweep", "checks": [{"check": "replay floor", "ok": True}, case]}


def test_border_table_and_where_decode_stops(tmp_path, capsys):
    mod = _module()
    sweep = _border_sweep({256: (90.0, 80.0), 64: (50.0, 50.0), 128: (60.0, 70.0),
                           512: (150.0, 200.0)})  # fmt: skip
    lines = mod.border(sweep)
    assert [ln.split("|")[1].strip() for ln in lines[2:6]] == ["64", "128", "256", "512"]
    assert "| 128 | 60.0 | 70.0 (triton-decode) | 100.0 | 1.67× | 1.43× |" in lines
    # ahead (or level) at 64 and 128, behind at 256: 512's lead after that does not count
    assert lines[-1].endswith("up to M = 128 of those measured")
    assert mod.border(_border_sweep({64: (60.0, 50.0), 128: (40.0, 50.0)}))[-1].endswith(
        "behind the served path at every M measured"
    )
    assert mod.border({"step": "sweep", "checks": []}) == []
    failed = {"step": "sweep", "checks": [{"check": "batched decode border: x", "ok": False,
                                           "error": "OOM"}]}  # fmt: skip
    assert mod.border(failed) == ["- FAILED batched decode border: x: OOM"]
    # the CLI: the committed speed record with a sweep.json beside it
    path = tmp_path / "sweep.json"
    path.write_text(json.dumps(sweep))
    assert mod.main([str(RUN), "--sweep", str(path)]) == 0
    out = capsys.readouterr().out
    assert "batched decode / prefill border" in out and "up to M = 128" in out
    path.write_text(json.dumps({"step": "speed"}))
    with pytest.raises(SystemExit, match="sweep.json: neither a sweep step"):
        mod.main([str(RUN), "--sweep", str(path)])
