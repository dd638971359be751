"""The CUTLASS prefill path: FP8 re-encoding (CPU, exact), fallback logic, fake ops, GPU kernels.

CPU tests check the layout itself: dequantizing the FP8 per-(row, chunk) layout reproduces
formats' x_hat bit for bit on every chunk the detector calls exact, the detector is exact
about which chunks FP8 cannot hold, and prefill_gemm's fallback gives reference numbers for
out-of-span rows. The GEMM is emulated here in fp64 (the kernel's math: sum over chunks of
a_scale * b_scale * A_c B_c^T); the GPU tests run the real kernels.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from vllm_mxplus.formats import qsnr, quantize
from vllm_mxplus.formats.e2m1 import pack_fp4
from vllm_mxplus.ops import cutlass_prefill as cp

FORMATS = ["mxfp4-mbs-s", "mxfp4-mbs-d", "mxfp4-16-oas"]
SHAPES = [(1, 128), (33, 576), (100, 100), (7, 4096)]
E2M1_POS = [0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0]


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.int32)


def _assert_bitwise(a: torch.Tensor, b: torch.Tensor) -> None:
    neq = _bits(a) != _bits(b)
    if neq.any():
        idx = tuple(neq.nonzero()[0].tolist())
        raise AssertionError(f"first mismatch at {idx}: {a[idx].item()!r} != {b[idx].item()!r}")


def _data(m: int, k: int, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    # Per-16-block magnitudes spread over 24 binades so that some chunks exceed the FP8 span.
    e = torch.randint(-12, 12, (m, -(-k // 16)), generator=g).repeat_interleave(16, -1)[:, :k]
    return torch.randn(m, k, generator=g) * torch.exp2(e.float())


def _emulated_fp8_gemm(a_fp8, a_scale, b_fp8, b_scale, bias):
    """The sm_90a kernel's arithmetic in fp64: sum_c sa[c,m] sb[c,n] (A_c B_c^T), + bias."""
    a = a_fp8.to(torch.float64).view(a_fp8.shape[0], -1, cp.CHUNK)
    b = b_fp8.to(torch.float64).view(b_fp8.shape[0], -1, cp.CHUNK)
    part = torch.einsum("mck,nck->cmn", a, b)
    acc = (part * a_scale.double()[:, :, None] * b_scale.double()[:, None, :]).sum(0)
    if bias is not None:
        acc = acc + bias.double()
    return acc.to(torch.bfloat16)


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("m,k", SHAPES, ids=[f"M{m}-K{k}" for m, k in SHAPES])
def test_fp8_layout_reproduces_x_hat_bitwise(fmt, m, k):
    x = _data(m, k)
    x[0] = torch.randn(k)  # row 0 in span: both kinds of chunk occur
    q = quantize(x, fmt)
    lay = cp.encode_fp8_chunks(q.codes, q.scales, q.mbs, k)
    x_hat = q.dequantize()
    exact = lay.exact.repeat_interleave(cp.CHUNK, -1)[:, :k]
    assert exact[0].all()
    _assert_bitwise(cp.dequantize_fp8_chunks(lay)[exact], x_hat[exact])


@pytest.mark.parametrize("fmt", FORMATS)
def test_in_span_data_is_all_exact(fmt):
    x = torch.randn(64, 1024) * 100  # gaussian rows: block exponents span a few binades
    q = quantize(x, fmt)
    lay = cp.encode_fp8_chunks(q.codes, q.scales, q.mbs, 1024)
    assert bool(lay.exact.all())
    _assert_bitwise(cp.dequantize_fp8_chunks(lay), q.dequantize())


def test_folded_scale_within_one_rounding():
    """The kernel's fp32 scale 2^(ref-127)·fp32(1/F) differs from x_hat by <= 1 fp32 ulp."""
    q = quantize(torch.randn(16, 512), "mxfp4-mbs-d")
    lay = cp.encode_fp8_chunks(q.codes, q.scales, q.mbs, 512)
    x_hat = q.dequantize()
    rel = ((cp.dequantize_folded(lay) - x_hat).abs() / x_hat.abs().clamp_min(1e-30))
    assert rel.max().item() <= 2.0**-23


@pytest.mark.parametrize("d", range(-12, 9))
@pytest.mark.parametrize("v", E2M1_POS)
def test_e4m3_span_theorem(v, d):
    """value·2^d is an E4M3 value for every E2M1 value iff d in [-8, 6] (the 14-binade span);
    outside it the exact per-element limits of the module docstring hold."""
    x = torch.tensor([v * 2.0**d])
    held = bool(x.to(torch.float8_e4m3fn).float() == x)
    if -8 <= d <= 6:
        assert held
    else:
        lowest = {0.5: -8, 1.0: -9, 1.5: -8, 2.0: -10, 3.0: -9, 4.0: -11, 6.0: -10}[v]
        highest = {0.5: 9, 1.0: 8, 1.5: 8, 2.0: 7, 3.0: 7, 4.0: 6, 6.0: 6}[v]
        assert held == (lowest <= d <= highest)


