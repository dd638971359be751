"""Calibration that survives a crash: each finished decoder layer is kept on disk
(checkpoint/layer_state.py) and `--resume` continues after the last one, to the same bytes
as an uninterrupted run; it does not redo the finished layers."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from ckpt_helpers import make_llama

import vllm_mxplus.calibration.rtn_aware as rtn_aware_mod
from vllm_mxplus.checkpoint.layer_state import STATE_FILE, state_dir
from vllm_mxplus.checkpoint.quantizer import quantize_checkpoint
from vllm_mxplus.errors import UsageError

LAYERS = 4
CALIB = dict(nsamples=4, seqlen=16, progress=False)
REAL_GPTQ = rtn_aware_mod.gptq


@pytest.fixture(scope="module")
def deep_llama(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_llama(tmp_path_factory.mktemp("src") / "llama4", layers=LAYERS, seed=5)


def _files(d: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(d.iterdir())}


def _layers_of(names: list[str]) -> set[int]:
    return {int(n.split("layers.")[1].split(".")[0]) for n in names}


def _counting_gptq(monkeypatch: pytest.MonkeyPatch, fail_at_layer: int | None) -> list[str]:
    """Wrap the per-group GPTQ: record each group's name; raise on layer `fail_at_layer`."""
    real = REAL_GPTQ
    seen: list[str] = []

    def wrapped(w, h, fmt, *, name, **kw):  # noqa: ANN001, ANN003, ANN202
        if fail_at_layer is not None and f"layers.{fail_at_layer}." in name:
            raise RuntimeError("injected failure")
        seen.append(name)
        return real(w, h, fmt, name=name, **kw)

    monkeypatch.setattr(rtn_aware_mod, "gptq", wrapped)
    return seen


def test_injected_failure_resumes_to_the_same_bytes(
    deep_llama: Path, tmp_path: Path, random_tokens: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    whole = tmp_path / "whole"
    quantize_checkpoint(deep_llama, whole, "mxfp4-mbs", method="gptq", **CALIB)
    dst = tmp_path / "q"
    seen = _counting_gptq(monkeypatch, fail_at_layer=2)
    with pytest.raises(RuntimeError, match="injected failure"):
        quantize_checkpoint(deep_llama, dst, "mxfp4-mbs", method="gptq", **CALIB)
    assert not dst.exists()
    assert _layers_of(seen) == {0, 1}
    state = json.loads((state_dir(dst) / STATE_FILE).read_text())
    assert state["done"] == 2

    seen = _counting_gptq(monkeypatch, fail_at_layer=None)
    quantize_checkpoint(deep_llama, dst, "mxfp4-mbs", method="gptq", resume=True, **CALIB)
    assert _layers_of(seen) == {2, 3}  # layers 0 and 1 were not calibrated again
    assert _files(dst) == _files(whole)
    assert not state_dir(dst).exists()  # finished: the state is gone


def test_resume_of_another_request_is_refused(
    deep_llama: Path, tmp_path: Path, random_tokens: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    dst = tmp_path / "q"
    _counting_gptq(monkeypatch, fail_at_layer=1)
    with pytest.raises(RuntimeError):
        quantize_checkpoint(deep_llama, dst, "mxfp4-mbs", method="gptq", **CALIB)
    with pytest.raises(UsageError, match=r"--resume: .* another request \(scheme differ\)"):
        quantize_checkpoint(deep_llama, dst, "nvfp4", method="gptq", resume=True, **CALIB)
    with pytest.raises(UsageError, match=r"tokens differ"):
        quantize_checkpoint(
            deep_llama, dst, "mxfp4-mbs", method="gptq", resume=True, nsamples=5, seqlen=16
        )
    # without --resume the old state is discarded and every layer is calibrated
    seen = _counting_gptq(monkeypatch, fail_at_layer=None)
    quantize_checkpoint(deep_llama, dst, "mxfp4-mbs", method="gptq", **CALIB)
    assert _layers_of(seen) == set(range(LAYERS))


def test_resume_needs_a_calibrated_method(deep_llama: Path, tmp_path: Path) -> None:
    with pytest.raises(UsageError, match="--resume .*--method rtn-aware or gptq"):
        quantize_checkpoint(deep_llama, tmp_path / "q", "mxfp4-mbs", resume=True, progress=False)


CHILD = """
import sys, time, torch
import vllm_mxplus.checkpoint.quantizer as qm
import vllm_mxplus.calibration.rtn_aware as ra

def tokens(src, calib=None, nsamples=32, seqlen=512):
    g = torch.Generator().manual_seed(0)
    return torch.randint(0, 96, (nsamples, seqlen), generator=g)

qm.calibration_tokens = tokens
real = ra.rtn_aware
def slow(*a, **k):  # >= 0.4 s per layer: the kill lands mid-run however fast calibration gets
    time.sleep(0.1)
    return real(*a, **k)
ra.rtn_aware = slow
from vllm_mxplus.checkpoint.cli_quantize import main
sys.exit(main(sys.argv[1:]))
"""


def _cli(src: Path, dst: Path, *extra: str) -> list[str]:
    return [
        sys.executable,
        "-c",
        CHILD,
        str(src),
        str(dst),
        "--scheme",
        "mxfp4-mbs",
        "--method",
        "rtn-aware",
        "--nsamples",
        "4",
        "--seqlen",
        "16",
        "--no-progress",
        "--device",
        "cpu",
        *extra,
    ]


@pytest.mark.slow  # a calibrated quantization killed and resumed: ~1 min
def test_sigkill_mid_calibration_then_resume(deep_llama: Path, tmp_path: Path) -> None:
    """A real process killed outright (SIGKILL) after 2 finished layers; `--resume` finishes
    the job to the bytes of an uninterrupted run of the same command."""
    env = dict(os.environ, PYTHONPATH=str(Path(__file__).resolve().parents[2]))
    whole = tmp_path / "whole"
    subprocess.run(_cli(deep_llama, whole), env=env, check=True, capture_output=True)
    dst = tmp_path / "q"
    state_file = state_dir(dst) / STATE_FILE
    proc = subprocess.Popen(
        _cli(deep_llama, dst), env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE
    )
    deadline = time.monotonic() + 120
    done = 0
    while proc.poll() is None and time.monotonic() < deadline:
        try:
            done = json.loads(state_file.read_text())["done"]
        except (OSError, ValueError):
            done = 0
        if done >= 2:
            break
        time.sleep(0.02)
    assert proc.poll() is None, "the run ended before it could be killed"
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    assert not dst.exists()
    killed_at = json.loads(state_file.read_text())["done"]
    assert 2 <= killed_at < LAYERS
    res = subprocess.run(_cli(deep_llama, dst, "--resume"), env=env, capture_output=True, text=True)
    assert res.returncode == 0, res.stderr
    assert f"{killed_at} decoder layer(s) already calibrated" in res.stderr
    assert _files(dst) == _files(whole)
    assert not state_dir(dst).exists()
