"""The exact-bf16 path of the CPU backend (backends/cpu/exact_bf16.py; docs/cpu_kernels.md,
"Large M on AMX hosts") against `vllm_mxplus.formats`: its operands are the spec's values
bit for bit (activation codes from `cpu_act_quant`; operand / MBS factor == fake_quantize),
exact in bf16, and its GEMM output is within the derived bound

    |y - y64| <= (L + n_c + 5) u (|x_hat| |w_hat|^T + |b|) + 2^-124 (|x_hat|_1 + |w_hat|_1 + K)

(L: 128 with MBS, K without; n_c chunks). On this machine the GEMM is torch's fp32 matmul with
oneDNN's bf16 math mode asked for; on a CPU without native bf16 it is a plain fp32 GEMM, and
only an AMX host runs the AMX-BF16 tiles (the bound covers both, denormals-are-zero included).
"""

from __future__ import annotations

import logging
import shutil

import pytest
import torch
from bound_helpers import check_bound  # tests/backends, on sys.path under pytest
from test_cpu_kernels import (  # tests/backends/cpu, on sys.path
    PAIRS,
    _special_rows,
    _weight,
    corrupted,
)

from vllm_mxplus.backends.base import LinearSpec
from vllm_mxplus.backends.cpu import exact_bf16
from vllm_mxplus.backends.cpu.linear import CpuPackedBackend
from vllm_mxplus.formats import MACRO_BLOCK, Scheme, fake_quantize, get_scheme, quantize
from vllm_mxplus.platform_amx import AmxResult

pytestmark = pytest.mark.skipif(shutil.which("c++") is None, reason="no C++ compiler (c++)")


def _scheme(wf: str, af: str, macro: int = MACRO_BLOCK) -> Scheme:
    s = Scheme("test", wf, af, "a test pair")
    return s if not s.has_mbs else s.with_macro_block(macro)


def _bf16_exact(t: torch.Tensor) -> bool:
    f = t[torch.isfinite(t)]
    return torch.equal(f.to(torch.bfloat16).to(torch.float32), f)


@pytest.mark.parametrize("pair", PAIRS, ids=lambda p: p[0])
@pytest.mark.parametrize("k", [33, 300, 577], ids=lambda k: f"K{k}")
def test_operands_are_the_spec_values(ck, pair, k):
    """w / Fw == dequantize() bit for bit (NaN as NaN) and a / Fa == fake_quantize(x) (as values: +-0
    alike), both exact in bf16; the activation codes themselves are cpu_act_quant's, bit-exact
    with formats (test_cpu_kernels.py)."""
    wf, af = pair
    scheme = _scheme(wf, af)
    q = quantize(_weight(k, n=21, seed=k) * 0.05, wf)
    w = exact_bf16.ExactBf16Weight.from_quantized(q, scheme)
    wt, fw = w.weight_rows(0, w.n)
    assert wt.shape == (21, w.chunks * w.chunk) and not wt[:, k:].any()
    got_w = wt[:, :k] if fw is None else wt[:, :k] / fw.repeat_interleave(w.chunk, 1)[:, :k]
    want_w = q.dequantize()
    same_bits = got_w.view(torch.int32) == want_w.view(torch.int32)
    assert (same_bits | (torch.isnan(got_w) & torch.isnan(want_w))).all()  # any NaN payload
    x = _special_rows(torch.randn(9, k) * 3)
    a, fa = exact_bf16.act_operand(x, scheme.activation, w.macro_block, w.chunk, w.chunks)
    got_x = a[:, :k] if fa is None else a[:, :k] / fa.repeat_interleave(w.chunk, 1)[:, :k]
    want_x = fake_quantize(x, af)
    # equal values (the int8 operand carries no sign of zero: -0 and +0 feed the GEMM alike)
    same = (got_x == want_x) | (torch.isnan(got_x) & torch.isnan(want_x))
    assert same.all(), same.logical_not().nonzero()[:4].tolist()
    assert _bf16_exact(a) and _bf16_exact(wt)


def _check(y, x, q, scheme, bias, chunk, chunks):
    x_hat = fake_quantize(x, scheme.activation_format, macro_block=scheme.macro_block)
    y64, bound = exact_bf16.bound(x_hat, q.dequantize(), bias, chunk, chunks)
    xd, wd = x_hat.double().nan_to_num(), q.dequantize().double().nan_to_num()
    scale = xd.abs() @ wd.abs().T + (0 if bias is None else bias.double().abs())
    return check_bound(y, y64, scale, bound)


