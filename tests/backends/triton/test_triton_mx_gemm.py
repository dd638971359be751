"""The Triton FP4 GEMM of every format (`mx_gemm`) and the quantizers it adds
(`act_quant_plus`): codes bit for bit with `vllm_mxplus.formats`, GEMM outputs within the
bound of docs/numerics.md, "Kernel numerics and error bounds".

The bound (mx_gemm's docstring): the kernel's products of dequantized operands are exact
(E2M1 value x power of two, MX+ block max 4..7.5 x power of two, E2M1 x E4M3: at most 6
significant bits), so its error is the fp32 summation of K terms in any order, (K - 1) u S
with u = 2^-24, plus a few relative roundings per term (MBS: the sigma = fp32(1/F) scaling,
NVFP4: the products by the global scales, the spec's own rounding of x_hat, bias): at most
(K + 8) u S <= 2^-16 S for K <= 248 (these tests: K <= 200), plus the output dtype's
rounding (fp32: 2^-24 |y64|). One wrong code, scale, MBS byte or block-max index moves an
output by far more (the negative controls below).
"""

from __future__ import annotations

import pytest
import torch

from vllm_mxplus.formats import quantize
from vllm_mxplus.formats.e2m1 import pack_fp4
from vllm_mxplus.formats.nvfp4 import nvfp4_global_scale, quantize_nvfp4_given

# (scheme name, weight format, activation format, macro block)
CASES = [
    ("mbs-h-128", "mxfp4-mbs-d", "mxfp4-mbs-s", 128),
    ("mbs-h-32", "mxfp4-mbs-d", "mxfp4-mbs-s", 32),
    ("mbs-s-16", "mxfp4-mbs-s", "mxfp4-mbs-s", 16),
    ("oas16", "mxfp4-16-oas", "mxfp4-16-oas", 128),
    ("ocp", "mxfp4-ocp", "mxfp4-ocp", 128),
    ("nvfp4", "nvfp4", "nvfp4", 128),
    ("mxplus", "mxplus", "mxplus", 128),
]


def _data(m: int, k: int, seed: int, spread: int = 6) -> torch.Tensor:
    """N(0, 1) times 2^e per element, e in [-spread, spread]: many block scales."""
    gen = torch.Generator().manual_seed(seed)
    e = torch.randint(-spread, spread + 1, (m, k), generator=gen).float()
    return torch.randn(m, k, generator=gen) * torch.exp2(e)


def _special_rows(x: torch.Tensor) -> torch.Tensor:
    """Rows with an all-zero block, a NaN, an Inf and a tiny block (E8M0 clamp)."""
    x = x.clone()
    x[0, :32] = 0.0
    if x.shape[0] > 3:
        x[1, 40] = float("nan")
        x[2, 70] = float("inf")
        x[3, :32] = 1e-39
    return x


def operands(q, fmt: str) -> tuple:
    """(codes, scales, extra, global) of a QuantizedTensor for `mx_gemm`."""
    extra = q.block_max_index if fmt == "mxplus" else q.mbs
    return q.codes, q.scales, extra, q.global_scale


def _gemm(qx, qw, wf: str, k: int, macro: int, bias=None, out_dtype=torch.float32):
    from vllm_mxplus.backends.triton.mx_gemm import mx_gemm, operand_format

    fmt, bs = operand_format(wf)
    return mx_gemm(
        operands(qx, wf),
        operands(qw, wf),
        k,
        bias,
        out_dtype,
        fmt=fmt,
        block_size=bs,
        macro_block=macro,
    )


def _bound_check(y, qx, qw, bias=None, out_ulp: float = 2.0**-24) -> None:
    xh, wh = qx.dequantize().double().cpu(), qw.dequantize().double().cpu()
    y64 = xh @ wh.T + (0 if bias is None else bias.double().cpu())
    s = xh.abs() @ wh.abs().T + (0 if bias is None else bias.double().abs().cpu())
    err = (y.double().cpu() - y64).abs()
    bound = 2.0**-16 * s + out_ulp * y64.abs()
    bad = ~(err <= bound)
    assert not bad.any(), (
        f"{int(bad.sum())} outputs out of bound, first at {bad.nonzero()[0].tolist()}: "
        f"err {err[bad].max():.3g}, bound {bound[bad].min():.3g}"
    )


