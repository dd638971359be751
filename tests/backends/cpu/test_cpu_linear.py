"""The cpu-packed backend in the dispatch: chosen alone on CPU for every scheme (E8M0, NVFP4,
MX+), the reference when the kernels are disabled or fail to build (with the reason), only
packed uint8 weight bytes on the layer, and the same numbers as the reference backend within
the integer GEMM's bounds (csrc/mx_gemm_cpu.cpp, mx_nvfp4_cpu.cpp, mx_mxplus_cpu.cpp)."""

from __future__ import annotations

import logging
import shutil

import pytest
import torch

from vllm_mxplus.backends import selection as dispatch
from vllm_mxplus.backends.base import LinearSpec
from vllm_mxplus.backends.cpu import kernels as cpu_kernels
from vllm_mxplus.backends.linear_op import LinearDispatch
from vllm_mxplus.backends.reference.linear import WEIGHT_ATTR, ReferenceBackend
from vllm_mxplus.backends.selection import select
from vllm_mxplus.formats import fake_quantize, quantize

pytestmark = pytest.mark.skipif(shutil.which("c++") is None, reason="no C++ compiler (c++)")

E8M0_SCHEMES = ["mxfp4-ocp", "mxfp4-16-oas", "mxfp4-mbs-s", "mxfp4-mbs-h", "mxfp4-mbs"]
PACKED_SCHEMES = E8M0_SCHEMES + ["nvfp4", "mxplus"]


@pytest.fixture
def fresh_log(monkeypatch):
    monkeypatch.setattr(dispatch, "_LOGGED", set())
    monkeypatch.setattr(logging.getLogger("vllm_mxplus"), "propagate", True)


def selection_messages(caplog) -> list[str]:
    """The selector's own log lines (a self-test at first use may log before them)."""
    return [r.getMessage() for r in caplog.records if r.name == dispatch.logger.name]


@pytest.mark.parametrize("scheme", PACKED_SCHEMES)
def test_chosen_alone_for_e8m0_schemes(scheme, fresh_log, caplog):
    caplog.set_level(logging.INFO, logger="vllm_mxplus.backends.selection")
    chosen = select(LinearSpec(scheme=scheme, n=8, k=64, out_dtype=torch.bfloat16), "cpu", None)
    assert [b.name for b in chosen] == ["cpu-packed"]
    assert selection_messages(caplog)[0].endswith("backends cpu-packed")


def test_every_scheme_is_packed():
    from vllm_mxplus.formats.schemes import SCHEMES

    assert set(PACKED_SCHEMES) == set(SCHEMES)  # no scheme keeps an fp32 weight on CPU


def test_disabled_kernels_fall_back_with_reason(monkeypatch, fresh_log, caplog):
    monkeypatch.setenv(cpu_kernels.ENV_DISABLE, "0")
    caplog.set_level(logging.INFO, logger="vllm_mxplus.backends.selection")
    chosen = select(
        LinearSpec(scheme="mxfp4-mbs", n=8, k=64, out_dtype=torch.bfloat16), "cpu", None
    )
    assert [b.name for b in chosen] == ["reference"]
    assert "VLLM_MXPLUS_CPU_KERNELS=0" in selection_messages(caplog)[0]


def test_failed_build_falls_back_with_reason(monkeypatch, fresh_log, caplog):
    """A machine where the build fails serves through the reference and says why."""
    monkeypatch.setattr(cpu_kernels, "_state", {"error": None, "loaded": None})
    monkeypatch.setattr(cpu_kernels, "_compiler", lambda: None)
    caplog.set_level(logging.INFO, logger="vllm_mxplus.backends.selection")
    chosen = select(
        LinearSpec(scheme="mxfp4-mbs", n=8, k=64, out_dtype=torch.bfloat16), "cpu", None
    )
    assert [b.name for b in chosen] == ["reference"]
    assert "no C++ compiler found" in selection_messages(caplog)[0]


