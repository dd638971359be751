"""The C++ CPU kernels against `vllm_mxplus.formats`: activation codes, scales and MBS bytes
and the dequantized activation / weight values bit for bit; the integer-dot-product linear
within its derived error bound of the float64 product of the spec's values.

The bound (derived in csrc/mx_gemm_cpu.cpp; docs/numerics.md, "Kernel numerics and error
bounds"): with x_hat, w_hat the spec's fp32 values, y64 their float64 product plus the bias,
u = 2^-24, n_b blocks and n_c MBS chunks in K (n_c = 1 without MBS),
    |y - y64| <= (n_b + n_c + 7) u (|x_hat| |w_hat|^T + |b|)
                 + 2^-146 (||x_hat_m||_1 + ||w_hat_n||_1 + n_b)
(plus one rounding to a bf16 / fp16 output). Block sums are exact integers; the 2u covers the
spec's two fp32 divisions by F that the integer path does not make, the rest the fp32
additions, the chunk's scale fl(fl(1/Fa) fl(1/Fw)) (3u), second-order terms and the roundings below fp32's
normal range. A wrong code, scale or MBS byte moves the terms it touches by at least 2^-9 of
themselves, far above the bound; outputs beyond fp32's range must be +-Inf or NaN. The builds
for other instruction sets: tests/backends/cpu/test_cpu_kernels_isa.py.
"""

from __future__ import annotations

import dataclasses
import shutil
import sys

import pytest
import torch
from bound_helpers import check_bound  # tests/backends, on sys.path under pytest
from edge_rows import edge_rows

from vllm_mxplus.backends.base import E8M0_PAIRS
from vllm_mxplus.formats import MACRO_BLOCK, fake_quantize, get_format, quantize
from vllm_mxplus.formats.constants import ceil_div
from vllm_mxplus.formats.e2m1 import e2m1_decode, unpack_fp4

pytestmark = pytest.mark.skipif(shutil.which("c++") is None, reason="no C++ compiler (c++)")

ACT_FORMATS = ["mxfp4-ocp", "mxfp4-16", "mxfp4-16-oas", "mxfp4-mbs-s"]
PAIRS = sorted(E8M0_PAIRS)  # every E8M0 scheme the CPU kernels serve


def _bits_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.shape == b.shape and torch.equal(a.view(torch.int32), b.view(torch.int32))


def _special_rows(x: torch.Tensor) -> torch.Tensor:
    k = x.shape[-1]
    edge_rows(x)
    x[4] *= 1e-39  # subnormal block absmax
    x[5, : min(k, 20)] = 3.0e38  # x * F overflows to Inf in MBS-S
    x[7] = torch.linspace(-3, 3, k) * 2.0**124  # scale codes >= 250, x * F still finite
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
    assert _bits_equal(ck.act_fake_quant(x, fmt, MACRO_BLOCK), fake_quantize(x, fmt))


def test_act_fake_quant_all_bf16_patterns(ck):
    """Every bf16 bit pattern once, 16 to a block: every scale code and every rounding case."""
    x = torch.arange(65536, dtype=torch.int32).to(torch.int16).view(torch.bfloat16)
    x = x.reshape(-1, 1024)
    for fmt in ACT_FORMATS:
        assert _bits_equal(ck.act_fake_quant(x, fmt, MACRO_BLOCK), fake_quantize(x, fmt)), fmt


@pytest.mark.parametrize("macro", [32, 64, 256])
def test_act_macro_block_sizes(ck, macro):
    x = torch.randn(4, 700)
    assert _bits_equal(
        ck.act_fake_quant(x, "mxfp4-mbs-s", macro),
        fake_quantize(x, "mxfp4-mbs-s", macro_block=macro),
    )


def test_act_leading_dims(ck):
    x = torch.randn(2, 3, 200)
    assert _bits_equal(
        ck.act_fake_quant(x, "mxfp4-16-oas", MACRO_BLOCK), fake_quantize(x, "mxfp4-16-oas")
    )


