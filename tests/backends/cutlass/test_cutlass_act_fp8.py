"""Fused sm_90a activation re-encoding (triton_act_fp8) vs. the two-step torch path.

Every field of the FP8 per-(row, chunk) layout must be bit-identical to
`encode_fp8_chunks(q.codes, q.scales, q.mbs, K)` with q = `formats.quantize(x, fmt)` (what the
Triton act-quant followed by the torch re-encoder produces): the FP8 bytes, the fp32 folded
scales (as int32 bits), ref, the MBS bytes and the exact flags. Then the prefill path that
uses it (`prefill_gemm_from_x`, the backend's `apply`) must give the same bf16 output as the
two-step path, fallback rows included (GEMM emulated on CPU).

Runs on CPU under TRITON_INTERPRET=1 (tests/backends/conftest.py) or on CUDA when compiled.
"""

from __future__ import annotations

import itertools
import os
import types

import pytest
import torch
from cutlass_helpers import assert_same_bits, emulated_sm90  # noqa: F401  (fixture for usefixtures; tests/backends/cutlass on sys.path)
from graph_helpers import replay_with

from vllm_mxplus.backends.base import LinearSpec
from vllm_mxplus.backends.cutlass import build as cutlass_ext
from vllm_mxplus.backends.cutlass import fp8_chunks as fc
from vllm_mxplus.backends.cutlass import gemm as cutlass_gemm
from vllm_mxplus.backends.cutlass.act_fp8 import (
    SUPPORTED_FORMATS,
    act_fp8_and_packed_op,
    act_quant_fp8_chunks,
    act_quant_fp8_chunks_op,
)
from vllm_mxplus.backends.cutlass.linear import CutlassPrefillBackend
from vllm_mxplus.formats import quantize

FORMATS = SUPPORTED_FORMATS  # mxfp4-mbs-s, mxfp4-16-oas, mxfp4-16
MS = (1, 33, 100)
KS = (100, 576, 1536, 4096)
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
FIELDS = ("fp8", "scale", "ref", "mbs", "exact")


def reference_layout(x: torch.Tensor, fmt: str) -> fc.Fp8ChunkLayout:
    """The two-step path: quantize (= the Triton act-quant, bit for bit), then torch encode."""
    x2 = x.reshape(-1, x.shape[-1])
    q = quantize(x2, fmt)
    return fc.encode_fp8_chunks(q.codes, q.scales, q.mbs, x.shape[-1])


def assert_same_layout(got: fc.Fp8ChunkLayout, want: fc.Fp8ChunkLayout) -> None:
    assert got.k == want.k
    for name in FIELDS:
        assert_same_bits(name, getattr(got, name), getattr(want, name))


def check_bit_exact(x: torch.Tensor, fmt: str, packed: bool = True) -> fc.Fp8ChunkLayout:
    """The kernel's layout against the two-step path, bit for bit; with `packed` (the launch
    the prefill makes) also its codes and E8M0 scales against formats.quantize's."""
    want = reference_layout(x, fmt)
    if not packed:
        assert_same_layout(act_quant_fp8_chunks(x, fmt, 128), want)
        return want
    got, codes, scales = act_fp8_and_packed_op(x, fmt, 128)
    assert_same_layout(got, want)
    q = quantize(x.reshape(-1, x.shape[-1]), fmt)
    assert_same_bits("codes", codes, q.codes)
    assert_same_bits("scales", scales, q.scales)
    if q.mbs is not None:
        assert_same_bits("mbs", got.mbs, q.mbs)
    return want