@pytest.mark.parametrize("pair", PAIRS, ids=lambda p: p[0])
@pytest.mark.parametrize("m", [1, 17, 64, 130], ids=lambda m: f"M{m}")
@pytest.mark.parametrize("k", [33, 577, 1536], ids=lambda k: f"K{k}")
def test_linear_within_the_bound(ck, pair, m, k):
    """Every E8M0 scheme, partial blocks and chunks, special activation rows (NaN, Inf, zero,
    subnormal, huge) and weight rows (scale codes at both ends, NaN and Inf blocks), N not a
    multiple of the row tile."""
    wf, af = pair
    scheme = _scheme(wf, af)
    g = torch.Generator().manual_seed(m * 7 + k)
    q = quantize(_weight(k, n=45, seed=m + k) * 0.05, wf)
    x = _special_rows(torch.randn(max(m, 9), k, generator=g) * 3)[:m].to(torch.bfloat16)
    bias = torch.randn(45, generator=g)
    w = exact_bf16.ExactBf16Weight.from_quantized(q, scheme)
    for amx in (False, True):
        y = exact_bf16.linear(x, w, bias, torch.float32, amx)
        checked = _check(y, x, q, scheme, bias, w.chunk, w.chunks)
        assert checked.float().mean() > 0.3


@pytest.mark.parametrize("macro", [32, 64, 256])
def test_macro_blocks(ck, macro):
    scheme = get_scheme("mxfp4-mbs", macro)
    q = quantize(torch.randn(24, 600) * 0.05, scheme.weight_format, macro_block=macro)
    x = torch.randn(70, 600)
    w = exact_bf16.ExactBf16Weight.from_quantized(q, scheme)
    assert w.chunk == macro
    y = exact_bf16.linear(x, w, None, torch.float32)
    _check(y, x, q, scheme, None, w.chunk, w.chunks)


def test_row_tiles_and_batched_chunk_groups(ck, monkeypatch):
    """Many weight-row tiles and chunk groups of one chunk each give the same bits."""
    scheme = get_scheme("mxfp4-mbs")
    q = quantize(torch.randn(40, 700) * 0.05, scheme.weight_format)
    x = torch.randn(66, 700)
    w = exact_bf16.ExactBf16Weight.from_quantized(q, scheme)
    whole = exact_bf16.linear(x, w, None, torch.float32)
    monkeypatch.setattr(exact_bf16, "ROW_TILE", 16)
    monkeypatch.setattr(exact_bf16, "PARTIAL_BYTES", 1)
    tiled = exact_bf16.linear(x, w, None, torch.float32)
    _check(tiled, x, q, scheme, None, w.chunk, w.chunks)
    assert torch.allclose(tiled, whole, rtol=1e-5, atol=1e-30)


@pytest.mark.parametrize("wrong", ["mbs byte", "scale code", "one code"])
def test_bound_catches_a_wrong_weight(ck, wrong):
    k = 576
    g = torch.Generator().manual_seed(1)
    scheme = get_scheme("mxfp4-mbs")
    q = quantize(torch.randn(24, k, generator=g) * 0.05, "mxfp4-mbs-d")
    x = torch.randn(70, k, generator=g).to(torch.bfloat16)
    bad = corrupted(q, wrong)
    w = exact_bf16.ExactBf16Weight.from_quantized(bad, scheme)
    y = exact_bf16.linear(x, w, None, torch.float32)
    with pytest.raises(AssertionError, match="out of bound"):
        _check(y, x, q, scheme, None, w.chunk, w.chunks)


def test_dtypes_leading_dims_and_empty(ck):
    scheme = get_scheme("mxfp4-16-oas")
    q = quantize(torch.randn(24, 320) * 0.1, scheme.weight_format)
    w = exact_bf16.ExactBf16Weight.from_quantized(q, scheme)
    x = torch.randn(2, 40, 320, dtype=torch.bfloat16)
    for dt in (torch.float32, torch.bfloat16, torch.float16):
        y = exact_bf16.linear(x, w, None, dt)
        assert y.shape == (2, 40, 24) and y.dtype == dt
    assert exact_bf16.linear(torch.empty(0, 320), w, None, torch.bfloat16).shape == (0, 24)


def test_other_formats_are_refused(ck):
    for s in ("nvfp4", "mxplus"):
        q = quantize(torch.randn(8, 64), get_scheme(s).weight_format)
        with pytest.raises(ValueError, match="exact-bf16 path takes E8M0 weights"):
            exact_bf16.ExactBf16Weight.from_quantized(q, get_scheme(s))