def _weight(k: int, n: int = 40, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(n, k, generator=g) * torch.logspace(-3, 3, k)[None, :].clamp(1e-2, 1e2)
    w[0] *= 2.0**-140  # scale codes at the bottom of the E8M0 range (subnormal values)
    w[1] *= 2.0**-118
    w[2] *= 2.0**100  # near the top of the E8M0 range
    w[3, : min(k, 7)] = 0.0
    w[4] = 0.0
    w[5, k // 2] = float("nan")
    w[6, -1] = float("inf")
    w[7] *= 2.0**125  # scale codes 250..254
    return w


@pytest.mark.parametrize(
    "fmt", ["mxfp4-ocp", "mxfp4-16", "mxfp4-16-oas", "mxfp4-mbs-s", "mxfp4-mbs-d"]
)
@pytest.mark.parametrize("k", [1, 16, 33, 100, 576, 1536], ids=lambda k: f"K{k}")
def test_dequant_weight_bit_exact(ck, fmt, k):
    q = quantize(_weight(k, seed=k), fmt)
    got = ck.dequant_weight(q)
    assert _bits_equal(got, q.dequantize())


def _doubled_values(codes: torch.Tensor, k: int) -> torch.Tensor:
    """2 * E2M1 value of packed codes, as the integer GEMM's int8 operand."""
    return (2 * e2m1_decode(unpack_fp4(codes, k))).to(torch.int8)


@pytest.mark.parametrize("fmt", ACT_FORMATS)
@pytest.mark.parametrize("k", [1, 15, 17, 33, 100, 577, 1536], ids=lambda k: f"K{k}")
def test_act_quant_codes_bit_exact(ck, fmt, k):
    """The GEMM's activation operand: codes, E8M0 codes and MBS bytes equal formats.quantize."""
    g = torch.Generator().manual_seed(k)
    x = _special_rows(torch.randn(9, k, generator=g) * torch.logspace(-6, 6, 9)[:, None])
    codes, scales, mbs = ck.act_quant(x, fmt, MACRO_BLOCK)
    q = quantize(x, fmt)
    assert torch.equal(codes, _doubled_values(q.codes, k))
    assert torch.equal(scales, q.scales)
    assert torch.equal(mbs, q.mbs if q.mbs is not None else torch.empty(9, 0, dtype=torch.uint8))
    assert int(scales.min()) == 0 and int(scales[scales < 255].max()) >= 248  # both range ends


def test_act_quant_all_bf16_patterns(ck):
    """Every bf16 bit pattern once: every scale code and every rounding case, codes bit-exact."""
    x = torch.arange(65536, dtype=torch.int32).to(torch.int16).view(torch.bfloat16)
    x = x.reshape(-1, 1024)
    for fmt in ACT_FORMATS:
        codes, scales, mbs = ck.act_quant(x, fmt, MACRO_BLOCK)
        q = quantize(x, fmt)
        assert torch.equal(codes, _doubled_values(q.codes, 1024)), fmt
        assert torch.equal(scales, q.scales), fmt


def test_pack_weight_holds_the_same_codes(ck):
    """The tile layout documented in csrc/mx_gemm_cpu.cpp (pack_weight), decoded in Python."""
    n, k = 37, 50
    q = quantize(torch.randn(n, k), "mxfp4-mbs-d")
    wc, ws, wm = ck.pack_weight(q.codes, q.scales, q.mbs, k, "mxfp4-mbs-d", MACRO_BLOCK)
    nt, groups = 3, 4  # ceil(37 / 16), ceil(50 / 16)
    # element 16g + 8q + j (low nibble) and 16g + 8q + 4 + j (high nibble)
    codes = _tile_codes(wc, nt, groups)
    want = torch.zeros(nt * 16, groups * 16, dtype=torch.long)
    want[:n, :k] = unpack_fp4(q.codes, k).long()
    assert torch.equal(codes, want)
    assert torch.equal(ws.view(nt, -1, 16).transpose(1, 2).reshape(nt * 16, -1)[:n], q.scales)
    assert torch.equal(wm.view(nt, -1, 16).transpose(1, 2).reshape(nt * 16, -1)[:n], q.mbs)


def _tile_codes(wc: torch.Tensor, nt: int, groups: int) -> torch.Tensor:
    """The codes [nt * 16, groups * 16] of packed tiles (the layout of pack_weight)."""
    b = wc.view(nt, groups, 2, 16, 4).long()  # [tile, group, half q, row i, j]
    lo, hi = b & 15, b >> 4
    return torch.stack([lo, hi], dim=-2).permute(0, 3, 1, 2, 4, 5).reshape(nt * 16, groups * 16)


def test_pack_weight_large_tiles_same_bytes(ck):
    """Tiles of 2 MiB and more come from the huge-page allocation (mx_tiles.h zeros_tiles,
    2 MiB aligned on Linux): the same layout and bytes as the small ones, padding zero."""
    n, k = 8190, 4096  # codes 16 MiB, scales 2 MiB, MBS bytes 256 KiB; two padding rows
    g = torch.Generator().manual_seed(7)
    codes = torch.randint(0, 256, (n, k // 2), dtype=torch.uint8, generator=g)
    scales = torch.randint(100, 150, (n, k // 16), dtype=torch.uint8, generator=g)
    mbs = torch.randint(0, 256, (n, k // 128), dtype=torch.uint8, generator=g)
    wc, ws, wm = ck.pack_weight(codes, scales, mbs, k, "mxfp4-mbs-s", MACRO_BLOCK)
    nt, groups = 512, 256
    if sys.platform == "linux":
        assert wc.data_ptr() % (2 << 20) == 0 and ws.data_ptr() % (2 << 20) == 0
    want = torch.zeros(nt * 16, groups * 16, dtype=torch.long)
    want[:n] = unpack_fp4(codes, k).long()
    assert torch.equal(_tile_codes(wc, nt, groups), want)
    tiles_scales = ws.view(nt, -1, 16).transpose(1, 2).reshape(nt * 16, -1)
    assert torch.equal(tiles_scales[:n], scales) and not tiles_scales[n:].any()
    tiles_mbs = wm.view(nt, -1, 16).transpose(1, 2).reshape(nt * 16, -1)
    assert torch.equal(tiles_mbs[:n], mbs) and not tiles_mbs[n:].any()


@pytest.mark.parametrize("m", [1, 4, 5], ids=lambda m: f"M{m}")
def test_linear_large_weight_matches_float64(ck, m):
    """A weight whose tiles take the huge-page allocation (codes 2 MiB): the GEMM within the
    bound of the float64 product of formats' values."""
    n, k, wf = 2048, 2048, "mxfp4-mbs-s"
    g = torch.Generator().manual_seed(m)
    q = quantize(torch.randn(n, k, generator=g) * 0.05, wf)
    x = (torch.randn(m, k, generator=g) * 3).to(torch.bfloat16)
    y = ck.mx_linear(x, wf, wf, q.codes, q.scales, q.mbs, k, None, torch.float32, MACRO_BLOCK)
    _assert_within_bound(y, _reference(x, q, wf, None), torch.float32, k, wf, wf)


def _reference(x, q, act_fmt, bias):
    xq = fake_quantize(x, act_fmt).double()
    w = q.dequantize().double()
    y = xq @ w.T
    scale = xq.abs() @ w.abs().T
    if bias is not None:
        y = y + bias.double()
        scale = scale + bias.double().abs()
    l1 = xq.abs().nan_to_num().sum(-1, keepdim=True) + w.abs().nan_to_num().sum(-1)[None, :]
    return y, scale, l1


def _assert_within_bound(y, ref, out_dtype, k, wf, af):
    """The bound of the module docstring; NaN exactly where the float64 product is NaN."""
    y_ref, scale, l1 = ref
    spec_w, spec_a = get_format(wf), get_format(af)
    n_b = ceil_div(k, spec_a.block_size)
    n_c = ceil_div(k, MACRO_BLOCK) if (spec_w.mbs or spec_a.mbs) else 1
    rel = {torch.float32: 0.0, torch.bfloat16: 2.0**-8, torch.float16: 2.0**-11}[out_dtype]
    bound = (n_b + n_c + 7) * 2.0**-24 * scale + 2.0**-146 * (l1 + n_b) + rel * y_ref.abs()
    check = check_bound(y, y_ref, scale, bound)
    assert check.float().mean() > 0.3  # the comparison covers much of the output


@pytest.mark.parametrize("pair", PAIRS, ids=lambda p: p[0])
@pytest.mark.parametrize("m", [1, 2, 3, 8, 16, 17, 64, 333], ids=lambda m: f"M{m}")
@pytest.mark.parametrize("k", [33, 577, 1536], ids=lambda k: f"K{k}")
def test_linear_matches_float64(ck, pair, m, k):
    """Every E8M0 scheme, odd K, N not a multiple of 16, special weight rows (scale codes at
    both ends of the E8M0 range, NaN and Inf blocks) and activation rows (NaN, Inf, zero,
    subnormal, huge)."""
    wf, af = pair
    g = torch.Generator().manual_seed(m * 1000 + k)
    q = quantize(_weight(k, n=45, seed=m + k) * 0.05, wf)
    x = _special_rows(torch.randn(max(m, 9), k, generator=g) * 3)
    order = [8, 4, 7, 1, 0, 2, 3, 5, 6] + list(range(9, m))  # a plain row first
    x = x[order[:m]].to(torch.bfloat16)
    bias = torch.randn(45, generator=g)
    y = ck.mx_linear(x, wf, af, q.codes, q.scales, q.mbs, k, bias, torch.float32, MACRO_BLOCK)
    _assert_within_bound(y, _reference(x, q, af, bias), torch.float32, k, wf, af)


def corrupted(q, wrong: str):
    """A copy of an MBS weight with one thing wrong: an MBS byte, a block scale code or one
    element code (each a fault a kernel must not hide)."""
    bad = dataclasses.replace(q, codes=q.codes.clone(), scales=q.scales.clone(), mbs=q.mbs.clone())
    if wrong == "mbs byte":
        bad.mbs[3, 1] ^= 1
    elif wrong == "scale code":
        bad.scales[3, 9] += 1
    else:
        bad.codes[3, 70] ^= 0x01
    return bad


@pytest.mark.parametrize("wrong", ["mbs byte", "scale code", "one code"])
def test_bound_catches_a_wrong_weight(ck, wrong):
    """The bound is tight enough to fail: one weight MBS byte off by one, one E8M0 code off by
    one or one E2M1 code changed in a layer's packed weight is caught."""
    k = 576
    g = torch.Generator().manual_seed(1)
    q = quantize(torch.randn(24, k, generator=g) * 0.05, "mxfp4-mbs-d")
    x = torch.randn(8, k, generator=g).to(torch.bfloat16)
    ref = _reference(x, q, "mxfp4-mbs-s", None)
    bad = corrupted(q, wrong)
    y = ck.mx_linear(
        x,
        "mxfp4-mbs-d",
        "mxfp4-mbs-s",
        bad.codes,
        bad.scales,
        bad.mbs,
        k,
        None,
        torch.float32,
        MACRO_BLOCK,
    )
    with pytest.raises(AssertionError, match="out of bound"):
        _assert_within_bound(y, ref, torch.float32, k, "mxfp4-mbs-d", "mxfp4-mbs-s")


@pytest.mark.parametrize("out_dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("m", [4, 64], ids=lambda m: f"M{m}")
def test_linear_dtypes_no_bias_leading_dims(ck, out_dtype, m):
    q = quantize(torch.randn(24, 576) * 0.1, "mxfp4-mbs-d")
    x = torch.randn(2, m // 2, 576, dtype=torch.bfloat16)
    y = ck.mx_linear(
        x, "mxfp4-mbs-d", "mxfp4-mbs-s", q.codes, q.scales, q.mbs, 576, None, out_dtype, MACRO_BLOCK
    )
    assert y.shape == (2, m // 2, 24) and y.dtype == out_dtype
    _assert_within_bound(
        y.reshape(m, 24),
        _reference(x.reshape(m, 576), q, "mxfp4-mbs-s", None),
        out_dtype,
        576,
        "mxfp4-mbs-d",
        "mxfp4-mbs-s",
    )


@pytest.mark.parametrize("scheme", ["mxfp4-mbs", "nvfp4", "mxplus"])
@pytest.mark.parametrize("m", [3, 40], ids=lambda m: f"M{m}")
def test_linear_reads_x_in_its_own_dtype_and_layout(ck, scheme, m):
    """The integer linears quantize x's rows from its own dtype (bf16 and fp16 rows widened to
    fp32 one at a time, exactly; other dtypes converted first) and any layout: the same values
    give the same output bits whatever the dtype or strides, NaN rows included."""
    k, n = 160, 24
    x32 = (torch.randn(m, k, generator=torch.Generator().manual_seed(5)) * 4).to(torch.float16)
    x32 = x32.to(torch.float32)  # values exact in fp16, bf16 only where they round the same
    x32[1, 7] = float("nan")
    if scheme == "nvfp4":
        q = quantize(torch.randn(n, k) * 0.1, "nvfp4")
        wc, ws, wg = ck.pack_nvfp4(q)

        def run(x):
            return ck.nvfp4_linear_packed(x, n, k, wc, ws, wg, None, torch.float32)
    elif scheme == "mxplus":
        q = quantize(torch.randn(n, k) * 0.1, "mxplus")
        wc, ws, wbm = ck.pack_mxplus(q)

        def run(x):
            return ck.mxplus_linear_packed(x, n, k, wc, ws, wbm, None, torch.float32)
    else:
        q = quantize(torch.randn(n, k) * 0.1, "mxfp4-mbs-d")

        def run(x):
            return ck.mx_linear(
                x,
                "mxfp4-mbs-d",
                "mxfp4-mbs-s",
                q.codes,
                q.scales,
                q.mbs,
                k,
                None,
                torch.float32,
                MACRO_BLOCK,
            )

    want = run(x32)
    assert torch.isnan(want[1]).all() and torch.isfinite(want[0]).all()
    xb = x32.to(torch.bfloat16)
    for x, ref in [
        (x32.to(torch.float16), want),
        (x32.to(torch.float64), want),
        (x32.t().contiguous().t(), want),  # column-major
        (torch.stack([x32, x32], 1)[:, 1], want),  # a row stride of 2k
        (x32.reshape(1, m, k), want.reshape(1, m, n)),
        (xb, run(xb.to(torch.float32))),
    ]:
        assert _bits_equal(run(x), ref), (x.dtype, x.stride())


@pytest.mark.parametrize("m", [3, 40], ids=lambda m: f"M{m}")
def test_linear_nan_row_and_special_weights(ck, m):
    """A NaN / Inf token poisons only its own row; a NaN weight block only its own column."""
    q = quantize(_weight(300, n=40, seed=3), "mxfp4-mbs-d")
    x = torch.randn(m, 300)
    x[2, 5] = float("nan")
    x[1, 0] = float("inf")
    x[0] = 0.0
    y = ck.mx_linear(
        x,
        "mxfp4-mbs-d",
        "mxfp4-mbs-s",
        q.codes,
        q.scales,
        q.mbs,
        300,
        None,
        torch.float32,
        MACRO_BLOCK,
    )
    assert torch.isnan(y[2]).all() and torch.isnan(y[1]).all()
    assert torch.isnan(y[:, 5:8]).all()  # NaN, Inf, and values beyond fp32 in weight rows 5..7
    assert torch.isfinite(y[0, 8:]).all() and torch.isfinite(y[3:, 8:]).all()
    _assert_within_bound(
        y, _reference(x, q, "mxfp4-mbs-s", None), torch.float32, 300, "mxfp4-mbs-d", "mxfp4-mbs-s"
    )


def test_empty_rows(ck):
    q = quantize(torch.randn(8, 64), "mxfp4-16-oas")
    y = ck.mx_linear(
        torch.empty(0, 64),
        "mxfp4-16-oas",
        "mxfp4-16-oas",
        q.codes,
        q.scales,
        None,
        64,
        None,
        torch.bfloat16,
        MACRO_BLOCK,
    )
    assert y.shape == (0, 8) and y.dtype == torch.bfloat16


def test_bad_inputs_name_the_tensor(ck):
    q = quantize(torch.randn(8, 64), "mxfp4-mbs-d")
    good = {"x": torch.randn(2, 64), "codes": q.codes, "scales": q.scales, "mbs": q.mbs}
    for bad, match in (
        ({"x": torch.randn(2, 32)}, "last dim 32 but the weight has K=64"),
        ({"scales": q.scales[:, :2]}, "weight scales"),
        ({"mbs": q.mbs[:4]}, "MBS bytes"),
        ({"bias": torch.randn(3)}, "bias has 3 elements"),
    ):
        a = {**good, "bias": None, **bad}
        w = (a["codes"], a["scales"], a["mbs"])
        with pytest.raises(RuntimeError, match=match):
            ck.mx_linear(
                a["x"], "mxfp4-mbs-d", "mxfp4-mbs-s", *w, 64, a["bias"], torch.float32, MACRO_BLOCK
            )
    wc, ws, wm = ck.pack_weight(q.codes, q.scales, q.mbs, 64, "mxfp4-mbs-d", MACRO_BLOCK)
    args = ck.linear_args("mxfp4-mbs-d", "mxfp4-mbs-s", 8, 64, MACRO_BLOCK)
    with pytest.raises(RuntimeError, match="packed weight codes must be"):
        ck.linear_packed(torch.randn(2, 64), args, q.codes, ws, wm, None, torch.float32)
    with pytest.raises(ValueError, match="do not quantize activations as 'nvfp4'"):
        ck.act_fake_quant(torch.randn(2, 64), "nvfp4", MACRO_BLOCK)
    with pytest.raises(ValueError, match="do not read weights stored as 'mxplus'"):
        ck.dequant_weight(quantize(torch.randn(8, 64), "mxplus"))
    with pytest.raises(ValueError, match="need the same block size"):
        ck.linear_args("mxfp4-ocp", "mxfp4-16-oas", 8, 64, MACRO_BLOCK)


def test_ops_trace_and_check(ck):
    """Fake implementations: opcheck, and a fullgraph compile that calls the op."""
    q = quantize(torch.randn(20, 130), "mxfp4-mbs-d")
    x = torch.randn(3, 130, dtype=torch.bfloat16)
    ops = torch.ops.vllm_mxplus
    torch.library.opcheck(ops.cpu_pack_weight.default, (q.codes, q.scales, q.mbs, 130, 16, 128))
    q32 = quantize(torch.randn(20, 130), "mxfp4-ocp")  # no MBS bytes, block 32
    torch.library.opcheck(
        ops.cpu_pack_weight.default, (q32.codes, q32.scales, ck.empty_mbs(), 130, 32, 128)
    )
    wc, ws, wm = ck.pack_weight(q.codes, q.scales, q.mbs, 130, "mxfp4-mbs-d", MACRO_BLOCK)
    args = (x, 16, 2, True, 128, wc, ws, wm, 20, 130, 16, None, torch.bfloat16)
    torch.library.opcheck(ops.cpu_mx_linear.default, args)
    torch.library.opcheck(ops.cpu_act_fake_quant.default, (x, 16, 2, True, 128))
    torch.library.opcheck(ops.cpu_act_quant.default, (x, 16, 2, True, 128))

    @torch.compile(fullgraph=True, backend="aot_eager")
    def f(x):
        return ops.cpu_mx_linear(*((x,) + args[1:])) * 2

    assert torch.equal(f(x), ops.cpu_mx_linear(*args) * 2)


def test_build_name_tracks_source_flags_and_cpu(ck, monkeypatch):
    name = ck.build_name()
    assert name.startswith("mxplus_cpu_") and ck.build_dir().name == name
    monkeypatch.setattr(ck, "_cpu_signature", lambda: "flags : sse2")
    assert ck.build_name() != name  # a cache shared with another CPU never reuses this build


def test_disabled_by_env(monkeypatch):
    from vllm_mxplus.backends.cpu import kernels as cpu_kernels

    monkeypatch.setenv(cpu_kernels.ENV_DISABLE, "0")
    ok, why = cpu_kernels.load()
    assert not ok and "VLLM_MXPLUS_CPU_KERNELS=0" in why