def activations(m: int, k: int, dtype: torch.dtype, device, seed: int = 0) -> torch.Tensor:
    """Gaussian rows with per-row and per-16-block magnitudes over many binades (so that some
    chunks span more than 14 binades and are inexact), a share of values on a coarse grid
    (E2M1 ties, 1.5 / 1.75 mantissa edges), a few outliers and some -0.0."""
    gen = torch.Generator().manual_seed(seed)
    nb = -(-k // 16)
    x = torch.randn(m, k, generator=gen)
    x *= torch.exp2(torch.randint(-10, 6, (m, 1), generator=gen).float())
    spread = torch.randint(0, 3, (m, 1), generator=gen) * 12  # 0, 12 or 24 binades per row
    blk = (torch.rand(m, nb, generator=gen) * (spread + 1)).floor() - spread // 2
    x *= torch.exp2(blk).repeat_interleave(16, -1)[:, :k]
    grid = torch.randint(-63, 64, (m, k), generator=gen) / 8.0
    grid = (
        grid
        * torch.exp2(torch.randint(-4, 4, (m, nb), generator=gen).float()).repeat_interleave(
            16, -1
        )[:, :k]
    )
    x = torch.where(torch.rand(m, k, generator=gen) < 0.3, grid, x)
    x = torch.where(torch.rand(m, k, generator=gen) < 0.002, x * 50.0, x)
    x = torch.where(torch.rand(m, k, generator=gen) < 0.01, torch.full_like(x, -0.0), x)
    if dtype == torch.float16:
        x = x.clamp(-60000.0, 60000.0)
    return x.to(dtype).to(device)


CASES = list(itertools.product(FORMATS, MS, KS, DTYPES))


@pytest.mark.parametrize("fmt,m,k,dtype", CASES, ids=[f"{f}-M{m}-K{k}-{d}" for f, m, k, d in CASES])
def test_bit_exact_random(fmt, m, k, dtype, triton_device):
    check_bit_exact(activations(m, k, DTYPES[dtype], triton_device, seed=m * k + 1), fmt)


def test_random_data_hits_both_kinds_of_chunk():
    """The random cases above exercise exact and inexact chunks (else they prove less)."""
    want = reference_layout(
        activations(100, 1536, torch.bfloat16, "cpu", seed=100 * 1536 + 1), "mxfp4-mbs-s"
    )
    assert want.exact.any() and (~want.exact).any()
    assert (want.mbs != 0).any()


def special_rows(dtype: torch.dtype, k: int = 576) -> torch.Tensor:
    """Zeros, NaN, +-Inf, -0.0, subnormals of the input dtype, a > 14-binade chunk, the
    dtype's maximum, tiny rows (ref < 2), a NaN crossing a chunk boundary, a zero tail."""
    x = torch.randn(16, k, generator=torch.Generator().manual_seed(8))
    info = torch.finfo(dtype)
    x[0] = 0.0
    x[1] = float("nan")
    x[2, 17] = float("nan")  # one NaN block (and its macro block / chunk)
    x[3, 300] = float("inf")
    x[3, 301] = -float("inf")
    x[4] = -0.0
    x[4, ::7] = 0.0
    x[5] = x[5] * info.tiny * 2.0**-3  # subnormals of the input dtype
    x[6, :16] = 5.0  # chunk 0: block exponents 20 binades apart -> exact False
    x[6, 16:32] = 5.0 * 2.0**-20
    x[6, 128:144] = 5.0  # chunk 1: 14 binades apart -> still exact
    x[6, 144:160] = 5.0 * 2.0**-14
    x[7, :] = info.max  # x * F overflows (MBS) / top E8M0 exponents
    x[7, 1::2] = -info.max
    x[8] = x[8] * info.tiny  # smallest normals: ref < MIN_EXACT_REF
    x[9, 100:200] = float("nan")  # crosses a chunk boundary
    x[10, k - 20 :] = 0.0  # zero tail in the partial chunk
    x[11] = torch.linspace(-6.0, 6.0, k)  # many E2M1 ties
    x[12, :16] = 1.75 * 2.0**3  # OAS / floor edges
    x[12, 16:32] = 1.5 * 2.0**-5
    x[12, 32:48] = 1.75 + 2.0**-7
    x[13] = x[13] * 2.0**-20  # mid-range, all exact
    x[14, ::3] = -0.0
    x[15] = x[15] * info.max * 2.0**-4  # large but finite
    return x.to(dtype)


@pytest.mark.filterwarnings("ignore:overflow encountered:RuntimeWarning")
@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("dtype", list(DTYPES), ids=list(DTYPES))
def test_special_rows(fmt, dtype, triton_device):
    check_bit_exact(special_rows(DTYPES[dtype]).to(triton_device), fmt, packed=False)
    want = check_bit_exact(special_rows(DTYPES[dtype]).to(triton_device), fmt)
    ex = want.exact.cpu()
    assert bool(ex[0].all()) and not bool(ex[1].any()) and not bool(ex[2, 0])
    assert not bool(ex[6, 0]) and bool(ex[6, 1])  # > 14 binades inexact, 14 exact
    assert bool(ex[13].all())


@pytest.mark.filterwarnings("ignore:overflow encountered:RuntimeWarning")
@pytest.mark.parametrize("fmt", FORMATS)
def test_fp32_extremes(fmt, triton_device):
    """fp32-only magnitudes: deep subnormals, 2^127-range values, a row straddling 2^-126,
    and a chunk whose only lost elements are E2M1 0.5 codes that underflow to 0 in fp32
    (value 0.5 * 2^-149): FP8 0 equals fp32 0 there, so only the underflow rule flags it."""
    x = activations(6, 256, torch.float32, "cpu", seed=3)
    x[0] = x[0] * 2.0**-140
    x[1, :64] = 3.0e38
    x[1, 64:] = x[1, 64:] * 2.0**100
    x[2] = 2.0**-126 * torch.linspace(-1.0, 1.0, 256)
    x[3, 5] = 2.0**-149
    x[4, ::2] = -0.0
    x[5] = 1.0
    x[5, :16] = 2.0**-128  # E8M0 code 0, every E2M1 code 1 (0.5)
    x[5, 16:128] = 2.0**40  # E8M0 code 167: d = 0 - 161 -> clamped to -149
    want = check_bit_exact(x.to(triton_device), fmt)
    assert not bool(want.exact[5, 0]) and bool(want.exact[5, 1])


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("k", [1, 15, 17, 129, 257], ids=lambda k: f"K{k}")
def test_odd_and_tiny_k(fmt, k, triton_device):
    """Partial blocks, partial chunks (K % 128 != 0): padding columns must be +0 bytes."""
    check_bit_exact(activations(3, k, torch.bfloat16, triton_device, seed=k), fmt)


def test_leading_dims_and_non_contiguous_rows(triton_device):
    x = activations(6, 200, torch.float32, triton_device, seed=11).reshape(2, 3, 200)
    got = act_quant_fp8_chunks(x, "mxfp4-mbs-s", 128)
    assert got.fp8.shape == (6, 256) and got.scale.shape == (2, 6)
    assert_same_layout(got, reference_layout(x, "mxfp4-mbs-s"))
    base = activations(5, 640, torch.bfloat16, triton_device, seed=5)
    xs = base[:, 64:640]  # row stride 640 > K = 576
    assert not xs.is_contiguous()
    check_bit_exact(xs, "mxfp4-mbs-s")


def test_empty_rows(triton_device):
    lay = act_quant_fp8_chunks(torch.zeros(0, 300, device=triton_device), "mxfp4-mbs-s", 128)
    assert lay.fp8.shape == (0, 384) and lay.scale.shape == (3, 0) and lay.exact.shape == (0, 3)


def test_rejects_bad_input(triton_device):
    """Beyond the checks shared with act_quant (test_triton_act_quant.py): the formats and
    the macro block of the FP8 layout."""
    x = torch.zeros(2, 32, device=triton_device)
    for fmt in ("mxfp4-ocp", "mxfp4-mbs-d"):
        with pytest.raises(ValueError, match="no fused kernel"):
            act_quant_fp8_chunks(x, fmt, 128)
    with pytest.raises(ValueError, match="macro_block"):
        act_quant_fp8_chunks(x, "mxfp4-mbs-s", macro_block=256)


def test_custom_op_matches_and_traces(triton_device):
    """The custom op returns the launcher's fields, passes opcheck's fake-tensor check, and
    traces under torch.compile (fullgraph, through the fake implementation)."""
    x = activations(3, 160, torch.bfloat16, triton_device, seed=2)
    for fmt in FORMATS:
        assert_same_layout(act_quant_fp8_chunks_op(x, fmt, 128), act_quant_fp8_chunks(x, fmt, 128))
        torch.library.opcheck(
            torch.ops.vllm_mxplus.triton_act_fp8_chunks.default,
            (x, fmt, 128),
            test_utils=("test_faketensor",),
        )

    def fn(t):
        lay = act_quant_fp8_chunks_op(t, "mxfp4-mbs-s", 128)
        return lay.fp8, lay.scale, lay.ref, lay.mbs, lay.exact

    compiled = torch.compile(fn, backend="aot_eager", fullgraph=True)
    want = act_quant_fp8_chunks(x, "mxfp4-mbs-s", 128)
    for name, g in zip(FIELDS, compiled(x)):
        assert_same_bits(f"compiled {name}", g, getattr(want, name))


# ----------------------------------------------------------------------------- prefill wiring


@pytest.mark.usefixtures("emulated_sm90")
@pytest.mark.parametrize("with_bias", [False, True], ids=["nobias", "bias"])
@pytest.mark.parametrize(
    "fmt,dtype",
    [("mxfp4-mbs-s", torch.bfloat16), ("mxfp4-16-oas", torch.float16)],
    ids=["mbs-s-bf16", "oas-fp16"],
)
def test_prefill_from_x_equals_two_step_path(fmt, dtype, with_bias, triton_device):
    """prefill_gemm_from_x (fused encoder, fallback from the Triton act-quant's codes) gives
    the same bf16 output, bit for bit, as formats' quantize + prefill_gemm (torch encoder,
    fallback from those codes), with out-of-span activation rows and weight rows both
    present."""
    m, n, k = 40, 24, 576
    x = activations(m, k, dtype, triton_device, seed=21)
    x[3, 40] = float("nan")  # a NaN row takes the fallback too
    x[5, 130:146] *= 2.0**-20  # and rows with a chunk spanning > 14 binades
    x[17, 500:516] *= 2.0**-18
    g = torch.Generator().manual_seed(22)
    e = torch.randint(-12, 12, (n, k // 16), generator=g).repeat_interleave(16, -1)
    qw = quantize(
        (torch.randn(n, k, generator=g) * torch.exp2(e.float())).to(triton_device), "mxfp4-mbs-d"
    )
    w = cutlass_gemm.prepare_weight(qw, "sm90a")
    bias = torch.randn(n, generator=g).to(torch.bfloat16).to(triton_device) if with_bias else None
    xl = act_quant_fp8_chunks(x, fmt, 128)
    assert (~xl.exact_rows).sum() >= 2 and w.fallback_idx.numel() > 0, "must hit fallbacks"

    y = cutlass_gemm.prefill_gemm_from_x(x, fmt, w, bias, torch.bfloat16)
    q = quantize(x, fmt)
    want = cutlass_gemm.prefill_gemm(q.codes, q.scales, q.mbs, k, w, bias, torch.bfloat16)
    assert y.shape == (m, n) and y.dtype == torch.bfloat16
    assert torch.equal(y.view(torch.int16), want.view(torch.int16))
    assert torch.isnan(y[3]).all() and not torch.isnan(y[torch.arange(m) != 3]).any()


@pytest.mark.usefixtures("emulated_sm90")
def test_backend_apply_uses_fused_path(monkeypatch, triton_device):
    """CutlassPrefillBackend.apply on sm_90a: leading dims, out_dtype; the fused encoder runs
    (the torch encoder is never called for activations)."""
    n, k = 16, 256
    spec = LinearSpec(scheme="mxfp4-mbs", n=n, k=k, out_dtype=torch.float16)
    qw = quantize(torch.randn(n, k).to(triton_device), spec.weight_format)
    layer = types.SimpleNamespace()
    setattr(layer, CutlassPrefillBackend.WEIGHT_ATTR, cutlass_gemm.prepare_weight(qw, "sm90a"))
    x = activations(2 * 9, k, torch.bfloat16, triton_device, seed=4).reshape(2, 9, k)
    q = quantize(x.reshape(-1, k), spec.activation_format)
    want = cutlass_gemm.prefill_gemm(
        q.codes, q.scales, q.mbs, k, layer.mxplus_cutlass_weight, None, torch.float16
    )

    def no_torch_encoder(*args, **kwargs):
        raise AssertionError("activations went through encode_fp8_chunks")

    monkeypatch.setattr(cutlass_gemm, "encode_fp8_chunks", no_torch_encoder)
    y = CutlassPrefillBackend(spec).apply(layer, x, None)
    assert y.shape == (2, 9, n) and y.dtype == torch.float16
    assert torch.equal(y.reshape(-1, n).view(torch.int16), want.view(torch.int16))


@pytest.mark.usefixtures("emulated_sm90")
def test_prefill_from_x_traces_and_passes_opcheck(triton_device):
    """torch.compile (fullgraph) traces prefill_gemm_from_x through both custom ops' fakes and
    gives the eager numbers; the fused prefill op passes opcheck's fake-tensor check."""
    qw = quantize(torch.randn(16, 256).to(triton_device), "mxfp4-mbs-d")
    w = cutlass_gemm.prepare_weight(qw, "sm90a")
    x = activations(20, 256, torch.bfloat16, triton_device, seed=3)
    compiled = torch.compile(
        lambda t: cutlass_gemm.prefill_gemm_from_x(t, "mxfp4-mbs-s", w, None),
        backend="aot_eager",
        fullgraph=True,
    )
    want = cutlass_gemm.prefill_gemm_from_x(x, "mxfp4-mbs-s", w, None)
    assert torch.equal(compiled(x).view(torch.int16), want.view(torch.int16))
    xl, codes, scales = act_fp8_and_packed_op(x, "mxfp4-mbs-s", 128)
    args = (
        x,
        "mxfp4-mbs-s",
        *xl.fields(),
        codes,
        scales,
        *w.sm90_operands(),
        None,
        w.n,
        torch.bfloat16,
    )
    torch.library.opcheck(
        torch.ops.vllm_mxplus.cutlass_prefill_sm90_fused.default,
        args,
        test_utils=("test_faketensor",),
    )


def test_fused_prefill_op_fake():
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():
        x = torch.empty(10, 300, dtype=torch.bfloat16)
        fp8, scale, ref, mbs, exact, codes, scales = (
            torch.ops.vllm_mxplus.triton_act_fp8_chunks_packed(x, "mxfp4-mbs-s", 128)
        )
        y = torch.ops.vllm_mxplus.cutlass_prefill_sm90_fused(
            x,
            "mxfp4-mbs-s",
            fp8,
            scale,
            ref,
            mbs,
            exact,
            codes,
            scales,
            torch.empty(20, 150, dtype=torch.uint8),
            torch.empty(20, 19, dtype=torch.uint8),
            torch.empty(20, 3, dtype=torch.uint8),
            torch.empty(0, dtype=torch.int64),
            torch.empty(0, dtype=torch.int64),  # the packed-weight GEMM's fallback rows
            None,  # no held FP8 weight
            None,
            None,
            20,
            torch.bfloat16,
        )
    assert fp8.shape == (10, 384) and fp8.dtype == torch.float8_e4m3fn
    assert scale.shape == (3, 10) and ref.dtype == torch.int32 and exact.dtype == torch.bool
    assert codes.shape == (10, 150) and scales.shape == (10, 19)
    assert y.shape == (10, 20) and y.dtype == torch.bfloat16


# ----------------------------------------------------------------------------- GPU
GPU_SIZES = [(1, 4096), (16, 14336), (8192, 4096), (4093, 5120 + 64)]


@pytest.mark.gpu
@pytest.mark.filterwarnings("ignore:overflow encountered:RuntimeWarning")
@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("dtype", list(DTYPES), ids=list(DTYPES))
def test_gpu_bit_exact(fmt, dtype, cuda_device):
    """Compiled kernel vs the torch two-step path on CUDA: the random shapes of the CPU test,
    real model sizes, and the special rows."""
    dt = DTYPES[dtype]
    for m, k in list(itertools.product(MS, KS)) + GPU_SIZES:
        x = activations(m, k, dt, cuda_device, seed=m * k + 1)
        x[0] = float("nan")
        if m > 2:
            x[1] = 0.0
        check_bit_exact(x, fmt)
    check_bit_exact(special_rows(dt).to(cuda_device), fmt)
    check_bit_exact(special_rows(dt, k=4096 + 16).to(cuda_device), fmt)


@pytest.mark.gpu
def test_gpu_cuda_graph_capture(cuda_device):
    x = activations(16, 4096, torch.bfloat16, cuda_device)
    fresh = activations(16, 4096, torch.bfloat16, cuda_device, seed=9)
    out = replay_with(lambda t: act_quant_fp8_chunks_op(t, "mxfp4-mbs-s", 128), x, fresh)
    assert_same_layout(out, reference_layout(x, "mxfp4-mbs-s"))


@pytest.mark.gpu
def test_gpu_prefill_from_x_equals_two_step(cuda_device):
    """With the CUTLASS sm_90a kernel: the fused path gives the two-step path's output."""
    ok, why = cutlass_ext.is_available()
    if not ok and os.environ.get("MXPLUS_REQUIRE_CUTLASS") == "1":  # scripts/gpu_check.sh
        pytest.fail(f"CUTLASS prefill kernel required but unavailable: {why}")
    if not ok or cutlass_ext.arch_of() != "sm90a":
        pytest.skip(f"needs the sm_90a CUTLASS kernel ({why or cutlass_ext.arch_of()})")
    m, n, k = 256, 512, 4096
    x = activations(m, k, torch.bfloat16, cuda_device, seed=31)
    qw = quantize(torch.randn(n, k, device=cuda_device), "mxfp4-mbs-d")
    w = cutlass_gemm.prepare_weight(qw, "sm90a")
    y = cutlass_gemm.prefill_gemm_from_x(x, "mxfp4-mbs-s", w, None)
    q = quantize(x, "mxfp4-mbs-s")
    want = cutlass_gemm.prefill_gemm(q.codes, q.scales, q.mbs, k, w, None)
    assert torch.equal(y.view(torch.int16), want.view(torch.int16))
