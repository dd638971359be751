"""MX+ on the CPU integer path (csrc/mx_mxplus_cpu.cpp) against `vllm_mxplus.formats`: the
activation operand (2 * value as int8, block maxima included) and scales bit for bit, the
fake-quantized values bit for bit, the weight tiles decoded in Python, and the linear within
its derived bound of the float64 product of the spec's values.

The bound (csrc/mx_mxplus_cpu.cpp; docs/numerics.md, "Kernel numerics and error bounds"):
x_hat and w_hat are exact fp32 values (a <= 4-bit significand times a power of two), every
block sum, block maximum included, is an exact integer, each block term is exact unless it
falls below fp32's normal range; with y64 the float64 product plus the bias, u = 2^-24 and n_b
blocks of 32 in K,
    |y - y64| <= (n_b + 2) u (|x_hat| |w_hat|^T + |b|) + 2^-150 n_b
(n_b fp32 additions, u for second-order terms, 2^-150 per block term rounded to a subnormal),
plus one rounding to a bf16 / fp16 output. A wrong block-max index, value or scale code moves
an output by at least 2^-5 of the term it touches.
"""

from __future__ import annotations

import dataclasses
import shutil

import pytest
import torch
from bound_helpers import check_bound  # tests/backends, on sys.path under pytest
from edge_rows import edge_rows

from vllm_mxplus.formats import MACRO_BLOCK, fake_quantize, quantize
from vllm_mxplus.formats.constants import NO_BLOCK_MAX, ceil_div
from vllm_mxplus.formats.e2m1 import e2m1_decode, unpack_fp4

pytestmark = pytest.mark.skipif(shutil.which("c++") is None, reason="no C++ compiler (c++)")

BLOCK = 32


def special_rows(x: torch.Tensor) -> torch.Tensor:
    """NaN, Inf, zero, subnormal, ties and huge rows (scale codes at both ends)."""
    k = x.shape[-1]
    edge_rows(x)
    x[4] *= 1e-39  # subnormal block absmax: scale code 0, no block max
    x[5, : min(k, 40)] = -3.0e38  # scale code 252; two equal maxima: the first one is it
    x[7] = torch.linspace(-3, 3, k) * 2.0**124
    x[8, : min(k, 32)] = torch.tensor([7.75, 7.25, 6.5, -5.0] * 8)[: min(k, 32)]  # j = 7.5: 7
    return x


def doubled(q, k: int) -> torch.Tensor:
    """2 * value of an MX+ QuantizedTensor as int8 [M, K] (docs/numerics.md, "MX+"): E2M1
    values, the block max +-4 (1 + j/8), i.e. 2 * value = +-(8 + j) for its code sign | j."""
    m, nb = q.codes.shape[0], ceil_div(k, BLOCK)
    c = torch.zeros(m, nb * BLOCK, dtype=torch.long)
    c[:, :k] = unpack_fp4(q.codes, k).long()
    d = (2 * e2m1_decode(c)).long().view(m, nb, BLOCK)
    c = c.view(m, nb, BLOCK)
    bm = q.block_max_index.long()
    has = bm != NO_BLOCK_MAX
    idx = torch.where(has, bm, 0)[..., None]
    code = c.gather(-1, idx)
    v = 8 + (code & 7)
    v = torch.where((code & 8) > 0, -v, v)
    d = d.scatter(-1, idx, torch.where(has[..., None], v, d.gather(-1, idx)))
    return d.view(m, -1)[:, :k].to(torch.int8)


@pytest.mark.parametrize("k", [1, 15, 31, 32, 33, 100, 577, 1536], ids=lambda k: f"K{k}")
def test_act_quant_bit_exact(ck, k):
    g = torch.Generator().manual_seed(k)
    x = special_rows(torch.randn(10, k, generator=g) * torch.logspace(-6, 6, 10)[:, None])
    codes, scales, mbs = ck.act_quant(x, "mxplus", MACRO_BLOCK)
    q = quantize(x, "mxplus")
    assert torch.equal(codes, doubled(q, k))
    assert torch.equal(scales, q.scales) and mbs.numel() == 0
    assert int(scales.min()) == 0 and int(scales[scales < 255].max()) >= 250
    assert (q.block_max_index != NO_BLOCK_MAX).any() or k < 2


