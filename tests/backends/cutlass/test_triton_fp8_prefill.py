"""The Triton FP8-chunk GEMM (`triton.fp8_chunk_gemm`) and the prefill pipeline on it.

Under the interpreter (CPU): the kernel against the fp64 chunk sum it defines, the whole
`triton-fp8-prefill` pipeline (FP8 re-encoding, the Triton GEMM, the exact fallback of rows
and columns the FP8 form cannot hold) against `formats`' x_hat W_hat^T within the fp32 bound
of docs/numerics.md, NaN rows where the spec puts them, the selector's M ranges, and errors
naming the argument at fault.
"""

from __future__ import annotations

import pytest
import torch
from cutlass_helpers import emulated_fp8_gemm  # tests/backends/cutlass, on sys.path under pytest

from vllm_mxplus.backends import LinearSpec
from vllm_mxplus.backends.checks import first_outside_bound, output_bound
from vllm_mxplus.backends.cutlass import fp8_chunks as fc
from vllm_mxplus.backends.cutlass import gemm as cutlass_gemm
from vllm_mxplus.backends.cutlass.linear import FP8_PREFILL_MIN_M, TritonFp8PrefillBackend
from vllm_mxplus.backends.triton.fp8_chunk_gemm import fp8_chunk_gemm
from vllm_mxplus.formats import get_scheme, quantize

OUT = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


