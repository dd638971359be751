"""`triton-fp4-prefill` (sm_100's block-scaled FP4 MMA): the relative UE4M3 scales against a
float derivation, bit for bit; the GEMM (its MMA emulated in fp32 where no sm_100 runs it)
and the whole backend against the float64 product of `formats`' x_hat and W_hat, within the
fp32-accumulation bound, every E8M0 scheme and NVFP4, with rows and weight rows the scales
cannot hold served exactly by the fallback; the dispatch's order and reasons."""

from __future__ import annotations

import pytest
import torch

from vllm_mxplus.backends import LinearSpec
from vllm_mxplus.backends.triton.decode_gemm import WIDE_BLOCK_MS
from vllm_mxplus.backends.triton.fp4_prefill import (
    FP4_PREFILL_MIN_M,
    TritonFp4PrefillBackend,
    fp4_operand,
)
from vllm_mxplus.backends.triton.fp4_rel_scales import (
    REF_MAX,
    REF_MIN,
    SPAN,
    rel_scales,
    rel_scales_torch,
)
from vllm_mxplus.backends.triton.fp4_scaled_gemm import fp4_scaled_gemm
from vllm_mxplus.backends.triton.gemm_ops import act_operands
from vllm_mxplus.formats import get_scheme, quantize
from vllm_mxplus.formats.constants import ceil_div


@pytest.fixture
def fp4_device(triton_device):
    """Where the FP4 MMA GEMM runs: the interpreter (its emulation), or an sm_100 GPU."""
    if triton_device.type == "cuda" and torch.cuda.get_device_capability(triton_device)[0] != 10:
        pytest.skip("the FP4 MMA needs sm_100 (capability 10.x); other GPUs never select it")
    return triton_device