def _chunk_with_span(span: int, small_code: int) -> tuple[torch.Tensor, torch.Tensor]:
    """One 128-chunk: block 0 has exponent 140 and value 6, block 1 exponent 140 - span."""
    codes = torch.zeros(1, 128, dtype=torch.uint8)
    codes[0, 0] = 7  # value 6 -> d = +6 after the reference exponent
    codes[0, 16] = small_code
    scales = torch.full((1, 8), 0, dtype=torch.uint8)
    scales[0, 0], scales[0, 1] = 140, 140 - span
    return pack_fp4(codes), scales


@pytest.mark.parametrize("span", [13, 14, 15, 16])
@pytest.mark.parametrize("small_code", [1, 3], ids=["v0.5", "v1.5"])
def test_detector_flags_out_of_span_chunks(span, small_code):
    codes, scales = _chunk_with_span(span, small_code)
    lay = cp.encode_fp8_chunks(codes, scales, None, 128)
    assert bool(lay.exact.item()) == (span <= 14)


def test_detector_flags_nan_blocks():
    codes, scales = _chunk_with_span(2, 1)
    scales[0, 3] = 255
    assert not bool(cp.encode_fp8_chunks(codes, scales, None, 128).exact.item())


@pytest.mark.parametrize("with_bias", [False, True], ids=["nobias", "bias"])
@pytest.mark.parametrize("m,n,k", [(33, 40, 576), (100, 64, 256), (5, 24, 1000)],
                         ids=["M33-K576", "M100-K256", "M5-K1000"])
def test_prefill_fallback_matches_reference(monkeypatch, m, n, k, with_bias):
    """Out-of-span activation rows and weight rows take the exact fallback; the rest goes
    through the (emulated) kernel. Compared with the fp64 x_hat W_hat^T: bf16 output bound."""
    monkeypatch.setattr(cp, "fp8_chunk_gemm", _emulated_fp8_gemm)
    qx, qw = quantize(_data(m, k, 1), "mxfp4-mbs-s"), quantize(_data(n, k, 2), "mxfp4-mbs-d")
    bias = torch.randn(n).to(torch.bfloat16) if with_bias else None
    w = cp.prepare_weight(qw, "sm90a")
    xl = cp.encode_fp8_chunks(qx.codes, qx.scales, qx.mbs, k)
    assert (~xl.exact_rows).any() and w.fallback_idx.numel() > 0, "data must hit both fallbacks"
    y = cp.prefill_gemm(qx.codes, qx.scales, qx.mbs, k, w, bias, torch.bfloat16)
    ref = qx.dequantize().double() @ qw.dequantize().double().T
    if bias is not None:
        ref = ref + bias.double()
    assert y.shape == (m, n) and y.dtype == torch.bfloat16
    # bf16 output: relative error <= 2^-8 per element (plus fp32 accumulation, far smaller).
    err = (y.double() - ref).abs() / ref.abs().clamp_min(ref.abs().max() * 1e-6)
    assert err.max().item() <= 2.0**-8 + 1e-6
    assert qsnr(ref, y.double()) > 45.0


def test_fake_impls_give_shapes():
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():
        a = torch.empty(10, 256, dtype=torch.float8_e4m3fn)
        b = torch.empty(24, 256, dtype=torch.float8_e4m3fn)
        y = torch.ops.vllm_mxplus.cutlass_fp8_chunk_gemm(
            a, torch.empty(2, 10), b, torch.empty(2, 24), None)
        z = torch.ops.vllm_mxplus.cutlass_fp4_mbs_gemm(
            torch.empty(10, 128, dtype=torch.uint8), torch.empty(1, dtype=torch.uint8),
            torch.empty(24, 128, dtype=torch.uint8), torch.empty(1, dtype=torch.uint8),
            torch.empty(2, 10), torch.empty(2, 24), None, True)
    assert y.shape == (10, 24) and y.dtype == torch.bfloat16
    assert z.shape == (10, 24) and z.dtype == torch.bfloat16


def test_backend_reports_why_unavailable_on_cpu():
    ok, why = cp.CutlassPrefillBackend.is_supported("cpu", None)
    assert not ok and why
    if not torch.cuda.is_available():
        ok, why = cp.is_available()
        assert not ok and "CUDA" in why