def _layouts(m: int, n: int, k: int, seed: int, spread: int = 0):
    """Quantized x [m, k] (MBS-S) and w [n, k] (MBS-D) and their FP8-chunk layouts; spread:
    the odd rows' per-16-block magnitudes over 2*spread binades (wide spreads leave the FP8
    span), the even rows' in span."""
    g = torch.Generator().manual_seed(seed)

    def data(rows: int) -> torch.Tensor:
        e = torch.randint(-spread, spread + 1, (rows, -(-k // 16)), generator=g)
        e[::2] = 0  # even rows in span
        return torch.randn(rows, k, generator=g) * torch.exp2(
            e.repeat_interleave(16, -1)[:, :k].float()
        )

    qx, qw = quantize(data(m), "mxfp4-mbs-s"), quantize(data(n), "mxfp4-mbs-d")
    xl = fc.encode_fp8_chunks(qx.codes, qx.scales, qx.mbs, k)
    wl = fc.encode_fp8_chunks(qw.codes, qw.scales, qw.mbs, k)
    return qx, qw, xl, wl


@pytest.mark.parametrize("out", sorted(OUT))
@pytest.mark.parametrize("m,n,k", [(1, 8, 128), (37, 70, 300), (64, 33, 1024)])
def test_kernel_matches_the_chunk_sum(triton_device, m, n, k, out):
    """y = sum_c sa sb (A_c B_c^T) + bias against the fp64 sum: the products are exact, so
    the fp32 work (one addition per element of a chunk, the scales' two roundings and one
    addition per chunk, the bias) stays within (Kp + 3 nc + 2) 2^-24 sum |terms|, plus the
    cast to the output dtype."""
    _, _, xl, wl = _layouts(m, n, k, seed=m + n + k)
    bias = torch.randn(n) * 4
    y = fp8_chunk_gemm(xl.fp8, xl.scale, wl.fp8, wl.scale, bias, OUT[out])
    assert y.shape == (m, n) and y.dtype == OUT[out]
    want = emulated_fp8_gemm(xl.fp8, xl.scale, wl.fp8, wl.scale, bias, torch.float64)
    a = xl.fp8.double().view(m, -1, fc.CHUNK)
    b = wl.fp8.double().view(n, -1, fc.CHUNK)
    mag = torch.einsum("mck,nck->cmn", a.abs(), b.abs())
    mag = (mag * xl.scale.double()[:, :, None] * wl.scale.double()[:, None, :]).sum(0)
    mag = mag + bias.double().abs()
    nc = a.shape[1]
    # one ulp of the output dtype: the interpreter casts fp32 to bf16 by truncation (the
    # GPU rounds to nearest: half of that)
    ulp = {"bf16": 2.0**-7, "fp16": 2.0**-10, "fp32": 2.0**-23}[out]
    bound = (nc * fc.CHUNK + 3 * nc + 2) * 2.0**-24 * mag + ulp * want.abs()
    assert ((y.double() - want).abs() <= bound).all()
    # and it is not the zero function: the sum is far above the bound
    assert (want.abs() > 64 * bound).float().mean() > 0.5


def test_kernel_rows_past_the_tile_and_int64_offsets_are_right(triton_device):
    """M and N not multiples of the tile; the last rows get their own values (a wrong row
    offset would copy another row's)."""
    _, _, xl, wl = _layouts(45, 39, 256, seed=3)
    y = fp8_chunk_gemm(xl.fp8, xl.scale, wl.fp8, wl.scale, None, torch.float32)
    want = emulated_fp8_gemm(xl.fp8, xl.scale, wl.fp8, wl.scale, None, torch.float64)
    rel = (y.double() - want).abs() / want.abs().max()
    assert rel.max().item() < 2.0**-18
    assert not torch.equal(y[-1], y[-2]) and not torch.equal(y[:, -1], y[:, -2])


def test_kernel_rejects_bad_operands(triton_device):
    _, _, xl, wl = _layouts(4, 8, 256, seed=5)
    with pytest.raises(ValueError, match="a_fp8 must be 2-D float8_e4m3fn"):
        fp8_chunk_gemm(xl.fp8.float(), xl.scale, wl.fp8, wl.scale, None, torch.bfloat16)
    with pytest.raises(ValueError, match="K of a_fp8"):
        fp8_chunk_gemm(xl.fp8[:, :128], xl.scale, wl.fp8, wl.scale, None, torch.bfloat16)
    with pytest.raises(ValueError, match="b_scale must be fp32"):
        fp8_chunk_gemm(xl.fp8, xl.scale, wl.fp8, wl.scale[:1], None, torch.bfloat16)
    with pytest.raises(ValueError, match="bias must be fp32"):
        fp8_chunk_gemm(xl.fp8, xl.scale, wl.fp8, wl.scale, torch.zeros(8).half(), torch.float32)
    with pytest.raises(ValueError, match="out_dtype"):
        fp8_chunk_gemm(xl.fp8, xl.scale, wl.fp8, wl.scale, None, torch.int32)


def _within_fp32_bound(y, qx, qw, bias, k):
    """None, or the first element outside the fp32-accumulator bound (u = 2^-24; the
    interpreter's dot accumulates in fp32) of the fp64 x_hat W_hat^T (+ b)."""
    xh, wh = qx.dequantize().double(), qw.dequantize().double()
    b64 = torch.zeros(wh.shape[0], dtype=torch.float64) if bias is None else bias.double()
    y64 = xh @ wh.T + b64
    bound = output_bound(xh.abs() @ wh.abs().T, y64, b64, k, y.dtype, 24)
    return first_outside_bound(y.double(), y64, bound, nan_ok=False)


@pytest.mark.parametrize("out", ["bf16", "fp32"])
@pytest.mark.parametrize("m,n,k", [(33, 40, 576), (5, 24, 1000)])
def test_pipeline_with_both_fallbacks_within_bound(triton_device, m, n, k, out):
    """Block exponents over 24 binades: activation rows and weight rows out of the FP8 span
    are recomputed from the packed operands; every element within the bound of formats'
    product (no emulation: the Triton kernels run)."""
    qx, qw, xl, _ = _layouts(m, n, k, seed=7, spread=12)
    w = cutlass_gemm.prepare_weight(qw, "sm90a", engine="triton")
    assert (~xl.exact_rows).any() and w.fallback_idx.numel() > 0, "data must hit both fallbacks"
    assert xl.exact_rows.any(), "and some rows must stay on the FP8 GEMM"
    bias = torch.randn(n).to(OUT[out])
    y = cutlass_gemm.prefill_gemm(qx.codes, qx.scales, qx.mbs, k, w, bias, OUT[out])
    assert y.shape == (m, n) and y.dtype == OUT[out]
    failure = _within_fp32_bound(y, qx, qw, bias, k)
    assert failure is None, failure


def test_pipeline_nan_row_and_exact_rows(triton_device):
    """A NaN input block makes its row NaN and no other (docs/numerics.md); rows in span keep
    the FP8 GEMM's numbers bit for bit."""
    m, n, k = 10, 16, 256
    x = torch.randn(m, k)
    x[3, 16:32] *= 2.0**-20  # out of span: recomputed
    x[6, 200] = float("nan")
    qx, qw = quantize(x, "mxfp4-mbs-s"), quantize(torch.randn(n, k), "mxfp4-mbs-d")
    w = cutlass_gemm.prepare_weight(qw, "sm90a", engine="triton")
    y = cutlass_gemm.prefill_gemm_from_x(x, "mxfp4-mbs-s", w, None, torch.float32)
    assert torch.isnan(y).all(-1).nonzero().flatten().tolist() == [6]
    xl = fc.encode_fp8_chunks(qx.codes, qx.scales, qx.mbs, k)
    wl = fc.encode_fp8_chunks(qw.codes, qw.scales, qw.mbs, k)
    plain = fp8_chunk_gemm(xl.fp8, xl.scale, wl.fp8, wl.scale, None, torch.float32)
    exact = [r for r in range(m) if r not in (3, 6)]
    assert torch.equal(y[exact], plain[exact])
    ok = [r for r in range(m) if r != 6]
    assert not torch.isnan(y[ok]).any()


def test_prepare_weight_rejects_unknown_engine():
    qw = quantize(torch.randn(8, 128), "mxfp4-mbs-d")
    with pytest.raises(ValueError, match="unknown FP8-chunk engine 'tvm'"):
        cutlass_gemm.prepare_weight(qw, "sm90a", engine="tvm")


def test_backend_serves_from_its_min_m_on_fp8_gpus_only(triton_device):
    spec = LinearSpec(get_scheme("mxfp4-mbs", 128), 64, 4096, torch.bfloat16)
    assert TritonFp8PrefillBackend.can_implement(spec)[0]
    assert TritonFp8PrefillBackend.m_bounds() == (FP8_PREFILL_MIN_M, None)
    assert TritonFp8PrefillBackend.supports_m(FP8_PREFILL_MIN_M)
    assert not TritonFp8PrefillBackend.supports_m(FP8_PREFILL_MIN_M - 1)
    for cap in (80, 89, 120):
        ok, why = TritonFp8PrefillBackend.is_supported("cuda", cap)
        assert not ok and "capability 90 or 100" in why
    assert TritonFp8PrefillBackend.is_supported("cuda", 90)[0]
    ocp = LinearSpec(get_scheme("mxfp4-ocp", 128), 64, 4096, torch.bfloat16)
    assert not TritonFp8PrefillBackend.can_implement(ocp)[0]


def test_backend_layer_matches_formats(triton_device):
    """The backend as a layer: weights prepared at load, apply() on activations, within the
    fp32 bound of formats' product (its weight is the packed one: no FP8 copy held)."""
    spec = LinearSpec(get_scheme("mxfp4-mbs", 128), 24, 384, torch.float32)
    backend = TritonFp8PrefillBackend(spec)
    qw = quantize(torch.randn(24, 384), spec.weight_format, macro_block=128)
    layer = torch.nn.Module()
    backend.process_weights_after_loading(layer, qw)
    held = getattr(layer, TritonFp8PrefillBackend.WEIGHT_ATTR)
    assert held.engine == "triton" and held.packed[0] is qw.codes
    x = torch.randn(2, 9, 384)
    y = backend.apply(layer, x, None)
    assert y.shape == (2, 9, 24)
    qx = quantize(x.reshape(-1, 384), spec.activation_format, macro_block=128)
    failure = _within_fp32_bound(y.reshape(-1, 24), qx, qw, None, 384)
    assert failure is None, failure


def test_held_fp8_weight_same_numbers_and_wider_range(triton_device, monkeypatch):
    """VLLM_MXPLUS_FP8_WEIGHT_HELD=1: the weight's FP8 form is made once at load (the per-call
    encoder's bytes, so the outputs are the same bits), and the backend serves from M = 17;
    a bad value fails naming the variable."""
    from vllm_mxplus import settings
    from vllm_mxplus.backends.cutlass.linear import FP8_HELD_MIN_M
    from vllm_mxplus.backends.cutlass.weight_fp8 import weight_fp8_chunks

    spec = LinearSpec(get_scheme("mxfp4-mbs", 128), 24, 384, torch.float32)
    qw = quantize(torch.randn(24, 384), spec.weight_format, macro_block=128)
    x = torch.randn(20, 384)
    ys = {}
    for held in ("0", "1"):
        monkeypatch.setenv(settings.FP8_WEIGHT_HELD.name, held)
        backend = TritonFp8PrefillBackend(spec)
        layer = torch.nn.Module()
        backend.process_weights_after_loading(layer, qw)
        w = getattr(layer, TritonFp8PrefillBackend.WEIGHT_ATTR)
        assert (w.held_fp8 is not None) == (held == "1")
        ys[held] = backend.apply(layer, x, None)
    fp8, scale = weight_fp8_chunks(qw.codes, qw.scales, qw.mbs, 384, 24)
    assert torch.equal(w.held_fp8[0].view(torch.uint8), fp8.view(torch.uint8))
    assert torch.equal(w.held_fp8[1], scale)
    assert torch.equal(ys["0"], ys["1"])
    assert TritonFp8PrefillBackend.m_bounds() == (FP8_HELD_MIN_M, None)
    monkeypatch.setenv(settings.FP8_WEIGHT_HELD.name, "maybe")
    with pytest.raises(ValueError, match="VLLM_MXPLUS_FP8_WEIGHT_HELD"):
        TritonFp8PrefillBackend.m_bounds()
