"""Triton activation quantizer vs. `formats.quantize`: codes, scales, MBS bytes and the nvfp4
global scale must be bit-exact (atol = rtol = 0), for every listed shape, dtype and the
special values (zeros, NaN, Inf, -0.0, subnormals, near-overflow, E2M1 ties, OAS edges).

Runs on CPU under TRITON_INTERPRET=1 (tests/backends/conftest.py) or on CUDA when compiled.
"""

from __future__ import annotations

import functools
import itertools

import pytest
import torch
from graph_helpers import replay_with

from vllm_mxplus.backends.cutlass.act_fp8 import act_quant_fp8_chunks
from vllm_mxplus.backends.triton import act_quant as aq
from vllm_mxplus.backends.triton.act_quant import act_quant
from vllm_mxplus.backends.triton.launch import capture_launches
from vllm_mxplus.formats import quantize

FORMATS = ("mxfp4-mbs-s", "mxfp4-16-oas", "mxfp4-ocp", "nvfp4")
MS = (1, 33, 100)
KS = (100, 576, 1536, 4096)
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}


def assert_same_bits(name: str, got: torch.Tensor, want: torch.Tensor) -> None:
    """Bitwise equality; names the first mismatching coordinates (DeepGEMM style)."""
    assert got.shape == want.shape, f"{name}: shape {tuple(got.shape)} != {tuple(want.shape)}"
    assert got.dtype == want.dtype, f"{name}: dtype {got.dtype} != {want.dtype}"
    g, w = got.cpu(), want.cpu()
    if g.dtype in (torch.float8_e4m3fn, torch.float32):
        g = g.view(torch.uint8 if g.dtype == torch.float8_e4m3fn else torch.int32)
        w = w.view(g.dtype)
    bad = (g != w).nonzero()
    assert bad.numel() == 0, (
        f"{name}: {bad.shape[0]} mismatches, first at {tuple(bad[0].tolist())}: "
        f"got {g[tuple(bad[0])].item()} want {w[tuple(bad[0])].item()}"
    )


def check_bit_exact(x: torch.Tensor, fmt: str, macro_block: int = 128) -> None:
    codes, scales, mbs, gs = act_quant(x, fmt, macro_block=macro_block)
    ref = quantize(x, fmt, macro_block=macro_block, per_row=fmt == "nvfp4")
    assert_same_bits("codes", codes, ref.codes)
    assert_same_bits("scales", scales, ref.scales)
    assert (mbs is None) == (ref.mbs is None)
    if mbs is not None:
        assert_same_bits("mbs", mbs, ref.mbs)
    assert (gs is None) == (ref.global_scale is None)
    if gs is not None:
        assert_same_bits("global_scale", gs, ref.global_scale)