def _expected_rel(scales, mbs, k, bs, per_chunk):
    """The module docstring's definition in float arithmetic: u = float8_e4m3fn(2^(s - ref +
    8)) for s - ref >= -17, f = 2^(ref - 135) * fp32(1/F), inexact as stated."""
    r = scales.shape[0]
    nb, nc = ceil_div(k, 16), ceil_div(k, 128)
    s16 = scales.long().repeat_interleave(bs // 16, dim=1)[:, :nb]
    s16 = torch.nn.functional.pad(s16, (0, nc * 8 - nb), value=-1)  # -1: past K
    groups = s16.view(r, nc, 8) if per_chunk else s16.view(r, 1, nc * 8)
    ref = groups.max(dim=2).values
    d = groups - ref[:, :, None]
    live = groups >= 0
    pow2 = torch.pow(2.0, (d + 8).clamp(min=-9).double())
    u = pow2.to(torch.float8_e4m3fn).view(torch.uint8)
    u = torch.where(live & (d >= -SPAN.value), u, torch.zeros_like(u)).reshape(r, nc * 8)
    sigma = torch.ones_like(ref, dtype=torch.float32)
    if mbs is not None:
        sigma = (1.0 / (1.0 + mbs.double() / 256.0)).float()  # correctly rounded 1/F
    refc = ref.clamp(REF_MIN.value, REF_MAX.value)
    f = (torch.pow(2.0, (refc - 135).double()) * sigma.double()).float().T  # [groups, R]
    bad = (ref < REF_MIN.value) | (ref > REF_MAX.value)
    bad = bad.any(dim=1) | (live & (d < -SPAN.value)).flatten(1).any(dim=1)
    return u, f, bad


@pytest.mark.parametrize("impl", ["kernel", "torch"])
@pytest.mark.parametrize("bs,per_chunk,k", [(16, True, 384), (16, True, 200), (32, True, 320),
                                            (16, False, 416), (32, False, 100)])  # fmt: skip
def test_rel_scales_bit_for_bit(bs, per_chunk, k, impl, triton_device):
    """The Triton kernel (activations, per call) and the torch form (weights, at load)."""
    g = torch.Generator().manual_seed(k + bs)
    r = 70
    scales = torch.randint(110, 135, (r, ceil_div(k, bs)), generator=g, dtype=torch.uint8)
    scales[1, 0] = 0  # a zero block: below the span
    scales[2, -1] = 255  # a NaN block
    scales[3, :] = 40  # a row of tiny values (ref < REF_MIN)
    scales[4, :] = 220  # huge ones (ref > REF_MAX)
    scales[5, 1] = scales[5, 0] - 17 if scales[5, 0] >= 17 else 0  # exactly the span's edge
    scales[5, 2:] = scales[5, 0]
    mbs = None
    if per_chunk:
        mbs = torch.randint(0, 256, (r, ceil_div(k, 128)), generator=g, dtype=torch.uint8)
    dev = triton_device
    rel = rel_scales if impl == "kernel" else rel_scales_torch
    u, f, bad = rel(scales.to(dev), None if mbs is None else mbs.to(dev), k, bs, per_chunk)
    eu, ef, ebad = _expected_rel(scales, mbs, k, bs, per_chunk)
    assert torch.equal(u.cpu(), eu)
    assert torch.equal(f.cpu().view(torch.int32), ef.view(torch.int32))
    assert torch.equal(bad.cpu(), ebad)
    assert ebad[1:5].all() and not ebad[5]  # each edge case is the one it is meant to be


def _operands(scheme: str, m: int, n: int, k: int, g: torch.Generator):
    sch = get_scheme(scheme)
    x = torch.randn(m, k, generator=g)
    w = torch.randn(n, k, generator=g) * 0.05
    qx = quantize(x, sch.activation_format, macro_block=128)
    qw = quantize(w, sch.weight_format, macro_block=128)
    return sch, x, w, qx, qw


def _gemm_operands(scheme: str, k: int, g: torch.Generator, dev, m: int = 40, n: int = 36):
    """(qx [m, k], qw [n, k], the GEMM's x operand and inexact rows, the w one) of Gaussian
    data in `scheme`."""
    sch, _, _, qx, qw = _operands(scheme, m, n, k, g)
    a = fp4_operand(qx.codes.to(dev), qx.scales.to(dev), _dev(qx.mbs, dev), None,
                    sch.activation_format, k)  # fmt: skip
    b = fp4_operand(qw.codes.to(dev), qw.scales.to(dev), _dev(qw.mbs, dev), None,
                    sch.weight_format, k)  # fmt: skip
    return qx, qw, a, b


def _bound(xd, wd, k, bias=None):
    y64 = xd @ wd.T
    s = xd.abs() @ wd.abs().T
    if bias is not None:
        y64 = y64 + bias.double()
        s = s + bias.double().abs()
    return y64, (k + 8) * 2.0**-24 * s + 2.0**-140


@pytest.mark.parametrize("scheme", ["mxfp4-mbs", "mxfp4-mbs-s", "mxfp4-16-oas", "mxfp4-ocp"])
@pytest.mark.parametrize("k", [384, 128])
def test_gemm_within_the_bound(scheme, k, fp4_device):
    """The GEMM (`fp4_scaled_gemm`, MMA emulated off sm_100) on rows the scales hold, against
    y64 with the fp32 bound (K + 8) 2^-24 S; a factor off by one ulp of 2^-10 in one chunk
    breaks it (the check can fail)."""
    g = torch.Generator().manual_seed(k)
    qx, qw, (a, abad), (b, bbad) = _gemm_operands(scheme, k, g, fp4_device)
    dev = fp4_device
    assert not abad.any() and not bbad.any()  # Gaussian rows sit inside the span
    per_chunk = qw.mbs is not None
    bias = torch.randn(36, generator=g)
    y = fp4_scaled_gemm(a, b, k, bias.to(dev), torch.float32, per_chunk).cpu().double()
    y64, tol = _bound(qx.dequantize().double(), qw.dequantize().double(), k, bias)
    assert ((y - y64).abs() <= tol).all()
    f_bad = a[2].clone()
    f_bad[-1, 7] *= 1 + 2.0**-10
    y_bad = fp4_scaled_gemm((a[0], a[1], f_bad), b, k, bias.to(dev), torch.float32, per_chunk)
    assert not ((y_bad.cpu().double() - y64).abs() <= tol).all()


def _gemm_with(a, b, side: str, part: int, t: torch.Tensor, k: int, per_chunk: bool):
    """The fp32 GEMM (on the CPU) with part `part` (0 codes, 1 scales, 2 factors) of operand
    `side` ("a" or "b") replaced by t."""
    op = tuple(t if i == part else x for i, x in enumerate(a if side == "a" else b))
    ops = (op, b) if side == "a" else (a, op)
    return fp4_scaled_gemm(*ops, k, None, torch.float32, per_chunk).cpu()


def _assert_moves_only_its_own(moved: torch.Tensor, side: str, row: int) -> None:
    """Some outputs moved, all in activation row `row` (side "a") or weight row `row`'s
    output column (side "b")."""
    want = torch.zeros_like(moved)
    if side == "a":
        want[row] = moved[row]
    else:
        want[:, row] = moved[:, row]
    assert moved.any() and torch.equal(moved, want)


@pytest.mark.parametrize("scheme", ["mxfp4-mbs", "mxfp4-16-oas"])
def test_each_scale_reaches_its_row_and_block(scheme, fp4_device):
    """The scales reach the MMA in tcgen05's order of 128-row groups (`scale_rows`, undone
    by `scale_tile`): over 2 row groups and 3 column tiles (M = 200, N = 260, the last tiles
    partial) within the bound, and one scale doubled (its UE4M3 exponent + 1) moves exactly
    its own output row (activation row 131, block 5) or column (weight row 257, block 9): a
    scale read for the wrong row or block moves another, or none."""
    g = torch.Generator().manual_seed(5)
    k, m, n = 256, 200, 260
    qx, qw, (a, _), (b, _) = _gemm_operands(scheme, k, g, fp4_device, m, n)
    per_chunk = qw.mbs is not None
    y = fp4_scaled_gemm(a, b, k, None, torch.float32, per_chunk).cpu()
    y64, tol = _bound(qx.dequantize().double(), qw.dequantize().double(), k)
    assert ((y.double() - y64).abs() <= tol).all()
    for side, (row, block) in (("a", (131, 5)), ("b", (257, 9))):
        u = (a if side == "a" else b)[1].clone()
        assert u[row, block] != 0  # a block the scales hold, its exponent + 1 stays finite
        u[row, block] += 8  # UE4M3: 3 mantissa bits below the exponent
        _assert_moves_only_its_own(_gemm_with(a, b, side, 1, u, k, per_chunk) != y, side, row)


def test_each_mbs_factor_reaches_its_row(fp4_device):
    """The MBS factors [chunks, rows] reach their own output row and column (the columns'
    read masked at the partial last tile, the rows' clamped): over 2 row groups and 3 column
    tiles (M = 200, N = 260), one factor scaled by 1 + 2^-10 moves exactly its own activation
    row (131, chunk 1) or weight column (257, chunk 0), and no other. (A factor of the wrong
    chunk fails `test_gemm_within_the_bound`.)"""
    g = torch.Generator().manual_seed(6)
    k, m, n = 256, 200, 260
    qx, qw, (a, _), (b, _) = _gemm_operands("mxfp4-mbs", k, g, fp4_device, m, n)
    y = fp4_scaled_gemm(a, b, k, None, torch.float32, True).cpu()
    for side, (row, chunk) in (("a", (131, 1)), ("b", (257, 0))):
        f = (a if side == "a" else b)[2].clone()
        f[chunk, row] *= 1 + 2.0**-10
        _assert_moves_only_its_own(_gemm_with(a, b, side, 2, f, k, True) != y, side, row)


def test_every_tile_is_whole_scale_groups():
    """`scale_rows` reads whole 128-row groups: every GPU tile, the split tile and the
    emulated one are multiples of it."""
    from vllm_mxplus.backends.triton import fp4_scaled_gemm as fg

    sizes = [d for bm, bn, _ in fg.TILES.values() for d in (bm, bn)]
    sizes += [fg.BLOCK_N_SPLIT, fg.EMULATE_BLOCK]
    assert all(d % fg.SCALE_GROUP_ROWS == 0 for d in sizes), sizes


def _dev(t, dev):
    return None if t is None else t.to(dev)


def _layer(scheme: str, qw, dev):
    spec = LinearSpec(get_scheme(scheme), qw.codes.shape[0], qw.shape[-1], torch.float32)
    backend = TritonFp4PrefillBackend(spec)
    layer = torch.nn.Module()
    backend.process_weights_after_loading(layer, _to(qw, dev))
    return backend, layer


def _to(q, dev):
    import dataclasses

    fields = {f.name: getattr(q, f.name) for f in dataclasses.fields(q)}
    moved = {n: (v.to(dev) if isinstance(v, torch.Tensor) else v) for n, v in fields.items()}
    return dataclasses.replace(q, **moved)


@pytest.mark.parametrize("scheme", ["mxfp4-mbs", "mxfp4-16-oas", "nvfp4"])
def test_backend_exact_with_fallback_rows_and_columns(scheme, fp4_device):
    """The whole backend: rows x with a block far below its chunk (a zero block; one row of
    tiny values) and a weight row with the same go through the exact fallback; a NaN input
    gives a NaN row (docs/numerics.md); everything else through the MMA; all within the
    bound against formats' x_hat / W_hat."""
    g = torch.Generator().manual_seed(7)
    m, n, k = 36, 40, 256
    sch, x, w, _, _ = _operands(scheme, m, n, k, g)
    x[3, 16:32] = 0.0  # a zero block
    x[5, :] *= 2.0**-70  # ref below REF_MIN
    x[9, 40] = float("nan")
    w[11, 128:144] = 0.0  # a weight row the scales cannot hold: its column is the fallback's
    qw = quantize(w, sch.weight_format, macro_block=128)
    dev = fp4_device
    backend, layer = _layer(scheme, qw, dev)
    nvfp4 = scheme == "nvfp4"
    assert layer.mxplus_fp4_w_inexact.tolist() == ([] if nvfp4 else [11])
    bias = torch.randn(n, generator=g)
    y = backend.apply(layer, x.to(dev), bias.to(dev)).cpu().double()
    x_ops = act_operands(x.to(dev), sch.activation_format, 128)
    _, x_bad = fp4_operand(*x_ops, sch.activation_format, k)
    assert x_bad.nonzero()[:, 0].tolist() == ([9] if nvfp4 else [3, 5, 9])  # the rest: the MMA
    assert y[9].isnan().all() and not y[torch.arange(m) != 9].isnan().any()
    per_row = backend.spec.activation_per_row  # NVFP4 activations: a global scale per row
    qx = quantize(x, sch.activation_format, macro_block=128, per_row=per_row)
    y64, tol = _bound(qx.dequantize().double(), qw.dequantize().double(), k, bias)
    keep = torch.arange(m) != 9
    assert ((y[keep] - y64[keep]).abs() <= tol[keep]).all()


def test_dispatch_order_and_reasons():
    from vllm_mxplus.backends import registered_backends
    from vllm_mxplus.backends.cutlass.linear import CutlassPrefillBackend, TritonFp8PrefillBackend

    order = registered_backends("cuda")
    assert order.index(CutlassPrefillBackend) < order.index(TritonFp4PrefillBackend)
    assert order.index(TritonFp4PrefillBackend) < order.index(TritonFp8PrefillBackend)
    ok, why = TritonFp4PrefillBackend.is_supported("cuda", 90)
    assert not ok and "10.x" in why
    assert not TritonFp4PrefillBackend.is_supported("cpu", None)[0]
    spec = LinearSpec(get_scheme("mxfp4-mbs", 64), 64, 256, torch.bfloat16)
    ok, why = TritonFp4PrefillBackend.can_implement(spec)
    assert not ok and "macro block 64" in why
    ok, why = TritonFp4PrefillBackend.can_implement(LinearSpec("mxplus", 64, 256, torch.bfloat16))
    assert not ok and "MX+" in why
    for scheme in ("mxfp4-mbs", "mxfp4-mbs-s", "mxfp4-16-oas", "mxfp4-ocp", "nvfp4"):
        assert TritonFp4PrefillBackend.can_implement(LinearSpec(scheme, 64, 256, torch.bfloat16))[0]
    ok, why = TritonFp4PrefillBackend.can_implement(LinearSpec("nvfp4", 64, 576, torch.bfloat16))
    assert not ok and "K = 576" in why
    with pytest.raises(ValueError, match="K = 200"):
        op = (torch.zeros(4, 100, dtype=torch.uint8), torch.zeros(4, 16, dtype=torch.uint8),
              torch.ones(1, 4))  # fmt: skip
        fp4_scaled_gemm(op, op, 200, None, torch.float32, per_chunk=False)
    assert TritonFp4PrefillBackend.m_range() == (FP4_PREFILL_MIN_M, None)
    assert WIDE_BLOCK_MS[0] + 1 == FP4_PREFILL_MIN_M


@pytest.mark.parametrize("scheme", ["mxfp4-mbs", "mxfp4-16-oas", "nvfp4"])
def test_sm100_takes_m_from_the_64_row_tile_on(scheme, triton_device, monkeypatch):
    """The selector on sm_100 (the CUTLASS extension not built): the FP4 MMA pipeline from
    FP4_PREFILL_MIN_M rows, the decode GEMM below; a layer the FP4 MMA does not take (K not
    whole 128-K chunks, MX+) keeps the decode GEMM up to 128 rows; sm_90 as before."""
    from vllm_mxplus.backends import selection
    from vllm_mxplus.backends.linear_op import LinearDispatch

    monkeypatch.setenv("VLLM_MXPLUS_SELFTEST", "0")
    monkeypatch.setattr(selection, "_LOGGED", set())
    spec = LinearSpec(scheme, 64, 256, torch.bfloat16, device_type="cuda")
    d = LinearDispatch(spec, selection.select(spec, "cuda", 100))
    names = [b.name for b in d.candidates]
    assert names[:2] == ["triton-fp4-prefill", "triton-decode"], names
    assert d.pick(FP4_PREFILL_MIN_M - 1).name == "triton-decode"
    for m in (FP4_PREFILL_MIN_M, 64, 65, 128, 129, 4096):
        assert d.pick(m).name == "triton-fp4-prefill", m
    for other in (LinearSpec(scheme, 64, 576, torch.bfloat16, device_type="cuda"),
                  LinearSpec("mxplus", 64, 256, torch.bfloat16, device_type="cuda")):  # fmt: skip
        d = LinearDispatch(other, selection.select(other, "cuda", 100))
        assert d.pick(128).name == "triton-decode"
    d = LinearDispatch(spec, selection.select(spec, "cuda", 90))
    assert d.pick(128).name == "triton-decode" and d.pick(64).name == "triton-decode"


@pytest.mark.gpu
@pytest.mark.parametrize("per_chunk", [True, False], ids=["mbs", "no-mbs"])
def test_mma_equals_its_emulation_on_sm100(per_chunk, cuda_device):
    """On an sm_100 GPU: the block-scaled FP4 MMA (`tl.dot_scaled`, UTCOMMA.4X) against the
    emulated dot of the same launch code, bit for bit on data whose chunk sums are exact in
    fp32 (E2M1 values times scales 2^-1..2^1 at K = 256: integers of 2^-4 below 2^20), so
    the nibble order, the scale layout and the UE4M3 reading are what the emulation says."""
    from vllm_mxplus.backends.triton.fp4_rel_scales import aligned_rows

    if torch.cuda.get_device_capability(cuda_device)[0] != 10:
        pytest.skip("needs sm_100's block-scaled FP4 MMA (capability 10.x)")
    g = torch.Generator().manual_seed(3)
    m, n, k = 256, 384, 256

    def operand(rows):
        codes = torch.randint(0, 256, (rows, k // 2), generator=g, dtype=torch.uint8)
        bits = torch.randint(6, 9, (rows, k // 16), generator=g, dtype=torch.uint8) << 3
        u = aligned_rows(rows, k // 16, torch.uint8, cuda_device)
        u.copy_(bits)  # UE4M3 2^-1, 2^0, 2^1
        groups = k // 128 if per_chunk else 1
        f = aligned_rows(groups, rows, torch.float32, cuda_device)
        f.copy_(torch.rand(groups, rows, generator=g) + 0.5)
        return codes.to(cuda_device), u, f

    a, b = operand(m), operand(n)
    y = fp4_scaled_gemm(a, b, k, None, torch.float32, per_chunk, emulate=False)
    ref = fp4_scaled_gemm(a, b, k, None, torch.float32, per_chunk, emulate=True)
    assert torch.equal(y, ref)


@pytest.mark.parametrize("scheme", ["mxfp4-mbs", "mxfp4-16-oas", "mxfp4-ocp", "nvfp4"])
def test_first_use_self_test_passes_and_can_fail(scheme, fp4_device, monkeypatch):
    """The first-use self-test (`selftest.run_self_test`: random data within the bound, exact
    data bit for bit in bf16) passes the backend, and fails it when one chunk factor of the
    weight is off by 2^-6 (the MMA's operands and everything else unchanged)."""
    from vllm_mxplus.backends import selftest
    from vllm_mxplus.backends.triton import fp4_prefill

    spec = LinearSpec(get_scheme(scheme), 4096, 4096, torch.bfloat16)
    assert selftest.run_self_test(TritonFp4PrefillBackend, spec, fp4_device) is None
    real = fp4_prefill.fp4_scaled_gemm

    def off(a, b, *args, **kwargs):
        f = b[2].clone()
        f[0, 0] *= 1 + 2.0**-6
        return real(a, (b[0], b[1], f), *args, **kwargs)

    monkeypatch.setattr(fp4_prefill, "fp4_scaled_gemm", off)
    assert selftest.run_self_test(TritonFp4PrefillBackend, spec, fp4_device) is not None


@pytest.mark.parametrize("per_chunk", [True, False], ids=["mbs", "no-mbs"])
@pytest.mark.parametrize("split", [2, 3])
def test_split_k_within_the_bound(per_chunk, split, fp4_device):
    """K split in slices of whole chunks (small grids on the GPU), the fp32 partials summed
    in slice order (`finish_output`) with the bias: within the bound in fp32 (a slice lost or
    summed twice would move outputs by whole chunks), and the bf16 output the one rounding
    of that fp32 result."""
    g = torch.Generator().manual_seed(split)
    k = 768  # 6 chunks: 2 or 3 slices of whole chunks
    scheme = "mxfp4-mbs" if per_chunk else "mxfp4-16-oas"
    qx, qw, (a, _), (b, _) = _gemm_operands(scheme, k, g, fp4_device)
    dev = fp4_device
    bias = torch.randn(36, generator=g).to(dev)
    y64, tol = _bound(qx.dequantize().double(), qw.dequantize().double(), k, bias.cpu())
    y32 = fp4_scaled_gemm(a, b, k, bias, torch.float32, per_chunk, split_k=split)
    assert ((y32.cpu().double() - y64).abs() <= tol).all()
    y16 = fp4_scaled_gemm(a, b, k, bias, torch.bfloat16, per_chunk, split_k=split)
    assert torch.equal(y16, y32.to(torch.bfloat16))
    from vllm_mxplus.backends.triton.launch import capture_launches

    with capture_launches() as launches:  # the launch really is split: grid (tiles, split)
        fp4_scaled_gemm(a, b, k, bias, torch.float32, per_chunk, split_k=split)
    assert launches[0].grid[1] == split and launches[0].kwargs["SPLIT"]
