"""The C++ CPU kernels against `vllm_mxplus.formats`: activation and weight values bit for bit,
the linear within an fp32-accumulation bound of a float64 reference.

Stated bound (fp32 output): |y - y64| <= 2^-16 * (|x_hat| |W_hat|^T + |b|), where y64 is the
float64 product of the formats' fake-quantized activations and dequantized weights. Any K
here is < 2^8, ... 2^12, so n * 2^-24 with n <= K is far inside 2^-16; a wrong code, scale
or MBS factor moves an output by at least 2^-5 of its term and cannot pass.
"""

from __future__ import annotations

import shutil

import pytest
import torch

from vllm_mxplus.formats import fake_quantize, quantize

pytestmark = pytest.mark.skipif(shutil.which("c++") is None, reason="no C++ compiler (c++)")

ACT_FORMATS = ["mxfp4-ocp", "mxfp4-16", "mxfp4-16-oas", "mxfp4-mbs-s"]
PAIRS = [("mxfp4-ocp", "mxfp4-ocp"), ("mxfp4-16-oas", "mxfp4-16-oas"),
         ("mxfp4-mbs-s", "mxfp4-mbs-s"), ("mxfp4-mbs-d", "mxfp4-mbs-s")]


@pytest.fixture(scope="module")
def ck():
    from vllm_mxplus.ops import cpu_kernels

    ok, why = cpu_kernels.load()
    assert ok, why  # a machine with a compiler must build them: never skip a broken build
    return cpu_kernels


def _bits_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.shape == b.shape and torch.equal(a.view(torch.int32), b.view(torch.int32))