# ----------------------------------------------------------------------------- quantizers
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
@pytest.mark.parametrize("m,k", [(1, 64), (5, 200)], ids=["m1-k64", "m5-k200"])
def test_mxplus_act_quant_bit_exact(triton_device, dtype, m, k):
    """Codes, E8M0 scales and block-max indices of `formats.quantize(x, "mxplus")`, with
    zero / NaN / Inf / tiny blocks and a partial last block (K = 200)."""
    from vllm_mxplus.backends.triton.act_quant_plus import act_quant_mxplus

    x = _special_rows(_data(m, k, seed=m + k)).to(dtype).to(triton_device)
    codes, scales, bm = act_quant_mxplus(x)
    want = quantize(x, "mxplus")
    for got, ref in ((codes, want.codes), (scales, want.scales), (bm, want.block_max_index)):
        assert torch.equal(got.cpu(), ref.cpu())
    assert (bm.cpu() != 255).any() and (bm.cpu() == 255).any()  # both kinds of block seen


def test_mxplus_act_quant_block_max_ties_and_rounding(triton_device):
    """The first of two equal maxima is the block max; 2v - 8 ties round to even."""
    from vllm_mxplus.backends.triton.act_quant_plus import act_quant_mxplus

    x = torch.zeros(3, 32)
    x[0, 5] = x[0, 9] = -6.0  # tie: index 5
    x[1, 0], x[1, 1] = 4.25, 1.0  # 2v - 8 = 0.5: ties to j = 0
    x[2, 31], x[2, 3] = 4.75, 2.0  # 2v - 8 = 1.5: ties to j = 2
    x = x.to(triton_device)
    codes, scales, bm = act_quant_mxplus(x)
    want = quantize(x, "mxplus")
    assert torch.equal(bm.cpu(), want.block_max_index.cpu())
    assert torch.equal(codes.cpu(), want.codes.cpu())
    assert bm.cpu().flatten().tolist() == [5, 0, 31]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
def test_nvfp4_given_global_scale_bit_exact(triton_device, dtype):
    """Rows quantized with given per-row global scales (a row-parallel shard's whole-row
    scale, here 1.5x and 0.5x the rows' own, and 0): `quantize_nvfp4_given` bit for bit."""
    from vllm_mxplus.backends.triton.act_quant_plus import act_quant_nvfp4_given

    x = _special_rows(_data(5, 200, seed=3)).to(dtype).to(triton_device)
    g = nvfp4_global_scale(x.float(), per_row=True)
    g = g * torch.tensor([1.5, 0.5, 1.0, 1.0, 0.0], device=g.device)[:, None]
    codes, scales = act_quant_nvfp4_given(x, g)
    want_codes, want_scales = quantize_nvfp4_given(x.float(), g)
    assert torch.equal(codes.cpu(), pack_fp4(want_codes).cpu())
    assert torch.equal(scales.cpu().view(torch.uint8), want_scales.cpu().view(torch.uint8))


# ----------------------------------------------------------------------------- GEMM
@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
@pytest.mark.parametrize("m", [1, 5, 17, 40])
def test_mx_gemm_within_bound(triton_device, case, m):
    """Every format at decode (M <= 16: 16 x 32 tile) and prefill (`gemm_tiles`) sizes,
    K = 200 (partial blocks and macro blocks), N = 48, with a bias."""
    _, wf, af, macro = case
    k, n = 200, 48
    x = _data(m, k, seed=m).to(torch.bfloat16).to(triton_device)
    w = (_data(n, k, seed=100 + m, spread=3) * 0.1).to(triton_device)
    qx = quantize(x, af, macro_block=macro, per_row=True)
    qw = quantize(w, wf, macro_block=macro)
    bias = torch.randn(n, generator=torch.Generator().manual_seed(m)).to(triton_device)
    y = _gemm(qx, qw, wf, k, macro, bias)
    assert y.shape == (m, n) and y.dtype == torch.float32
    _bound_check(y, qx, qw, bias)