def test_the_bf16_math_mode_is_restored():
    mode = torch.backends.mkldnn.matmul
    before = mode.fp32_precision
    with pytest.raises(RuntimeError), exact_bf16.bf16_math():
        assert mode.fp32_precision == "bf16"
        raise RuntimeError("a failing GEMM")
    assert mode.fp32_precision == before


AMX_CPUINFO = "processor\t: 0\nflags\t\t: fpu avx2 avx512f amx_tile amx_bf16 amx_int8\n"
AVX2_CPUINFO = "processor\t: 0\nflags\t\t: fpu avx2 fma\n"


def test_host_choice_by_cpu_feature():
    """amx_bf16 in cpuinfo and the tile permission held: the path; otherwise the reason."""
    granted = AmxResult("granted", "XTILEDATA permission granted")
    assert exact_bf16.host_choice(AMX_CPUINFO, granted) == (True, "")
    ok, why = exact_bf16.host_choice(AVX2_CPUINFO, granted)
    assert not ok and "no amx_bf16" in why
    ok, why = exact_bf16.host_choice(AMX_CPUINFO, AmxResult("failed", "EPERM"))
    assert not ok and "no AMX tile permission (failed: EPERM)" in why


def _backend(scheme_name: str, n: int, k: int):
    spec = LinearSpec(get_scheme(scheme_name), n=n, k=k, out_dtype=torch.float32)
    return CpuPackedBackend(spec), torch.nn.Module()


def test_backend_takes_the_path_for_large_m_on_an_amx_host(ck, monkeypatch):
    """With the host taken for an AMX one, cpu-packed runs the exact path from MIN_M rows and
    its integer kernels below; elsewhere (this CPU as it is, or NVFP4 / MX+) never."""
    monkeypatch.setattr(exact_bf16, "host_choice", lambda: (True, ""))
    calls = []
    real = exact_bf16.linear
    monkeypatch.setattr(
        exact_bf16, "linear", lambda *a, **kw: calls.append(a[0].shape) or real(*a, **kw)
    )
    scheme = get_scheme("mxfp4-mbs")
    q = quantize(torch.randn(24, 320) * 0.05, scheme.weight_format)
    backend, layer = _backend("mxfp4-mbs", 24, 320)
    backend.process_weights_after_loading(layer, q)
    assert backend.exact is not None
    for m in (1, exact_bf16.MIN_M - 1, exact_bf16.MIN_M, 200):
        x = torch.randn(m, 320)
        y = backend.apply(layer, x, None)
        _check(y, x, q, scheme, None, 128, 3)
    assert [s[0] for s in calls if s[0] != exact_bf16.MIN_M + 3] == [exact_bf16.MIN_M, 200]
    for other in ("nvfp4", "mxplus"):
        b, lay = _backend(other, 24, 320)
        b.process_weights_after_loading(lay, quantize(torch.randn(24, 320), other))
        assert b.exact is None


def test_backend_on_this_host_follows_cpuinfo(ck):
    ok, _ = exact_bf16.host_choice()
    backend, layer = _backend("mxfp4-16-oas", 24, 320)
    backend.process_weights_after_loading(layer, quantize(torch.randn(24, 320), "mxfp4-16-oas"))
    assert (backend.exact is not None) == ok


def test_a_failing_self_test_keeps_the_integer_kernels(ck, monkeypatch, caplog):
    """A path that computes wrong numbers (one weight scale code off by one in its decoder) is
    rejected at first use with an ERROR naming the element, and the integer kernels serve."""
    monkeypatch.setattr(exact_bf16, "host_choice", lambda: (True, ""))
    monkeypatch.setattr(exact_bf16, "_VERDICT", {})
    real = exact_bf16.ExactBf16Weight.weight_rows

    def off_by_one(self, n0, n1):
        wt, fw = real(self, n0, n1)
        wt[0] *= 2.0  # every scale of weight row 0 one code up
        return wt, fw

    monkeypatch.setattr(exact_bf16.ExactBf16Weight, "weight_rows", off_by_one)
    backend, layer = _backend("mxfp4-mbs-s", 24, 320)
    with caplog.at_level(logging.ERROR, logger=exact_bf16.__name__):
        backend.process_weights_after_loading(layer, quantize(torch.randn(24, 320), "mxfp4-mbs-s"))
    assert backend.exact is None
    assert "exact-bf16 CPU path is REJECTED" in caplog.text and "outside the bound" in caplog.text