def test_act_quant_all_bf16_patterns(ck):
    """Every bf16 bit pattern once, 32 to a block: every scale code, every j and tie."""
    x = torch.arange(65536, dtype=torch.int32).to(torch.int16).view(torch.bfloat16)
    x = x.reshape(-1, 1024)
    codes, scales, _ = ck.act_quant(x, "mxplus", MACRO_BLOCK)
    q = quantize(x, "mxplus")
    assert torch.equal(codes, doubled(q, 1024))
    assert torch.equal(scales, q.scales)
    fq = ck.act_fake_quant(x, "mxplus", MACRO_BLOCK)
    assert torch.equal(fq.view(torch.int32), fake_quantize(x, "mxplus").view(torch.int32))


@pytest.mark.parametrize("k", [1, 33, 577], ids=lambda k: f"K{k}")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32], ids=str)
def test_act_fake_quant_bit_exact(ck, k, dtype):
    g = torch.Generator().manual_seed(k + 7)
    x = torch.randn(10, k, generator=g) * torch.logspace(-4, 4, 10)[:, None]
    x = (special_rows(x) if dtype == torch.float32 else x).to(dtype)
    want = fake_quantize(x, "mxplus")
    assert torch.equal(
        ck.act_fake_quant(x, "mxplus", MACRO_BLOCK).view(torch.int32), want.view(torch.int32)
    )