@pytest.mark.parametrize("case", [CASES[0], CASES[4], CASES[5], CASES[6]], ids=lambda c: c[0])
def test_prefill_tiles_within_bound(triton_device, case):
    """The prefill tiles (128 x 128; MBS 64 x 128, on code rows that vectorize) with partial
    row and column tiles and a partial macro block: M = 130, N = 136, K = 224 (112 bytes per
    row). Rows that do not vectorize (K = 200 in the other tests) take the 32 x 64 tile, on
    which the large tiles spill (`gemm_tiles`)."""
    from vllm_mxplus.backends.triton import mx_gemm as mg
    from vllm_mxplus.backends.triton.gemm_launch import codes_aligned

    _, wf, af, macro = case
    m, k, n = 130, 224, 136
    x = _data(m, k, seed=11).to(torch.bfloat16).to(triton_device)
    w = (_data(n, k, seed=12, spread=3) * 0.1).to(triton_device)
    qx = quantize(x, af, macro_block=macro, per_row=True)
    qw = quantize(w, wf, macro_block=macro)
    fmt, bs = mg.operand_format(wf)
    has_mbs = qw.mbs is not None
    assert codes_aligned(k, qx.codes, qw.codes)
    tile = mg.gemm_tiles(m, macro, has_mbs, bs, True)[:2]
    if has_mbs:
        assert tile == (mg.PREFILL_MBS_BLOCK_M, mg.PREFILL_MBS_BLOCK_N)
    else:
        assert tile == (mg.PREFILL_BLOCK_M, mg.PREFILL_BLOCK_N)
    unaligned = mg.gemm_tiles(m, macro, has_mbs, bs, False)
    assert unaligned[:2] == (mg.GATHER_BLOCK_M, mg.GATHER_BLOCK_N)
    assert unaligned[3] == (mg.GATHER_NUM_WARPS_MBS if has_mbs else mg.GATHER_NUM_WARPS)
    bias = torch.randn(n, generator=torch.Generator().manual_seed(13)).to(triton_device)
    y = _gemm(qx, qw, wf, k, macro, bias)
    assert y.shape == (m, n)
    _bound_check(y, qx, qw, bias)


@pytest.mark.parametrize("case", [CASES[0], CASES[5], CASES[6]], ids=["mbs", "nvfp4", "mxplus"])
def test_mx_gemm_bf16_output_and_special_values(triton_device, case):
    """bf16 output (its half ulp added to the bound) and operands with zero, NaN, Inf and
    tiny blocks: NaN outputs exactly where the float64 product is NaN."""
    _, wf, af, macro = case
    m, k, n = 20, 200, 40
    x = _special_rows(_data(m, k, seed=7)).to(torch.bfloat16).to(triton_device)
    w = (_data(n, k, seed=8, spread=2) * 0.1).to(triton_device)
    qx = quantize(x, af, macro_block=macro, per_row=True)
    qw = quantize(w, wf, macro_block=macro)
    y = _gemm(qx, qw, wf, k, macro, out_dtype=torch.bfloat16).double().cpu()
    y64 = qx.dequantize().double().cpu() @ qw.dequantize().double().cpu().T
    assert torch.equal(torch.isnan(y), torch.isnan(y64))
    fin = ~torch.isnan(y64)
    ok = ~torch.isnan(y64).any(1)  # rows without a NaN / Inf block
    qx_ok = quantize(x[ok.to(x.device)], af, macro_block=macro, per_row=True)
    y_ok = y[ok]
    assert fin[ok].all()
    _bound_check(y_ok, qx_ok, qw, out_ulp=2.0**-8)


@pytest.mark.parametrize("what", ["block_max_index", "nvfp4_scale", "mbs_byte"])
def test_bound_catches_one_wrong_weight_byte(triton_device, what):
    """Negative controls: the kernel reading one wrong block-max index (MX+), E4M3 scale
    (NVFP4) or MBS byte (macro block 32) leaves the bound; the right bytes stay in it."""
    case = {"block_max_index": CASES[6], "nvfp4_scale": CASES[5], "mbs_byte": CASES[1]}[what]
    _, wf, af, macro = case
    m, k, n = 17, 128, 32
    x = _data(m, k, seed=1).to(triton_device)
    w = _data(n, k, seed=2, spread=2).to(triton_device)
    qx = quantize(x, af, macro_block=macro, per_row=True)
    qw = quantize(w, wf, macro_block=macro)
    _bound_check(_gemm(qx, qw, wf, k, macro), qx, qw)
    bad = quantize(w, wf, macro_block=macro)
    if what == "block_max_index":
        i = bad.block_max_index[3, 1].item()
        bad.block_max_index[3, 1] = (i + 1) % 32
    elif what == "nvfp4_scale":
        s = bad.scales.view(torch.uint8)
        s[3, 1] = s[3, 1] + 1
    else:
        bad.mbs[3, 1] = (bad.mbs[3, 1].item() + 64) % 256
    with pytest.raises(AssertionError, match="out of bound"):
        _bound_check(_gemm(qx, bad, wf, k, macro), qx, qw)


