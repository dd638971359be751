"""The CUTLASS prefill path: FP8 re-encoding (CPU, exact), fallback logic, fake ops, GPU kernels.

CPU tests check the layout itself: dequantizing the FP8 per-(row, chunk) layout reproduces
formats' x_hat bit for bit on every chunk the detector calls exact, the detector is exact
about which chunks FP8 cannot hold, and prefill_gemm's fallback gives reference numbers for
out-of-span rows. The GEMM is emulated here in fp64 (the kernel's math: sum over chunks of
a_scale * b_scale * A_c B_c^T); the GPU tests run the real kernels.
"""

from __future__ import annotations

import os

import pytest
import torch
from cutlass_helpers import (  # tests/backends/cutlass, on sys.path under pytest
    dequantize_folded,
    emulated_sm90,  # noqa: F401  (a fixture, used through pytest.mark.usefixtures)
    scheme_supported,
)

from vllm_mxplus.backends.cutlass import build as cutlass_ext
from vllm_mxplus.backends.cutlass import fp8_chunks as fc
from vllm_mxplus.backends.cutlass import gemm as cutlass_gemm
from vllm_mxplus.backends.cutlass import ops as cutlass_ops
from vllm_mxplus.backends.cutlass.linear import CutlassPrefillBackend
from vllm_mxplus.formats import qsnr, quantize
from vllm_mxplus.formats.e2m1 import pack_fp4

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


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("m,k", SHAPES, ids=[f"M{m}-K{k}" for m, k in SHAPES])
def test_fp8_layout_reproduces_x_hat_bitwise(fmt, m, k):
    x = _data(m, k)
    x[0] = torch.randn(k)  # row 0 in span: both kinds of chunk occur
    q = quantize(x, fmt)
    lay = fc.encode_fp8_chunks(q.codes, q.scales, q.mbs, k)
    x_hat = q.dequantize()
    exact = lay.exact.repeat_interleave(fc.CHUNK, -1)[:, :k]
    assert exact[0].all()
    _assert_bitwise(fc.dequantize_fp8_chunks(lay)[exact], x_hat[exact])


@pytest.mark.parametrize("fmt", FORMATS)
def test_in_span_data_is_all_exact(fmt):
    x = torch.randn(64, 1024) * 100  # gaussian rows: block exponents span a few binades
    q = quantize(x, fmt)
    lay = fc.encode_fp8_chunks(q.codes, q.scales, q.mbs, 1024)
    assert bool(lay.exact.all())
    _assert_bitwise(fc.dequantize_fp8_chunks(lay), q.dequantize())


def test_folded_scale_within_one_rounding():
    """The kernel's fp32 scale 2^(ref-127)·fp32(1/F) differs from x_hat by <= 1 fp32 ulp."""
    q = quantize(torch.randn(16, 512), "mxfp4-mbs-d")
    lay = fc.encode_fp8_chunks(q.codes, q.scales, q.mbs, 512)
    x_hat = q.dequantize()
    rel = (dequantize_folded(lay) - x_hat).abs() / x_hat.abs().clamp_min(1e-30)
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
    lay = fc.encode_fp8_chunks(codes, scales, None, 128)
    assert bool(lay.exact.item()) == (span <= 14)


def test_detector_flags_nan_blocks():
    codes, scales = _chunk_with_span(2, 1)
    scales[0, 3] = 255
    assert not bool(fc.encode_fp8_chunks(codes, scales, None, 128).exact.item())