def activations(m: int, k: int, dtype: torch.dtype, device, seed: int = 0) -> torch.Tensor:
    """Gaussian rows spread over many binades, a few outliers per row, and a share of values
    on a coarse grid (j/8 * 2^e) that hits E2M1 ties and the 1.5 / 1.75 mantissa edges."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(m, k, generator=gen)
    x *= torch.exp2(torch.randint(-12, 6, (m, 1), generator=gen).float())
    x *= torch.exp2(torch.randint(-3, 4, (m, k), generator=gen).float())  # spread inside rows
    grid = torch.randint(-63, 64, (m, k), generator=gen) / 8.0
    grid = (
        grid
        * torch.exp2(
            torch.randint(-4, 4, (m, k // 16 + 1), generator=gen).float()
        ).repeat_interleave(16, -1)[:, :k]
    )
    use_grid = torch.rand(m, k, generator=gen) < 0.3
    x = torch.where(use_grid, grid, x)
    outliers = torch.rand(m, k, generator=gen) < 0.002
    x = torch.where(outliers, x * 50.0, x)
    if dtype == torch.float16:
        x = x.clamp(-60000.0, 60000.0)
    return x.to(dtype).to(device)


# Every (M, K, dtype) for the MBS format; the baselines on a covering subsample, to keep the
# interpreter's runtime modest (each listed M, K and dtype still appears for every format).
_FULL = list(itertools.product(MS, KS, DTYPES))
_SUB = [(m, k, d) for i, (m, k, d) in enumerate(_FULL) if i % 3 == 0 or (m, k) == (33, 576)]
CASES = [("mxfp4-mbs-s", *c) for c in _FULL] + [(f, *c) for f in FORMATS[1:] for c in _SUB]


def _covers_all() -> bool:
    return all(
        {c[1] for c in CASES if c[0] == f} == set(MS)
        and {c[2] for c in CASES if c[0] == f} == set(KS)
        and {c[3] for c in CASES if c[0] == f} == set(DTYPES)
        for f in FORMATS
    )


assert _covers_all(), "subsampling dropped a listed M, K or dtype for some format"


@pytest.mark.parametrize("fmt,m,k,dtype", CASES, ids=[f"{f}-M{m}-K{k}-{d}" for f, m, k, d in CASES])
def test_bit_exact_random(fmt, m, k, dtype, triton_device):
    check_bit_exact(activations(m, k, DTYPES[dtype], triton_device, seed=m * k), fmt)


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("dtype", list(DTYPES), ids=list(DTYPES))
def test_special_rows(fmt, dtype, triton_device):
    """Zero rows, NaN rows, a NaN / Inf inside one block, -0.0, and a row of tiny values."""
    dt = DTYPES[dtype]
    x = activations(8, 576, dt, "cpu", seed=7).float()
    x[0] = 0.0
    x[1] = float("nan")
    x[2, 17] = float("nan")  # one NaN block (and its macro block)
    x[3, 300] = float("inf")
    x[3, 301] = -float("inf")
    x[4] = -0.0
    x[4, ::7] = 0.0
    x[5] = x[5] * 2.0**-10  # small (subnormal in fp16)
    x[6, :130] = float("nan")  # crosses a macro-block boundary
    x[7, 560:] = 0.0  # zero tail in the partial macro block
    check_bit_exact(x.to(dt).to(triton_device), fmt)


# Overflow of 6/a (subnormal macro absmax) and of x * F (bf16 max) is what the spec computes.
@pytest.mark.filterwarnings("ignore:overflow encountered:RuntimeWarning")
@pytest.mark.parametrize("fmt", FORMATS)
def test_extreme_magnitudes_bf16(fmt, triton_device):
    """bf16 subnormals (fp32 subnormal after conversion), the bf16 maximum (x * F overflows
    to Inf under MBS), and blocks whose absmax sits exactly on 1.5 * 2^k and 1.75 * 2^k."""
    x = activations(6, 256, torch.bfloat16, "cpu", seed=3).float()
    x[0] = x[0] * 2.0**-130  # bf16/fp32 subnormals
    x[1, :64] = torch.tensor(3.3895e38)  # bf16 max: MBS's fp32(x * F) overflows
    x[1, 64:] = x[1, 64:] * 2.0**100
    x[2, :16] = 1.75 * 2.0**3
    x[2, 16:32] = 1.5 * 2.0**-5
    x[2, 32:48] = torch.tensor([1.75 + 2.0**-7] * 16)  # just above the OAS edge
    x[3] = torch.linspace(-6.0, 6.0, 256)  # many exact E2M1 ties after scaling
    x[4] = 2.0**-126 * torch.linspace(-1.0, 1.0, 256)  # straddles the fp32 normal limit
    x[5, ::2] = -0.0
    check_bit_exact(x.to(torch.bfloat16).to(triton_device), fmt)


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("k", [1, 15, 17, 33, 129, 257], ids=lambda k: f"K{k}")
def test_odd_and_tiny_k(fmt, k, triton_device):
    """Partial blocks (K % 16 != 0), partial macro blocks, odd K (half-filled last byte)."""
    check_bit_exact(activations(3, k, torch.bfloat16, triton_device, seed=k), fmt)


def test_fp32_input_and_leading_dims(triton_device):
    x = activations(6, 200, torch.float32, "cpu", seed=11).reshape(2, 3, 200)
    x[0, 1, 5] = 2.0**-140  # fp32-only subnormal
    x = x.to(triton_device)
    for fmt in FORMATS:
        codes, scales, mbs, gs = act_quant(x, fmt, macro_block=128)
        ref = quantize(x, fmt, per_row=fmt == "nvfp4")
        assert codes.shape == (2, 3, 100)
        assert_same_bits("codes", codes, ref.codes)
        assert_same_bits("scales", scales, ref.scales)
        if mbs is not None:
            assert_same_bits("mbs", mbs, ref.mbs)
        if gs is not None:
            assert_same_bits("global_scale", gs, ref.global_scale)


def test_non_contiguous_rows(triton_device):
    """A row stride larger than K (a slice of a wider buffer) is read in place."""
    base = activations(5, 640, torch.bfloat16, triton_device, seed=5)
    x = base[:, 64:640]
    assert not x.is_contiguous()
    check_bit_exact(x, "mxfp4-mbs-s")


@pytest.mark.parametrize(
    "quantize,no_kernel",
    [(act_quant, "no Triton kernel"), (act_quant_fp8_chunks, "no fused kernel")],
    ids=["act_quant", "act_quant_fp8_chunks"],
)
def test_rejects_bad_input(triton_device, quantize, no_kernel):
    """The input checks both fused quantizers share (triton_act_quant.check_act_input)."""
    x = torch.zeros(2, 32, device=triton_device)
    quantize = functools.partial(quantize, macro_block=128)
    with pytest.raises(ValueError, match=no_kernel):
        quantize(x, "mxplus")
    with pytest.raises(ValueError, match="unsupported dtype"):
        quantize(x.to(torch.int32), "mxfp4-mbs-s")
    with pytest.raises(ValueError, match="empty last dim"):
        quantize(torch.zeros(2, 0, device=triton_device), "mxfp4-mbs-s")
    with pytest.raises(ValueError, match="unknown format"):
        quantize(x, "fp5")


def test_custom_op_matches_and_traces(triton_device):
    """The torch custom op returns the launcher's tensors, passes opcheck, and traces under
    torch.compile (fullgraph, through the fake implementation)."""
    from vllm_mxplus.backends.triton.ops import act_quant_op

    x = activations(3, 160, torch.bfloat16, triton_device, seed=2)
    for fmt in FORMATS:
        got = act_quant_op(x, fmt, macro_block=128)
        want = act_quant(x, fmt, macro_block=128)
        for g, w in zip(got, want):
            assert (g is None) == (w is None)
            if g is not None:
                assert_same_bits(fmt, g, w)
        torch.library.opcheck(torch.ops.vllm_mxplus.triton_act_quant.default, (x, fmt, 128))

    compiled = torch.compile(
        lambda t: act_quant_op(t, "mxfp4-mbs-s", macro_block=128),
        backend="aot_eager",
        fullgraph=True,
    )
    for g, w in zip(compiled(x), act_quant(x, "mxfp4-mbs-s", macro_block=128)):
        if g is not None:
            assert_same_bits("compiled", g, w)


# ----------------------------------------------------------------------------- GPU, real sizes
@pytest.mark.gpu
@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize(
    "m,k",
    [(1, 4096), (16, 14336), (8192, 4096), (4093, 5120 + 64)],
    ids=["M1-K4096", "M16-K14336", "M8192-K4096", "M4093-K5184"],
)
@pytest.mark.parametrize("dtype", list(DTYPES), ids=list(DTYPES))
def test_gpu_bit_exact_real_sizes(fmt, m, k, dtype, cuda_device):
    x = activations(m, k, DTYPES[dtype], cuda_device, seed=m + k)
    x[0] = float("nan")
    if m > 2:
        x[1] = 0.0
    check_bit_exact(x, fmt)


@pytest.mark.gpu
def test_gpu_cuda_graph_capture(cuda_device):
    from vllm_mxplus.backends.triton.ops import act_quant_op

    x = activations(16, 4096, torch.bfloat16, cuda_device)
    fresh = activations(16, 4096, torch.bfloat16, cuda_device, seed=9)
    out = replay_with(lambda t: act_quant_op(t, "mxfp4-mbs-s", macro_block=128), x, fresh)
    ref = quantize(x, "mxfp4-mbs-s")
    assert_same_bits("codes", out[0], ref.codes)
    assert_same_bits("mbs", out[2], ref.mbs)


# ----------------------------------------------------------------------------- launcher limits
@pytest.mark.parametrize("macro_block", [256, 1024, 2048], ids=lambda b: f"macro{b}")
def test_large_macro_blocks_bit_exact(macro_block, triton_device):
    """Macro blocks wider than the GPU's 512-column tile: the tile widens to one macro block
    (before, BLOCK_K stayed 512 and the kernel could not compile on a GPU)."""
    x = activations(5, 2 * macro_block + 100, torch.bfloat16, triton_device, seed=macro_block)
    codes, scales, mbs, _ = act_quant(x, "mxfp4-mbs-s", macro_block=macro_block)
    ref = quantize(x, "mxfp4-mbs-s", macro_block=macro_block)
    assert_same_bits("codes", codes, ref.codes)
    assert_same_bits("scales", scales, ref.scales)
    assert_same_bits("mbs", mbs, ref.mbs)


@pytest.mark.parametrize("macro_block", [16, 32, 64, 128, 256, 512, 1024, 2048])
@pytest.mark.parametrize("m", [1, 3, 100])
def test_gpu_tiles_hold_a_macro_block(m, macro_block):
    """The GPU tile (what `mxplus kernels --aot` compiles) is a whole number of macro blocks
    and at most GPU_TILE_ELEMS elements: a macro block never crosses programs."""
    from vllm_mxplus.backends.triton import act_quant as aq
    from vllm_mxplus.backends.triton.launch import capture_launches

    with capture_launches():  # the GPU's choices, even under the interpreter
        block_m, block_k = aq.tile_sizes(m, 4096, macro_block)
    assert block_k % macro_block == 0 and block_m * block_k <= aq.GPU_TILE_ELEMS
    assert block_m >= 1 and block_k <= max(macro_block, aq.GPU_BLOCK_K)


@pytest.mark.parametrize("macro_block", [48, 96, 4096])
def test_unsupported_macro_block_is_rejected(macro_block):
    """Multiples of 16 that are not powers of two are valid in `formats` but the kernel's
    tiles hold only whole power-of-two macro blocks: refused with the reason."""
    x = torch.zeros(2, 256)
    with pytest.raises(ValueError, match="act_quant: macro_block .*power of two"):
        act_quant(x, "mxfp4-mbs-s", macro_block=macro_block)


# ----------------------------------------------------------------------------- small macro blocks
SMALL_MACROS = (16, 32, 64)  # `mxplus quantize --macro-block N` below 128 (docs/numerics.md)


@pytest.mark.parametrize("macro_block", SMALL_MACROS, ids=lambda b: f"macro{b}")
@pytest.mark.parametrize("m,k", [(1, 100), (33, 576), (3, 1536)], ids=lambda v: str(v))
@pytest.mark.parametrize("dtype", list(DTYPES), ids=list(DTYPES))
def test_small_macro_blocks_bit_exact(macro_block, m, k, dtype, triton_device):
    """Macro blocks narrower than the tile (a 512-column GPU tile holds 8-32 of them):
    codes, scales and MBS bytes bit-exact with formats.quantize(..., macro_block=N)."""
    x = activations(m, k, DTYPES[dtype], triton_device, seed=m * k + macro_block)
    check_bit_exact(x, "mxfp4-mbs-s", macro_block)


@pytest.mark.parametrize("macro_block", SMALL_MACROS, ids=lambda b: f"macro{b}")
@pytest.mark.parametrize("k", [1, 15, 17, 33, 129, 257], ids=lambda k: f"K{k}")
def test_small_macro_blocks_odd_and_tiny_k(macro_block, k, triton_device):
    """Partial last macro blocks, partial blocks, odd K (half-filled last byte)."""
    x = activations(3, k, torch.bfloat16, triton_device, seed=k + macro_block)
    check_bit_exact(x, "mxfp4-mbs-s", macro_block)


@pytest.mark.parametrize("macro_block", SMALL_MACROS, ids=lambda b: f"macro{b}")
@pytest.mark.parametrize("dtype", list(DTYPES), ids=list(DTYPES))
def test_small_macro_blocks_special_rows(macro_block, dtype, triton_device):
    """test_special_rows' rows with macro blocks of 16-64: a NaN / Inf macro block gets
    m = 0 and leaves its neighbours (now 16-64 elements away) alone."""
    dt = DTYPES[dtype]
    x = activations(9, 584, dt, "cpu", seed=7).float()  # 584: a partial last macro block
    x[0] = 0.0
    x[1] = float("nan")
    x[2, 17] = float("nan")
    x[3, 300] = float("inf")
    x[3, 301] = -float("inf")
    x[4] = -0.0
    x[4, ::7] = 0.0
    x[5] = x[5] * 2.0**-10
    x[6, :130] = float("nan")  # crosses several macro-block boundaries
    x[7, 560:] = 0.0  # zero tail in the partial macro block
    x[8, macro_block - 1] = float("inf")  # last element of the first macro block
    check_bit_exact(x.to(dt).to(triton_device), "mxfp4-mbs-s", macro_block)


@pytest.mark.filterwarnings("ignore:overflow encountered:RuntimeWarning")
@pytest.mark.parametrize("macro_block", SMALL_MACROS, ids=lambda b: f"macro{b}")
def test_small_macro_blocks_extreme_magnitudes(macro_block, triton_device):
    """Subnormal macro absmax (6/a overflows), bf16 max (x * F overflows), E2M1 ties."""
    x = activations(4, 256, torch.bfloat16, "cpu", seed=3).float()
    x[0] = x[0] * 2.0**-130
    x[1, :64] = torch.tensor(3.3895e38)
    x[2] = torch.linspace(-6.0, 6.0, 256)
    x[3] = 2.0**-126 * torch.linspace(-1.0, 1.0, 256)
    check_bit_exact(x.to(torch.bfloat16).to(triton_device), "mxfp4-mbs-s", macro_block)


def test_row_offsets_are_64_bit(triton_device):
    """Row 2048 of a tensor with a row stride of 2^20 elements starts at element 2^31: a
    32-bit row * stride wraps there (131k tokens at K = 16384 hit the same). The buffer is
    4 GiB of virtual memory, only the touched rows are ever backed."""
    if triton_device.type != "cpu":
        pytest.skip("the 4 GiB strided buffer is a CPU (virtual memory) check")
    m, k, stride = 2049, 128, 1 << 20
    base = torch.empty((m - 1) * stride + k, dtype=torch.bfloat16)
    x = base.as_strided((m, k), (stride, 1))
    x.copy_(activations(m, k, torch.bfloat16, "cpu", seed=7))
    codes, scales, mbs, _ = act_quant(x, "mxfp4-mbs-s", macro_block=128)
    ref = quantize(x.contiguous(), "mxfp4-mbs-s")
    assert_same_bits("codes", codes, ref.codes)
    assert_same_bits("scales", scales, ref.scales)
    assert_same_bits("mbs", mbs, ref.mbs)


# ----------------------------------------------------------------------------- the GPU's E2M1
@pytest.mark.filterwarnings("ignore:overflow encountered:RuntimeWarning")
@pytest.mark.parametrize("fmt", [f for f in FORMATS if f != "nvfp4"])
def test_e2m1_conversion_path_bit_exact(fmt, triton_device, monkeypatch):
    """The path that rounds with the GPU's E2M1 conversion (`quant_blocks.e8m0_block_scaled`
    and `e2m1_packed_hw`: signed scaled values, a NaN block's zeros, codes packed two per
    byte), the conversion itself done by `e2m1_magnitude_code` (the interpreter runs no PTX;
    the GPU's is checked against `formats` by the first-use self-test): bit-exact with
    `formats.quantize` on the special rows, extreme magnitudes, odd K and random rows, and
    small macro blocks for MBS."""
    monkeypatch.setattr(aq, "e2m1_rounding", lambda device, hat: aq.HW_E2M1_EMULATED)
    with capture_launches() as launches:  # recorded, not run: the path the runs below take
        act_quant(activations(2, 576, torch.bfloat16, triton_device), fmt, macro_block=128)
    assert launches[-1].kwargs["HW_E2M1"] == aq.HW_E2M1_EMULATED
    test_special_rows(fmt, "bf16", triton_device)
    test_extreme_magnitudes_bf16(fmt, triton_device)
    test_odd_and_tiny_k(fmt, 33, triton_device)
    check_bit_exact(activations(33, 1536, torch.float16, triton_device, seed=5), fmt)
    if fmt == "mxfp4-mbs-s":
        test_small_macro_blocks_special_rows(32, "bf16", triton_device)


@pytest.mark.parametrize(
    "cap,hat,want",
    [(90, False, 0), (100, False, aq.HW_E2M1_GPU), (120, False, aq.HW_E2M1_GPU), (100, True, 0)],
)
def test_e2m1_conversion_where_the_gpu_has_it(cap, hat, want):
    """The E8M0 quantizer rounds with the GPU's E2M1 conversion on sm_100 and later (PTX
    cvt...e2m1x2 needs sm_100a), its own rounding below and where it writes x_hat (whose
    values it builds from the codes); under the interpreter never."""
    x = torch.empty((4, 512), dtype=torch.bfloat16, device="meta")
    with capture_launches(cap) as launches:
        (aq.act_quant_hat if hat else act_quant)(x, "mxfp4-mbs-s", macro_block=128)
    assert launches[-1].kwargs["HW_E2M1"] == want
    assert aq.e2m1_rounding(torch.device("cpu"), False) == 0