def test_weight_row_offsets_are_64_bit(triton_device):
    """Weight row 2048 with a row pitch of 2^20 bytes starts at byte 2^31: a 32-bit
    row * stride wraps there. 2 GiB of virtual memory (CPU only)."""
    if triton_device.type != "cpu":
        pytest.skip("the 2 GiB strided buffer is a CPU (virtual memory) check")
    n, k, m, pitch = 2049, 64, 17, 1 << 20
    qx = quantize(_data(m, k, seed=4), "mxplus")
    qw = quantize(_data(n, k, seed=5, spread=2), "mxplus")
    base = torch.empty((n - 1) * pitch + k // 2, dtype=torch.uint8)
    codes = base.as_strided((n, k // 2), (pitch, 1))
    codes.copy_(qw.codes)
    from vllm_mxplus.backends.triton.mx_gemm import mx_gemm

    y = mx_gemm(
        operands(qx, "mxplus"),
        (codes, qw.scales, qw.block_max_index, None),
        k,
        None,
        torch.float32,
        fmt="mxplus",
        block_size=32,
        macro_block=128,
    )
    _bound_check(y, qx, qw)


def test_operand_checks_name_the_field(triton_device):
    from vllm_mxplus.backends.triton.mx_gemm import mx_gemm

    qx = quantize(_data(2, 64, seed=0).to(triton_device), "mxplus")
    with pytest.raises(ValueError, match="block_max_index"):
        mx_gemm((qx.codes, qx.scales, None, None), operands(qx, "mxplus"), 64, fmt="mxplus",
                block_size=32, macro_block=128)  # fmt: skip
    with pytest.raises(ValueError, match="block sizes"):
        mx_gemm(
            operands(qx, "mxplus"), operands(qx, "mxplus"), 64, fmt="nvfp4", block_size=32,
            macro_block=128,
        )  # fmt: skip


# ----------------------------------------------------------------------------- backends
@pytest.mark.parametrize("m", [1, 16, 17, 24, 512])
@pytest.mark.parametrize("scheme", ["mxfp4-mbs", "nvfp4", "mxplus", "mxfp4-ocp"])
def test_triton_backends_apply_is_capturable(scheme, m):
    """TritonDecodeBackend (M <= 16) / TritonGemmBackend apply on fake CUDA tensors under the
    capture guard, at vLLM's graph sizes: no host sync, no host <-> device copy, no CPU
    tensor built per call; NVFP4 with given row global scales (row-parallel TP)."""
    import types

    from vllm_mxplus.backends import LinearSpec
    from vllm_mxplus.backends.graph_guard import cuda_empty, fake_cuda, guarded
    from vllm_mxplus.backends.triton.linear import (
        ATTRS,
        GLOBAL_ATTR,
        TritonDecodeBackend,
        TritonGemmBackend,
    )
    from vllm_mxplus.formats import get_scheme

    n, k = 256, 512
    nvfp4, mxplus = scheme == "nvfp4", scheme == "mxplus"
    bs = 32 if scheme in ("mxplus", "mxfp4-ocp") else 16
    spec = LinearSpec(get_scheme(scheme), n, k, torch.bfloat16, device_type="cuda")
    cls = TritonDecodeBackend if m <= 16 else TritonGemmBackend
    with fake_cuda():
        extra = None
        if mxplus:
            extra = cuda_empty((n, k // 32), torch.uint8)
        elif scheme == "mxfp4-mbs":
            extra = cuda_empty((n, k // 128), torch.uint8)
        scales = cuda_empty((n, k // bs), torch.float8_e4m3fn if nvfp4 else torch.uint8)
        tensors = (cuda_empty((n, k // 2), torch.uint8), scales, extra)
        layer = types.SimpleNamespace(**dict(zip(ATTRS, tensors)))
        setattr(layer, GLOBAL_ATTR, cuda_empty((n,)) if nvfp4 else None)
        g = cuda_empty((m, 1)) if nvfp4 else None
        x, bias = cuda_empty((m, k), torch.bfloat16), cuda_empty((n,), torch.bfloat16)
        y, guard = guarded(cls(spec).apply, layer, x, bias, g)
    assert y.shape == (m, n)
    # the decode GEMM at M <= 16 (MX+: K = 512 takes x_hat; sm_90+, which the interpreter's
    # choice stands for); NVFP4 rows with given global scales keep mx_gemm
    decode = m <= 16 and not nvfp4
    gemm = "triton_decode_gemm" if decode else "triton_mx_gemm"
    assert any(gemm in op for op in guard.ops)
