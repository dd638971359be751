"""`mxplus kernels`: builds (or finds) the CPU kernels, lists the backend per scheme, self-test."""

from __future__ import annotations

import shutil

import pytest

from vllm_mxplus.cli import main


@pytest.mark.skipif(shutil.which("c++") is None, reason="no C++ compiler (c++)")
def test_kernels_check(capsys):
    assert main(["kernels", "--check"]) == 0
    out = capsys.readouterr().out
    assert "CPU kernels: " in out and "mxplus_cpu_" in out
    assert "mxfp4-mbs      -> cpu-packed" in out and "nvfp4          -> cpu-packed" in out
    assert "mxplus         -> reference" in out
    assert "self-test: bit-exact, linear within bound" in out


def test_kernels_disabled(monkeypatch, capsys):
    monkeypatch.setenv("VLLM_MXPLUS_CPU_KERNELS", "0")
    assert main(["kernels"]) == 1
    assert "unavailable: disabled by VLLM_MXPLUS_CPU_KERNELS=0" in capsys.readouterr().out