def _special_rows(x: torch.Tensor) -> torch.Tensor:
    k = x.shape[-1]
    x[0, : min(k, 5)] = 0.0
    x[1, k // 2] = float("nan")
    x[2, 0] = -float("inf")
    x[2, -1] = -0.0
    x[3] = 0.0
    x[4] *= 1e-39  # subnormal block absmax
    x[5, : min(k, 20)] = 3.0e38  # x * F overflows to Inf in MBS-S
    x[6, :: max(k // 3, 1)] = -x[6, :: max(k // 3, 1)]
    return x


@pytest.mark.parametrize("fmt", ACT_FORMATS)
@pytest.mark.parametrize("k", [1, 15, 16, 17, 33, 100, 576, 1536], ids=lambda k: f"K{k}")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32], ids=str)
def test_act_fake_quant_bit_exact(ck, fmt, k, dtype):
    g = torch.Generator().manual_seed(k * 31 + len(fmt))
    x = torch.randn(9, k, generator=g) * torch.logspace(-6, 6, 9)[:, None]
    if dtype == torch.float32:
        x = _special_rows(x)
    x = x.to(dtype)
    if dtype != torch.float32:
        x[1, k // 2] = float("nan")
        x[3] = 0.0
    assert _bits_equal(ck.act_fake_quant(x, fmt), fake_quantize(x, fmt))


def test_act_fake_quant_all_bf16_patterns(ck):
    """Every bf16 bit pattern once, 16 to a block: every scale code and every rounding case."""
    x = torch.arange(65536, dtype=torch.int32).to(torch.int16).view(torch.bfloat16)
    x = x.reshape(-1, 1024)
    for fmt in ACT_FORMATS:
        assert _bits_equal(ck.act_fake_quant(x, fmt), fake_quantize(x, fmt)), fmt


@pytest.mark.parametrize("macro", [32, 64, 256])
def test_act_macro_block_sizes(ck, macro):
    x = torch.randn(4, 700)
    assert _bits_equal(ck.act_fake_quant(x, "mxfp4-mbs-s", macro),
                       fake_quantize(x, "mxfp4-mbs-s", macro_block=macro))


def test_act_leading_dims(ck):
    x = torch.randn(2, 3, 200)
    assert _bits_equal(ck.act_fake_quant(x, "mxfp4-16-oas"), fake_quantize(x, "mxfp4-16-oas"))


def _weight(k: int, n: int = 40, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(n, k, generator=g) * torch.logspace(-3, 3, k)[None, :].clamp(1e-2, 1e2)
    w[0] *= 2.0**-130  # scale codes below the fast range (subnormal products)
    w[1] *= 2.0**-118
    w[2] *= 2.0**100  # near the top of the E8M0 range
    w[3, : min(k, 7)] = 0.0
    w[4] = 0.0
    w[5, k // 2] = float("nan")
    w[6, -1] = float("inf")
    return w


@pytest.mark.parametrize("fmt", ["mxfp4-ocp", "mxfp4-16", "mxfp4-16-oas", "mxfp4-mbs-s",
                                 "mxfp4-mbs-d"])
@pytest.mark.parametrize("k", [1, 16, 33, 100, 576, 1536], ids=lambda k: f"K{k}")
def test_dequant_weight_bit_exact(ck, fmt, k):
    q = quantize(_weight(k, seed=k), fmt)
    got = ck.dequant_weight(q.codes, q.scales, q.mbs, k, fmt)
    assert _bits_equal(got, q.dequantize())


def test_dequant_weight_huge_scales(ck):
    """Scale codes 251..254 take the exact path (fast (v/F)*X could differ from (v*X)/F)."""
    w = torch.randn(8, 256) * 2.0**126
    w[:, ::7] *= 1.9
    q = quantize(w, "mxfp4-mbs-d")
    assert int(q.scales.max()) > 250
    assert _bits_equal(ck.dequant_weight(q.codes, q.scales, q.mbs, 256, "mxfp4-mbs-d"),
                       q.dequantize())


def _reference(x, q, act_fmt, bias):
    xq = fake_quantize(x, act_fmt).double()
    w = q.dequantize().double()
    y = xq @ w.T
    scale = xq.abs() @ w.abs().T
    if bias is not None:
        y = y + bias.double()
        scale = scale + bias.double().abs()
    return y, scale


def _assert_within_bound(y, y_ref, scale, out_dtype):
    rel = {torch.float32: 0.0, torch.bfloat16: 2.0**-8, torch.float16: 2.0**-11}[out_dtype]
    err = (y.double() - y_ref).abs()
    bound = 2.0**-16 * scale + rel * y_ref.abs() + 1e-30
    nan_ref = torch.isnan(y_ref)
    assert torch.equal(torch.isnan(y.double()), nan_ref), "NaN pattern differs"
    bad = (err > bound) & ~nan_ref
    assert not bad.any(), (f"{int(bad.sum())} outputs out of bound: err {err[bad].max():.3g}, "
                           f"bound {bound[bad].min():.3g}")


@pytest.mark.parametrize("pair", PAIRS, ids=lambda p: p[0])
@pytest.mark.parametrize("m", [1, 3, 8, 9, 16, 17, 40], ids=lambda m: f"M{m}")
@pytest.mark.parametrize("k", [33, 576, 1536], ids=lambda k: f"K{k}")
def test_linear_matches_float64(ck, pair, m, k):
    wf, af = pair
    g = torch.Generator().manual_seed(m * 1000 + k)
    q = quantize(torch.randn(48, k, generator=g) * 0.05, wf)
    x = (torch.randn(m, k, generator=g) * 3).to(torch.bfloat16)
    bias = torch.randn(48, generator=g)
    y = ck.mx_linear(x, wf, af, q.codes, q.scales, q.mbs, k, bias, torch.float32)
    _assert_within_bound(y, *_reference(x, q, af, bias), torch.float32)


@pytest.mark.parametrize("out_dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("m", [4, 64], ids=lambda m: f"M{m}")
def test_linear_dtypes_no_bias_leading_dims(ck, out_dtype, m):
    q = quantize(torch.randn(24, 576) * 0.1, "mxfp4-mbs-d")
    x = torch.randn(2, m // 2, 576, dtype=torch.bfloat16)
    y = ck.mx_linear(x, "mxfp4-mbs-d", "mxfp4-mbs-s", q.codes, q.scales, q.mbs, 576, None,
                     out_dtype)
    assert y.shape == (2, m // 2, 24) and y.dtype == out_dtype
    _assert_within_bound(y.reshape(m, 24), *_reference(x.reshape(m, 576), q, "mxfp4-mbs-s", None),
                         out_dtype)


@pytest.mark.parametrize("gemv_max_m", [16, 0], ids=["gemv", "gemm"])
def test_linear_nan_row_and_special_weights(ck, gemv_max_m):
    """A NaN / Inf token poisons only its own row; odd weight scales stay exact."""
    q = quantize(_weight(300, n=40, seed=3), "mxfp4-mbs-d")
    x = torch.randn(6, 300)
    x[2, 5] = float("nan")
    x[4, 0] = float("inf")
    x[5] = 0.0
    y = ck.mx_linear(x, "mxfp4-mbs-d", "mxfp4-mbs-s", q.codes, q.scales, q.mbs, 300, None,
                     torch.float32, gemv_max_m=gemv_max_m)
    assert torch.isnan(y[2]).all() and torch.isnan(y[4]).all()
    _assert_within_bound(y, *_reference(x, q, "mxfp4-mbs-s", None), torch.float32)


def test_empty_rows(ck):
    q = quantize(torch.randn(8, 64), "mxfp4-16-oas")
    y = ck.mx_linear(torch.empty(0, 64), "mxfp4-16-oas", "mxfp4-16-oas", q.codes, q.scales, None,
                     64, None, torch.bfloat16)
    assert y.shape == (0, 8) and y.dtype == torch.bfloat16


def test_bad_inputs_name_the_tensor(ck):
    q = quantize(torch.randn(8, 64), "mxfp4-mbs-d")
    with pytest.raises(RuntimeError, match="last dim 32 but the weight has K=64"):
        ck.mx_linear(torch.randn(2, 32), "mxfp4-mbs-d", "mxfp4-mbs-s", q.codes, q.scales, q.mbs,
                     64, None, torch.float32)
    with pytest.raises(RuntimeError, match="weight scales"):
        ck.mx_linear(torch.randn(2, 64), "mxfp4-mbs-d", "mxfp4-mbs-s", q.codes, q.scales[:, :2],
                     q.mbs, 64, None, torch.float32)
    with pytest.raises(RuntimeError, match="MBS bytes"):
        ck.mx_linear(torch.randn(2, 64), "mxfp4-mbs-d", "mxfp4-mbs-s", q.codes, q.scales,
                     q.mbs[:4], 64, None, torch.float32)
    with pytest.raises(RuntimeError, match="bias has 3 elements"):
        ck.mx_linear(torch.randn(2, 64), "mxfp4-mbs-d", "mxfp4-mbs-s", q.codes, q.scales, q.mbs,
                     64, torch.randn(3), torch.float32)
    with pytest.raises(ValueError, match="do not fake-quantize activations as 'nvfp4'"):
        ck.act_fake_quant(torch.randn(2, 64), "nvfp4")
    with pytest.raises(ValueError, match="do not read weights stored as 'mxplus'"):
        ck.dequant_weight(q.codes, q.scales, q.mbs, 64, "mxplus")


def test_ops_trace_and_check(ck):
    """Fake implementations: opcheck, and a fullgraph compile that calls the op."""
    q = quantize(torch.randn(16, 128), "mxfp4-mbs-d")
    x = torch.randn(3, 128, dtype=torch.bfloat16)
    args = (x, 16, 2, True, 128, q.codes, q.scales, q.mbs, 128, 16, None, torch.bfloat16, 16)
    torch.library.opcheck(torch.ops.mxplus_cpu.mx_linear.default, args)
    torch.library.opcheck(torch.ops.mxplus_cpu.act_fake_quant.default, (x, 16, 2, True, 128))

    @torch.compile(fullgraph=True, backend="aot_eager")
    def f(x):
        return torch.ops.mxplus_cpu.mx_linear(*((x,) + args[1:])) * 2

    assert torch.equal(f(x), torch.ops.mxplus_cpu.mx_linear(*args) * 2)


def test_build_name_tracks_source_flags_and_cpu(ck, monkeypatch):
    name = ck.build_name()
    assert name.startswith("mxplus_cpu_") and ck.build_dir().name == name
    monkeypatch.setattr(ck, "_cpu_signature", lambda: "flags : sse2")
    assert ck.build_name() != name  # a cache shared with another CPU never reuses this build


def test_disabled_by_env(monkeypatch):
    from vllm_mxplus.ops import cpu_kernels

    monkeypatch.setenv(cpu_kernels.ENV_DISABLE, "0")
    ok, why = cpu_kernels.load()
    assert not ok and "VLLM_MXPLUS_CPU_KERNELS=0" in why


_PORTABLE_SCRIPT = r"""
import torch
from vllm_mxplus.formats import fake_quantize, quantize
from vllm_mxplus.ops import cpu_kernels as ck
ok, why = ck.load()
assert ok, why
for wf, af in [("mxfp4-ocp", "mxfp4-ocp"), ("mxfp4-mbs-d", "mxfp4-mbs-s")]:
    for k in (33, 576):
        w = torch.randn(20, k) * 0.05
        w[0] *= 2.0**-130
        w[1, 3] = float("nan")
        q = quantize(w, wf)
        assert torch.equal(ck.dequant_weight(q.codes, q.scales, q.mbs, k, wf).view(torch.int32),
                           q.dequantize().view(torch.int32))
        x = torch.randn(5, k)
        x[1, 0] = 1e-39
        xq = fake_quantize(x, af)
        assert torch.equal(ck.act_fake_quant(x, af).view(torch.int32), xq.view(torch.int32))
        ref = xq.double() @ q.dequantize().double().T
        scale = xq.abs().double() @ q.dequantize().abs().double().T
        for m in (1, 3, 5):
            y = ck.mx_linear(x[:m], wf, af, q.codes, q.scales, q.mbs, k, None, torch.float32)
            err = (y.double() - ref[:m]).abs()
            ok_ = (err <= 2.0**-16 * scale[:m]) | (torch.isnan(y) & torch.isnan(ref[:m]))
            assert bool(ok_.all()), (wf, k, m)
print("PORTABLE-OK", ck.cflags()[0])
"""


def test_portable_path_without_avx512(tmp_path):
    """The non-AVX-512 code path (built for x86-64-v3) gives the same values, in a subprocess
    (one process can load only one build of the `mxplus_cpu` op library)."""
    import os
    import platform
    import subprocess
    import sys

    if platform.machine() not in ("x86_64", "AMD64"):
        pytest.skip("x86-64-v3 target only exists on x86-64")
    env = dict(os.environ, VLLM_MXPLUS_CPU_MARCH="x86-64-v3",
               VLLM_MXPLUS_CPU_BUILD_DIR=str(tmp_path / "build"), OMP_NUM_THREADS="1")
    r = subprocess.run([sys.executable, "-c", _PORTABLE_SCRIPT], env=env, capture_output=True,
                       text=True, timeout=600)
    assert r.returncode == 0 and "PORTABLE-OK -march=x86-64-v3" in r.stdout, r.stdout + r.stderr