@pytest.mark.parametrize("scheme,ok", [("mxfp4-mbs", True), ("mxfp4-mbs-s", True),
                                       ("mxfp4-ocp", False), ("nvfp4", False)])
def test_backend_scheme_support(scheme, ok):
    assert cp.scheme_supported(scheme) == ok


# ----------------------------------------------------------------------------- GPU
GPU_SHAPES = [(1, 256, 128), (33, 4096, 576), (100, 1024, 4096), (4096, 4096, 4096)]


@pytest.fixture(scope="module")
def kernel_arch() -> str:
    ok, why = cp.is_available()
    if not ok:
        pytest.skip(f"CUTLASS prefill kernel unavailable: {why}")
    return cp.arch_of()


@pytest.mark.gpu
@pytest.mark.parametrize("with_bias", [False, True], ids=["nobias", "bias"])
@pytest.mark.parametrize("m,n,k", GPU_SHAPES, ids=[f"M{m}-N{n}-K{k}" for m, n, k in GPU_SHAPES])
def test_gpu_prefill_vs_fp64_reference(kernel_arch, m, n, k, with_bias):
    """Kernel vs fp64 x_hat W_hat^T. Bound: QSNR >= 45 dB (bf16 output rounding alone gives
    ~50 dB; the only other difference is fp32 accumulation order)."""
    torch.manual_seed(0)
    x = torch.randn(m, k, device="cuda")
    qx, qw = quantize(x, "mxfp4-mbs-s"), quantize(torch.randn(n, k, device="cuda"), "mxfp4-mbs-d")
    bias = torch.randn(n, device="cuda").to(torch.bfloat16) if with_bias else None
    w = cp.prepare_weight(qw, kernel_arch)
    y = cp.prefill_gemm(qx.codes, qx.scales, qx.mbs, k, w, bias, torch.bfloat16)
    ref = qx.dequantize().double() @ qw.dequantize().double().T
    if bias is not None:
        ref = ref + bias.double()
    assert qsnr(ref, y.double()) >= 45.0


@pytest.mark.gpu
def test_gpu_out_of_span_rows_fall_back(kernel_arch):
    m, n, k = 64, 256, 1024
    qx, qw = quantize(_data(m, k, 3).cuda(), "mxfp4-mbs-s"), quantize(_data(n, k, 4).cuda(),
                                                                     "mxfp4-mbs-d")
    w = cp.prepare_weight(qw, kernel_arch)
    y = cp.prefill_gemm(qx.codes, qx.scales, qx.mbs, k, w, None, torch.bfloat16)
    ref = qx.dequantize().double() @ qw.dequantize().double().T
    assert qsnr(ref, y.double()) >= 45.0


@pytest.mark.gpu
def test_gpu_sm100_mbs_vs_plain(kernel_arch):
    """With all MBS bytes 0 the per-chunk MBS GEMM equals the single-launch no-MBS kernel."""
    if kernel_arch != "sm100a":
        pytest.skip("sm_100a only")
    m, n, k = 256, 512, 1024
    qx = quantize(torch.randn(m, k, device="cuda"), "mxfp4-16-oas")
    qw = quantize(torch.randn(n, k, device="cuda"), "mxfp4-16-oas")
    w = cp.prepare_weight(qw, "sm100a")
    y_mbs = cp.prefill_gemm(qx.codes, qx.scales, None, k, w, None)
    sig_x = cp.sigma_chunks(None, m, k).cuda()
    y_plain = cp.fp4_mbs_gemm(qx.codes, cp.pack_scales_sm100(qx.scales, k, k), w.codes,
                              cp.pack_scales_sm100(qw.scales, k, k), sig_x, w.sigma, None, False)
    assert qsnr(y_plain.double(), y_mbs.double()) >= 45.0


def test_prefill_op_passes_opcheck(monkeypatch):
    """The sm_90a prefill op (emulated GEMM) meets torch.library's schema / fake checks."""
    monkeypatch.setattr(cp, "fp8_chunk_gemm", _emulated_fp8_gemm)
    m, n, k = 9, 16, 256
    qx, qw = quantize(_data(m, k, 5), "mxfp4-mbs-s"), quantize(_data(n, k, 6), "mxfp4-mbs-d")
    w = cp.prepare_weight(qw, "sm90a")
    args = (qx.codes, qx.scales, qx.mbs, k, w.layout.fp8, w.layout.scale, w.layout.ref,
            w.layout.mbs, w.fallback_idx, w.fallback_w, None, w.n)
    torch.library.opcheck(torch.ops.vllm_mxplus.cutlass_prefill_sm90.default, args,
                          test_utils=("test_faketensor",))  # test_schema: no fp8 compare on CPU