@pytest.mark.usefixtures("emulated_sm90")
@pytest.mark.parametrize("with_bias", [False, True], ids=["nobias", "bias"])
@pytest.mark.parametrize(
    "m,n,k",
    [(33, 40, 576), (100, 64, 256), (5, 24, 1000)],
    ids=["M33-K576", "M100-K256", "M5-K1000"],
)
def test_prefill_fallback_matches_reference(m, n, k, with_bias):
    """Out-of-span activation rows and weight rows take the exact fallback (the Triton FP4
    GEMM under the interpreter); the rest goes through the (emulated) kernel. Compared with
    the fp64 x_hat W_hat^T: bf16 output bound. The data spreads block exponents over 24
    binades, so most rows are out of span."""
    qx, qw = quantize(_data(m, k, 1), "mxfp4-mbs-s"), quantize(_data(n, k, 2), "mxfp4-mbs-d")
    bias = torch.randn(n).to(torch.bfloat16) if with_bias else None
    w = cutlass_gemm.prepare_weight(qw, "sm90a")
    xl = fc.encode_fp8_chunks(qx.codes, qx.scales, qx.mbs, k)
    assert (~xl.exact_rows).any() and w.fallback_idx.numel() > 0, "data must hit both fallbacks"
    y = cutlass_gemm.prefill_gemm(qx.codes, qx.scales, qx.mbs, k, w, bias, torch.bfloat16)
    ref = qx.dequantize().double() @ qw.dequantize().double().T
    if bias is not None:
        ref = ref + bias.double()
    assert y.shape == (m, n) and y.dtype == torch.bfloat16
    # bf16 output: relative error <= 2^-8 per element (plus fp32 accumulation, far smaller).
    err = (y.double() - ref).abs() / ref.abs().clamp_min(ref.abs().max() * 1e-6)
    assert err.max().item() <= 2.0**-8 + 1e-6
    assert qsnr(ref, y.double()) > 45.0


def _within_fp32_bound(y, qx, qw, bias, k):
    """Every element within the fp32-accumulator bound of docs/numerics.md (the self-test's
    `output_bound`, u = 2^-24) of the fp64 x_hat W_hat^T (+ b); None or the first miss."""
    from vllm_mxplus.backends.checks import first_outside_bound, output_bound

    xh, wh = qx.dequantize().double(), qw.dequantize().double()
    b64 = torch.zeros(wh.shape[0], dtype=torch.float64) if bias is None else bias.double()
    y64 = xh @ wh.T + b64
    bound = output_bound(xh.abs() @ wh.abs().T, y64, b64, k, y.dtype, 24)
    return first_outside_bound(y.double(), y64, bound, nan_ok=False)