def weight(n: int, k: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(n, k, generator=g) * torch.logspace(-3, 3, k)[None, :].clamp(1e-2, 1e2)
    w[0] *= 2.0**-140  # scale code 0: clamped, no block max
    w[1] *= 2.0**-118  # small scale codes, subnormal values
    w[2] *= 2.0**100
    w[3, : min(k, 7)] = 0.0
    w[4] = 0.0  # all-zero blocks: index 255
    w[5, k // 2] = float("nan")
    w[6, -1] = float("inf")
    w[7] *= 2.0**122  # scale codes near the top of what `ocp` gives
    return w * 0.05


def test_pack_layout(ck):
    """The tiles hold the checkpoint's codes with each block max as code 0, the scales, and
    per row and block the block max's index and 2 * value (0 and 0 when none)."""
    n, k = 37, 100
    q = quantize(weight(n, k, 1) * 20, "mxplus")
    wc, ws, wbm = ck.pack_mxplus(q)
    nt, nb, groups = 3, 4, 8
    b = wc.view(nt, groups, 2, 16, 4).long()  # [tile, group, half q, row i, j]
    codes = torch.stack([b & 15, b >> 4], dim=-2).permute(0, 3, 1, 2, 4, 5)
    codes = codes.reshape(nt * 16, groups * 16)[:n]
    want = torch.zeros(n, nb * BLOCK, dtype=torch.long)
    want[:, :k] = unpack_fp4(q.codes, k).long()
    bm = q.block_max_index.long()
    has = (bm != NO_BLOCK_MAX) & (torch.arange(nb) * BLOCK + bm.clamp(max=31) < k)
    rows, blocks = has.nonzero(as_tuple=True)
    pos = blocks * BLOCK + bm[rows, blocks]
    orig = want[rows, pos].clone()
    want[rows, pos] = 0
    assert torch.equal(codes, want)
    assert torch.equal(ws.view(nt, nb, 16).transpose(1, 2).reshape(-1, nb)[:n], q.scales)
    p = wbm.view(nt, nb, 2, 16).permute(0, 3, 1, 2).reshape(nt * 16, nb, 2)[:n]
    assert torch.equal(p[..., 0].long(), torch.where(has, bm, 0))
    v = 8 + (orig & 7)
    val = torch.zeros(n, nb, dtype=torch.long)
    val[rows, blocks] = torch.where((orig & 8) > 0, -v, v)
    assert torch.equal(p[..., 1].view(torch.int8).long(), val)
    assert has.sum() > n  # most blocks have a block max


def reference(x, q, bias):
    xq = fake_quantize(x, "mxplus").double()
    w = q.dequantize().double()
    y, s = xq @ w.T, xq.abs() @ w.abs().T
    if bias is not None:
        y, s = y + bias.double(), s + bias.double().abs()
    return y, s


def assert_within_bound(y, ref, k, out_dtype=torch.float32):
    """The bound of the module docstring; NaN where the product is NaN, +-Inf or NaN where it
    exceeds fp32's range."""
    y_ref, s = ref
    n_b = ceil_div(k, BLOCK)
    rel = {torch.float32: 0.0, torch.bfloat16: 2.0**-8, torch.float16: 2.0**-11}[out_dtype]
    bound = (n_b + 2) * 2.0**-24 * s + 2.0**-150 * n_b + rel * y_ref.abs()
    check = check_bound(y, y_ref, s, bound)
    assert check.float().mean() > 0.3


@pytest.mark.parametrize("m", [1, 2, 3, 8, 16, 17, 64, 333], ids=lambda m: f"M{m}")
@pytest.mark.parametrize("k", [33, 577, 1536], ids=lambda k: f"K{k}")
def test_linear_matches_float64(ck, m, k):
    """Odd K, N not a multiple of 16, special weight rows (scale codes at both ends, NaN and
    Inf blocks, zero blocks) and activation rows."""
    g = torch.Generator().manual_seed(m * 1000 + k)
    q = quantize(weight(45, k, m + k), "mxplus")
    x = special_rows(torch.randn(max(m, 10), k, generator=g) * 3)
    order = [9, 8, 4, 7, 1, 0, 2, 3, 5, 6] + list(range(10, m))  # a plain row first
    x = x[order[:m]].to(torch.bfloat16)
    bias = torch.randn(45, generator=g)
    y = ck.mxplus_linear_packed(x, 45, k, *ck.pack_mxplus(q), bias, torch.float32)
    assert_within_bound(y, reference(x, q, bias), k)


def test_scale_codes_at_the_ends_of_the_e8m0_range(ck):
    """Stored scale codes 0, 1, 250..254 (253 / 254 overflow fp32 in the spec: +-Inf, so the
    outputs they touch are +-Inf or NaN) and 255 (NaN)."""
    k = 96
    q = quantize(torch.randn(24, k) * 0.05, "mxplus")
    for row, code in enumerate([0, 1, 250, 251, 252, 253, 254, 255]):
        q.scales[row, 1] = code
    x = torch.randn(5, k)
    y = ck.mxplus_linear_packed(x, 24, k, *ck.pack_mxplus(q), None, torch.float32)
    assert torch.isnan(y[:, 5:8]).all()
    assert_within_bound(y, reference(x, q, None), k)


@pytest.mark.parametrize("out_dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
def test_dtypes_and_leading_dims(ck, out_dtype):
    q = quantize(torch.randn(24, 320) * 0.1, "mxplus")
    x = torch.randn(2, 9, 320, dtype=torch.bfloat16)
    y = ck.mxplus_linear_packed(x, 24, 320, *ck.pack_mxplus(q), None, out_dtype)
    assert y.shape == (2, 9, 24) and y.dtype == out_dtype
    assert_within_bound(y.reshape(18, 24), reference(x.reshape(18, 320), q, None), 320, out_dtype)


@pytest.mark.parametrize("wrong", ["index", "value", "scale"])
def test_bound_catches_a_wrong_block_max(ck, wrong):
    k = 320
    g = torch.Generator().manual_seed(3)
    q = quantize(torch.randn(24, k, generator=g) * 0.05, "mxplus")
    x = torch.randn(8, k, generator=g).to(torch.bfloat16)
    ref = reference(x, q, None)
    bad = dataclasses.replace(
        q,
        codes=q.codes.clone(),
        scales=q.scales.clone(),
        block_max_index=q.block_max_index.clone(),
    )
    i = int(bad.block_max_index[3, 2])
    assert i != NO_BLOCK_MAX
    if wrong == "index":
        bad.block_max_index[3, 2] = (i + 1) % 32
    elif wrong == "value":
        pos = 64 + i  # element 2 * 32 + i of row 3, code sign | j
        bad.codes[3, pos // 2] ^= 0x01 << (4 * (pos % 2))
    else:
        bad.scales[3, 2] += 1
    y = ck.mxplus_linear_packed(x, 24, k, *ck.pack_mxplus(bad), None, torch.float32)
    with pytest.raises(AssertionError, match="out of bound"):
        assert_within_bound(y, ref, k)


@pytest.mark.parametrize("m", [3, 40], ids=lambda m: f"M{m}")
def test_nan_row_and_column(ck, m):
    q = quantize(weight(40, 300, 3), "mxplus")
    x = torch.randn(m, 300)
    x[2, 5] = float("nan")
    x[1, 0] = float("inf")
    y = ck.mxplus_linear_packed(x, 40, 300, *ck.pack_mxplus(q), None, torch.float32)
    assert torch.isnan(y[2]).all() and torch.isnan(y[1]).all()
    assert torch.isnan(y[:, 5:7]).all()  # NaN and Inf in weight rows 5, 6
    assert torch.isfinite(y[0, 8:]).all() and torch.isfinite(y[3:, 8:]).all()
    assert_within_bound(y, reference(x, q, None), 300)


def test_empty_rows_and_bad_inputs(ck):
    q = quantize(torch.randn(8, 64), "mxplus")
    wc, ws, wbm = ck.pack_mxplus(q)
    y = ck.mxplus_linear_packed(torch.empty(0, 64), 8, 64, wc, ws, wbm, None, torch.bfloat16)
    assert y.shape == (0, 8) and y.dtype == torch.bfloat16
    with pytest.raises(RuntimeError, match="last dim 32 but the weight has K=64"):
        ck.mxplus_linear_packed(torch.randn(2, 32), 8, 64, wc, ws, wbm, None, torch.float32)
    with pytest.raises(RuntimeError, match="packed block maxima"):
        ck.mxplus_linear_packed(torch.randn(2, 64), 8, 64, wc, ws, ws, None, torch.float32)
    with pytest.raises(RuntimeError, match="bias has 3 elements"):
        ck.mxplus_linear_packed(
            torch.randn(2, 64), 8, 64, wc, ws, wbm, torch.ones(3), torch.float32
        )
    bad = q.block_max_index.clone()
    bad[1, 1] = 40
    with pytest.raises(RuntimeError, match="block_max_index 40 at row 1, block 1"):
        torch.ops.vllm_mxplus.cpu_mxplus_pack_weight(q.codes, q.scales, bad, 64)
    with pytest.raises(ValueError, match=r"2-D weight with MX\+ block maxima, got mxfp4-ocp"):
        ck.pack_mxplus(quantize(torch.randn(8, 64), "mxfp4-ocp"))
    with pytest.raises(RuntimeError, match="MX\\+ takes block 32 without MBS"):
        torch.ops.vllm_mxplus.cpu_act_quant(torch.randn(2, 64), 16, 3, False, 128)


def test_ops_trace_and_check(ck):
    q = quantize(torch.randn(20, 130), "mxplus")
    x = torch.randn(3, 130, dtype=torch.bfloat16)
    ops = torch.ops.vllm_mxplus
    torch.library.opcheck(
        ops.cpu_mxplus_pack_weight.default, (q.codes, q.scales, q.block_max_index, 130)
    )
    args = (x, *ck.pack_mxplus(q), 20, 130, None, torch.bfloat16)
    torch.library.opcheck(ops.cpu_mxplus_linear.default, args)
    torch.library.opcheck(ops.cpu_act_quant.default, (x, 32, 3, False, 128))

    @torch.compile(fullgraph=True, backend="aot_eager")
    def f(x):
        return ops.cpu_mxplus_linear(*((x,) + args[1:])) * 2

    assert torch.equal(f(x), ops.cpu_mxplus_linear(*args) * 2)