@pytest.mark.parametrize("scheme", PACKED_SCHEMES)
@pytest.mark.parametrize("m", [1, 5, 16, 17, 70], ids=lambda m: f"M{m}")
def test_same_numbers_as_reference_backend(scheme, m):
    k, n = 576, 40
    spec = LinearSpec(scheme=scheme, n=n, k=k, out_dtype=torch.float32)
    g = torch.Generator().manual_seed(m)
    q = quantize(torch.randn(n, k, generator=g) * 0.05, spec.weight_format)
    x = torch.randn(m, k, generator=g).to(torch.bfloat16)
    bias = torch.randn(n, generator=g).to(torch.bfloat16)
    chosen = select(spec, "cpu", None)
    layer = torch.nn.Module()
    d = LinearDispatch(spec, chosen)
    d.process_weights_after_loading(layer, q)
    assert not hasattr(layer, WEIGHT_ATTR)  # no fp32 copy kept
    held = dict(layer.named_buffers())
    rows = -(-n // 16) * 16  # rows padded to whole 16-row tiles
    # packed bytes only (NVFP4: plus one fp32 global scale per row; MX+: 2 bytes per 32-block)
    assert held and all(t.dtype == torch.uint8 or t.numel() <= rows for t in held.values())
    extra = 3 * k / 32 if scheme == "mxplus" else k / 16 + k / 128 + 4
    assert sum(t.numel() * t.element_size() for t in held.values()) <= rows * (k / 2 + extra)
    y = d.apply(layer, x, bias)
    ref_layer = torch.nn.Module()
    ReferenceBackend(spec).process_weights_after_loading(ref_layer, q)
    y_ref = ReferenceBackend(spec).apply(ref_layer, x, bias)
    x_hat = fake_quantize(x, spec.activation_format, per_row=spec.activation_per_row)
    scale = x_hat.abs() @ getattr(ref_layer, WEIGHT_ATTR).abs().T + bias.float().abs()
    assert y.shape == (m, n)
    assert ((y - y_ref).abs() <= 2.0**-16 * scale).all()
    assert not torch.equal(y, torch.zeros_like(y))


@pytest.mark.parametrize("scheme", ["mxfp4-mbs", "mxfp4-ocp", "nvfp4", "mxplus"])
@pytest.mark.parametrize("out_dtype", [torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("m", [1, 16, 40, 70], ids=lambda m: f"M{m}")
def test_bf16_and_fp16_outputs_are_the_fp32_outputs_rounded(scheme, out_dtype, m):
    """Each GEMM task rounds the outputs it wrote into the output dtype itself: bit for bit the
    fp32 outputs of the same call rounded to nearest even (torch's conversion), a NaN output a
    NaN; on two threads (several tasks per call at 40 and 70 rows), N past whole tiles, with
    a bias and a NaN row."""
    k, n = 576, 470
    g = torch.Generator().manual_seed(m)
    w = torch.randn(n, k, generator=g) * 0.05
    x = (torch.randn(m, k, generator=g) * 3).to(torch.bfloat16)
    x[m // 2, 7] = float("nan")
    bias = torch.randn(n, generator=g).to(torch.bfloat16)
    ys = {}
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        for dt in (torch.float32, out_dtype):
            spec = LinearSpec(scheme=scheme, n=n, k=k, out_dtype=dt)
            d = LinearDispatch(spec, select(spec, "cpu", None))
            layer = torch.nn.Module()
            d.process_weights_after_loading(layer, quantize(w, spec.weight_format))
            ys[dt] = d.apply(layer, x, bias)
    finally:
        torch.set_num_threads(threads)
    y, want = ys[out_dtype], ys[torch.float32].to(out_dtype)
    assert y.dtype == out_dtype and y.shape == (m, n)
    nan = want.isnan()
    assert nan[m // 2].all() and nan.sum() == n  # the NaN row, and only it
    assert torch.equal(y.isnan(), nan)
    assert torch.equal(y[~nan].view(torch.int16), want[~nan].view(torch.int16))


def test_a_stale_build_lock_is_removed_and_a_fresh_one_kept(tmp_path, caplog):
    """A killed build leaves torch's lock file behind; every later build would wait on it."""
    import os
    import time

    from vllm_mxplus.backends.cpu import kernels as ck

    lock = tmp_path / "lock"
    lock.write_text("")
    ck._clear_stale_lock(tmp_path)
    assert lock.exists()  # a build may be running right now
    old = time.time() - ck.STALE_LOCK_S - 60
    os.utime(lock, (old, old))
    with caplog.at_level("WARNING"):
        ck._clear_stale_lock(tmp_path)
    assert not lock.exists() and "stale CPU-kernel build lock" in caplog.text