@pytest.mark.usefixtures("emulated_sm90")
@pytest.mark.parametrize("out_dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
def test_every_row_out_of_span_at_m512_is_recomputed(out_dtype):
    """M = 512, every activation row with a block 20 binades under its chunk (out of the FP8
    span): no NaN, every element within the fp32 bound of the fp64 product. The rows are
    listed on the device and recomputed whatever their number (no capacity, no host sync:
    the same call under the fake-CUDA guard is tests/backends/test_graph_guard_fake_cuda.py's
    test_cutlass_sm90_every_row_inexact_at_m512)."""
    m, n, k = 512, 24, 256
    g = torch.Generator().manual_seed(12)
    x = torch.randn(m, k, generator=g)
    x[:, 16:32] *= 2.0**-20  # under the FP8 span of its chunk: lost by the plain encoding
    # the weight's matching blocks 2^12 larger (its chunks stay in span), so the lost terms
    # weigh ~2^-8 of the others: far outside the fp32 bound if a row were not recomputed
    wt = torch.randn(n, k, generator=g)
    wt[:, 16:32] *= 2.0**12
    qx, qw = quantize(x, "mxfp4-mbs-s"), quantize(wt, "mxfp4-mbs-d")
    bias = (torch.randn(n, generator=g) * 3).to(out_dtype)
    w = cutlass_gemm.prepare_weight(qw, "sm90a")
    assert w.fallback_idx.numel() == 0  # the weight is in span: only the rows fall back
    xl = fc.encode_fp8_chunks(qx.codes, qx.scales, qx.mbs, k)
    assert not xl.exact_rows.any(), "every row must be out of the FP8 span"
    y = cutlass_gemm.prefill_gemm(qx.codes, qx.scales, qx.mbs, k, w, bias, out_dtype)
    assert y.shape == (m, n) and y.dtype == out_dtype and not torch.isnan(y).any()
    failure = _within_fp32_bound(y, qx, qw, bias, k)
    assert failure is None, failure


@pytest.mark.usefixtures("emulated_sm90")
def test_exact_rows_untouched_and_nan_only_where_the_spec_says():
    """Inexact rows recomputed, exact rows keep the CUTLASS result bit for bit, and a row
    with a NaN input block is NaN (docs/numerics.md: NaN blocks give NaN outputs) while
    every other row is a number."""
    m, n, k = 12, 16, 256
    x = torch.randn(m, k)
    bad_rows = [2, 5, 6, 9]
    for r in bad_rows:
        x[r, 16:32] *= 2.0**-20  # a block 20 binades under its chunk: out of span
    x[6, 200] = float("nan")
    qx, qw = quantize(x, "mxfp4-mbs-s"), quantize(torch.randn(n, k), "mxfp4-mbs-d")
    w = cutlass_gemm.prepare_weight(qw, "sm90a")
    xl = fc.encode_fp8_chunks(qx.codes, qx.scales, qx.mbs, k)
    assert (~xl.exact_rows).nonzero().flatten().tolist() == bad_rows
    y = cutlass_gemm.prefill_gemm(qx.codes, qx.scales, qx.mbs, k, w, None, torch.float32)
    assert torch.isnan(y).all(-1).nonzero().flatten().tolist() == [6]
    ok = [r for r in range(m) if r != 6]
    assert not torch.isnan(y[ok]).any()
    wl = fc.encode_fp8_chunks(qw.codes, qw.scales, qw.mbs, k)  # the weight's FP8 form
    plain = cutlass_gemm.fp8_chunk_gemm(xl.fp8, xl.scale, wl.fp8, wl.scale, None,
                                        torch.float32)[:, :n]  # fmt: skip
    exact = [r for r in range(m) if r not in bad_rows]
    assert torch.equal(y[exact], plain[exact])
    failure = _within_fp32_bound(y[ok], *_rows(qx, ok), qw, None, k)
    assert failure is None, failure


def _rows(q, rows):
    """q restricted to `rows` (a QuantizedTensor of those rows, formats' own fields)."""
    import dataclasses

    return (
        dataclasses.replace(
            q,
            codes=q.codes[rows],
            scales=q.scales[rows],
            mbs=None if q.mbs is None else q.mbs[rows],
            shape=torch.Size((len(rows), q.shape[-1])),
        ),
    )


@pytest.mark.usefixtures("emulated_sm90")
@pytest.mark.parametrize(
    "out_dtype", [torch.bfloat16, torch.float16, torch.float32], ids=["bf16", "fp16", "fp32"]
)
def test_prefill_produces_model_dtype(out_dtype):
    """The output is the model's dtype, rounded once from the fp32 result: an fp16 / fp32
    model never sees bf16 rounding (nor a bf16-rounded bias)."""
    m, n, k = 20, 16, 256
    qx, qw = quantize(torch.randn(m, k), "mxfp4-mbs-s"), quantize(torch.randn(n, k), "mxfp4-mbs-d")
    bias = (torch.randn(n) * 3).to(out_dtype)
    w = cutlass_gemm.prepare_weight(qw, "sm90a")
    y = cutlass_gemm.prefill_gemm(qx.codes, qx.scales, qx.mbs, k, w, bias, out_dtype)
    ref = qx.dequantize().double() @ qw.dequantize().double().T + bias.double()
    assert y.dtype == out_dtype
    # one rounding to out_dtype (half an ulp: <= 2^-8 |y| bf16, 2^-11 fp16, 2^-24 fp32) plus the
    # fp32 work (fp32(1/F) per side, accumulation) against sum |x_hat| |w_hat|; bf16
    # rounding of an fp16 / fp32 result would break the tighter bounds.
    half_ulp = {torch.bfloat16: 2.0**-8, torch.float16: 2.0**-11, torch.float32: 2.0**-24}
    mag = qx.dequantize().double().abs() @ qw.dequantize().double().abs().T + bias.double().abs()
    bound = half_ulp[out_dtype] * ref.abs() + 2.0**-20 * mag
    assert ((y.double() - ref).abs() <= bound).all()


def test_fake_impls_give_shapes():
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():
        a = torch.empty(10, 256, dtype=torch.float8_e4m3fn)
        b = torch.empty(24, 256, dtype=torch.float8_e4m3fn)
        y = torch.ops.vllm_mxplus.cutlass_fp8_chunk_gemm(
            a, torch.empty(2, 10), b, torch.empty(2, 24), None, torch.bfloat16
        )
        z = torch.ops.vllm_mxplus.cutlass_fp4_mbs_gemm(
            torch.empty(10, 128, dtype=torch.uint8),
            torch.empty(1, dtype=torch.uint8),
            torch.empty(24, 128, dtype=torch.uint8),
            torch.empty(1, dtype=torch.uint8),
            torch.empty(2, 10),
            torch.empty(2, 24),
            None,
            True,
            torch.float16,
        )
    assert y.shape == (10, 24) and y.dtype == torch.bfloat16
    assert z.shape == (10, 24) and z.dtype == torch.float16


def test_backend_reports_why_unavailable_on_cpu():
    ok, why = CutlassPrefillBackend.is_supported("cpu", None)
    assert not ok and why
    if not torch.cuda.is_available():
        ok, why = cutlass_ext.is_available()
        assert not ok and "CUDA" in why


@pytest.mark.parametrize(
    "scheme,ok",
    [("mxfp4-mbs", True), ("mxfp4-mbs-s", True), ("mxfp4-ocp", False), ("nvfp4", False)],
)
def test_backend_scheme_support(scheme, ok):
    assert scheme_supported(scheme) == ok


# ----------------------------------------------------------------------------- GPU
GPU_SHAPES = [(1, 256, 128), (33, 4096, 576), (100, 1024, 4096), (4096, 4096, 4096)]


@pytest.fixture(scope="module")
def kernel_arch() -> str:
    """The arch of the built extension. scripts/gpu_check.sh sets MXPLUS_REQUIRE_CUTLASS=1
    after building it: a missing or broken extension then fails these tests, never skips."""
    ok, why = cutlass_ext.is_available()
    if not ok:
        if os.environ.get("MXPLUS_REQUIRE_CUTLASS") == "1":
            pytest.fail(f"CUTLASS prefill kernel required but unavailable: {why}")
        pytest.skip(f"CUTLASS prefill kernel unavailable: {why}")
    return cutlass_ext.arch_of()


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
    w = cutlass_gemm.prepare_weight(qw, kernel_arch)
    y = cutlass_gemm.prefill_gemm(qx.codes, qx.scales, qx.mbs, k, w, bias, torch.bfloat16)
    ref = qx.dequantize().double() @ qw.dequantize().double().T
    if bias is not None:
        ref = ref + bias.double()
    assert qsnr(ref, y.double()) >= 45.0


@pytest.mark.gpu
def test_gpu_out_of_span_rows_fall_back(kernel_arch):
    m, n, k = 64, 256, 1024
    qx, qw = (
        quantize(_data(m, k, 3).cuda(), "mxfp4-mbs-s"),
        quantize(_data(n, k, 4).cuda(), "mxfp4-mbs-d"),
    )
    w = cutlass_gemm.prepare_weight(qw, kernel_arch)
    y = cutlass_gemm.prefill_gemm(qx.codes, qx.scales, qx.mbs, k, w, None, torch.bfloat16)
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
    w = cutlass_gemm.prepare_weight(qw, "sm100a")
    y_plain = cutlass_gemm.prefill_gemm(qx.codes, qx.scales, None, k, w, None)
    assert not w.use_mbs  # no MBS on either side: one full-K launch
    w_mbs = cutlass_gemm.prepare_weight(qw, "sm100a", activation_mbs=True)
    sig_x = cutlass_ops.sigma_chunks(None, m, k, qx.codes.device)
    y_mbs = cutlass_ops.fp4_mbs_gemm(
        qx.codes,
        cutlass_ops.pack_scales_sm100(qx.scales, k),
        w_mbs.codes,
        w_mbs.sf,
        sig_x,
        w_mbs.sigma(),
        None,
        True,
        torch.bfloat16,
    )
    assert qsnr(y_plain.double(), y_mbs.double()) >= 45.0


@pytest.mark.gpu
@pytest.mark.parametrize(
    "out_dtype", [torch.bfloat16, torch.float16, torch.float32], ids=["bf16", "fp16", "fp32"]
)
def test_gpu_prefill_output_dtype(kernel_arch, out_dtype):
    """The kernels produce the model's dtype (no bf16 detour for fp16 / fp32 models)."""
    m, n, k = 64, 256, 1024
    g = torch.Generator().manual_seed(8)
    qx = quantize(torch.randn(m, k, generator=g).cuda(), "mxfp4-mbs-s")
    qw = quantize(torch.randn(n, k, generator=g).cuda(), "mxfp4-mbs-d")
    bias = (torch.randn(n, generator=g) * 3).to(out_dtype).cuda()
    w = cutlass_gemm.prepare_weight(qw, kernel_arch)
    y = cutlass_gemm.prefill_gemm(qx.codes, qx.scales, qx.mbs, k, w, bias, out_dtype)
    ref = qx.dequantize().double() @ qw.dequantize().double().T + bias.double()
    mag = qx.dequantize().double().abs() @ qw.dequantize().double().abs().T + bias.double().abs()
    half_ulp = {torch.bfloat16: 2.0**-8, torch.float16: 2.0**-11, torch.float32: 2.0**-24}
    assert y.dtype == out_dtype
    err = (y.double() - ref).abs() - half_ulp[out_dtype] * ref.abs()
    assert (err <= 2.0**-18 * mag).all(), f"max excess {err.max().item():.3g}"


@pytest.mark.gpu
def test_gpu_prefill_in_cuda_graph(kernel_arch):
    """The whole prefill (activation encoding, GEMM, the sm_90a fallback with out-of-span
    rows) is captured in a CUDA graph and replays to the eager numbers on new data."""
    from vllm_mxplus.backends.cutlass.gemm import prefill_gemm_from_x

    m, n, k = 48, 256, 1024
    qw = quantize(torch.randn(n, k, device="cuda"), "mxfp4-mbs-d")
    w = cutlass_gemm.prepare_weight(qw, kernel_arch)
    x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
    prefill_gemm_from_x(x, "mxfp4-mbs-s", w, None)  # warm-up (Triton compile, allocator)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        y = prefill_gemm_from_x(x, "mxfp4-mbs-s", w, None)
    fresh = _data(m, k, 9).to(torch.bfloat16).cuda()  # rows out of the FP8 span
    x.copy_(fresh)
    graph.replay()
    torch.cuda.synchronize()
    want = prefill_gemm_from_x(fresh, "mxfp4-mbs-s", w, None)
    assert torch.equal(y.view(torch.int16), want.view(torch.int16))


@pytest.mark.usefixtures("emulated_sm90")
def test_prefill_op_passes_opcheck():
    """The sm_90a prefill op (emulated GEMM) meets torch.library's schema / fake checks."""
    m, n, k = 9, 16, 256
    qx, qw = quantize(_data(m, k, 5), "mxfp4-mbs-s"), quantize(_data(n, k, 6), "mxfp4-mbs-d")
    w = cutlass_gemm.prepare_weight(qw, "sm90a")
    args = (
        qx.codes,
        qx.scales,
        qx.mbs,
        k,
        *w.sm90_operands(),
        None,
        w.n,
        torch.bfloat16,
    )
    torch.library.opcheck(
        torch.ops.vllm_mxplus.cutlass_prefill_sm90.default, args, test_utils=("test_faketensor",)
    )  # test_schema: no fp8 compare on CPU
