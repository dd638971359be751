"""The CPU integer GEMM bit for bit, at row counts that exercise every blocking of the kernels
(docs/cpu_kernels.md: the AVX-512 panel kernel takes M >= 32 in register tiles of 4 rows and
2 weight tiles, with remainders; fewer rows and MX+ take the register tiles; on AVX-512 both
add a block term by exponent bits and one FMA where every term's power of two is a normal
fp32, else by vscalefps: N = 45 with special weight rows in its first tile gives both at once).

Two checks per scheme and M:
- against an fp32 model of the operations the kernel documents (docs/numerics.md, "Kernel
  numerics and error bounds"; docs/cpu_kernels.md), built in torch from the codes and scales
  of `vllm_mxplus.formats.quantize`: each block's exact integer sum I_b, the block term
  I_b * 2^(ea + ew - 256) rounded once to fp32, block terms added in fp32 in K order from 0,
  per MBS chunk one fp32 division by Fw * Fa added to the row sum, then the bias. Equal bits,
  NaN where the model is NaN;
- every row of an M-row call equal, bit for bit, to the same row computed alone (M = 1 runs
  the single-row kernel, M >= 32 the panel kernel on AVX-512): outputs do not depend on how
  the rows were blocked. For NVFP4 and MX+ as well.
"""

from __future__ import annotations

import shutil

import pytest
import torch
from test_cpu_kernels import PAIRS, _special_rows, _weight  # tests/backends/cpu, on sys.path

from vllm_mxplus.formats import MACRO_BLOCK, get_format, quantize
from vllm_mxplus.formats.constants import ceil_div
from vllm_mxplus.formats.e2m1 import e2m1_decode, unpack_fp4

pytestmark = pytest.mark.skipif(shutil.which("c++") is None, reason="no C++ compiler (c++)")

# below and above the panel kernel's first M (32), every remainder of its 4-row tiles
MS = [1, 3, 4, 5, 17, 32, 35, 64, 66, 257]
E8M0_NAN = 255


def _doubled(q, k: int) -> torch.Tensor:
    """2 * E2M1 value of each code as int64 [rows, K]."""
    return (2 * e2m1_decode(unpack_fp4(q.codes, k))).to(torch.int64)


def _block_exponents(doubled: torch.Tensor, scales: torch.Tensor, block: int) -> torch.Tensor:
    """E8M0 code per block as float64, NaN for code 255 and for a block whose spec values
    overflow fp32 (code 254 with |2v| >= 4, 253 with |2v| >= 8: the kernels' NaN rule)."""
    rows, k = doubled.shape
    nb = scales.shape[1]
    big = torch.zeros(rows, nb * block, dtype=torch.int64)
    big[:, :k] = doubled.abs()
    big = big.view(rows, nb, block).amax(-1)
    s = scales.to(torch.int64)
    nan = (s == E8M0_NAN) | ((s == 254) & (big >= 4)) | ((s == 253) & (big >= 8))
    return s.to(torch.float64).masked_fill(nan, float("nan"))


def _model(x: torch.Tensor, q, act_fmt: str, bias: torch.Tensor | None) -> torch.Tensor:
    """The kernel's documented operations in fp32, in its order (module docstring)."""
    k = x.shape[-1]
    qa = quantize(x, act_fmt)
    spec_w, spec_a = get_format(q.fmt), get_format(act_fmt)
    block = spec_a.block_size
    xa, xw = _doubled(qa, k), _doubled(q, k)
    ea = _block_exponents(xa, qa.scales, block)  # [M, nb]
    ew = _block_exponents(xw, q.scales, block)  # [N, nb]
    nb = ea.shape[1]
    mbs = spec_w.mbs is not None or spec_a.mbs is not None
    per_chunk = MACRO_BLOCK // block if mbs else nb
    fa = (1 + qa.mbs.to(torch.float32) / 256) if spec_a.mbs else None
    fw = (1 + q.mbs.to(torch.float32) / 256) if spec_w.mbs else None
    m, n = xa.shape[0], xw.shape[0]
    y = torch.zeros(m, n, dtype=torch.float32)
    acc = torch.zeros(m, n, dtype=torch.float32)
    for b in range(nb):
        sl = slice(b * block, min(k, (b + 1) * block))
        ib = xa[:, sl] @ xw[:, sl].T  # exact int64
        e = ea[:, b, None] + ew[None, :, b]
        term = (ib.to(torch.float64) * torch.exp2(e - 256)).to(torch.float32)  # rounded once
        acc = acc + term
        if mbs and (b + 1 == nb or (b + 1) % per_chunk == 0):
            c = b // per_chunk
            f = torch.ones(m, n, dtype=torch.float32)
            if fw is not None:
                f = f * fw[None, :, c]
            if fa is not None:
                f = f * fa[:, c, None]
            y = y + acc / f
            acc = torch.zeros_like(acc)
    if not mbs:
        y = acc
    if bias is not None:
        y = y + bias.to(torch.float32)
    return y


def _assert_bits(got: torch.Tensor, want: torch.Tensor) -> None:
    nan = torch.isnan(want)
    assert torch.equal(torch.isnan(got), nan), "NaN pattern differs"
    g, w = got.masked_fill(nan, 0.0), want.masked_fill(nan, 0.0)
    diff = (g.view(torch.int32) != w.view(torch.int32)).nonzero()
    assert diff.numel() == 0, (
        f"{diff.shape[0]} outputs differ, first at {tuple(diff[0].tolist())}: "
        f"{got[tuple(diff[0])].item()!r} vs {want[tuple(diff[0])].item()!r}"
    )


def _rows(m: int, k: int, seed: int, special: bool) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(max(m, 9), k, generator=g) * 3
    if special:  # NaN, Inf, zero, subnormal and huge rows: the kernels' slow block terms
        x = _special_rows(x)[[8, 4, 7, 1, 0, 2, 3, 5, 6] + list(range(9, max(m, 9)))]
    return x[:m].to(torch.bfloat16)


@pytest.mark.parametrize("pair", PAIRS, ids=lambda p: p[0])
@pytest.mark.parametrize("m", MS, ids=lambda m: f"M{m}")
@pytest.mark.parametrize("k", [33, 577], ids=lambda k: f"K{k}")
def test_linear_bits_equal_model(ck, pair, m, k):
    """N = 45 (two 16-row tile pairs and a partial odd tile), special weight rows, plain
    activation rows (the fast block terms) and, for M >= 9, special rows too."""
    wf, af = pair
    q = quantize(_weight(k, n=45, seed=m + k) * 0.05, wf)
    bias = torch.randn(45, generator=torch.Generator().manual_seed(m))
    for special in (False, True) if m >= 9 else (False,):
        x = _rows(m, k, m * 7 + k, special)
        y = ck.mx_linear(x, wf, af, q.codes, q.scales, q.mbs, k, bias, torch.float32, MACRO_BLOCK)
        _assert_bits(y, _model(x.float(), q, af, bias))


@pytest.mark.parametrize("m", [4, 31, 257], ids=lambda m: f"M{m}")
def test_plain_weights_take_the_fast_terms(ck, m):
    """Weights and rows whose block exponents all stay in fp32's normal range (the common
    case: the exponent-bit path of the AVX-512 kernels) at M = 257 (the panel kernel) and
    M = 4, 31 (the register tiles, whole 4-row tiles and a remainder), block 16 with MBS and
    block 32; K = 16400 makes the panel kernel take the rows in several passes (about 2^21
    bytes of codes each: 124 rows), N = 70 an odd last weight tile, whose codes the pass
    before it fetches ahead (PanelPrefetch)."""
    g = torch.Generator().manual_seed(5)
    k = 16400
    for wf, af in (("mxfp4-mbs-d", "mxfp4-mbs-s"), ("mxfp4-ocp", "mxfp4-ocp")):
        q = quantize(torch.randn(70, k, generator=g) * 0.02, wf)
        x = torch.randn(m, k, generator=g).to(torch.bfloat16)
        y = ck.mx_linear(x, wf, af, q.codes, q.scales, q.mbs, k, None, torch.float32, MACRO_BLOCK)
        _assert_bits(y, _model(x.float(), q, af, None))


@pytest.mark.parametrize("where", ["first", "last"])
def test_fast_terms_checked_over_every_block(ck, where):
    """The AVX-512 register tiles (M = 4) run the fast block terms first and learn only from
    the scale bytes the blocks load whether they held for a tile pair (else the general terms
    run over the same outputs again): one weight row of the second tile pair with a NaN block
    (code 255) and another with an exponent too large for the fast terms, in the first or the
    last block of K = 4100 (33 MBS chunks), the other pairs plain. The same bits as the model."""
    g = torch.Generator().manual_seed(11)
    k = 4100
    for wf, af in (("mxfp4-mbs-d", "mxfp4-mbs-s"), ("mxfp4-ocp", "mxfp4-ocp")):
        q = quantize(torch.randn(70, k, generator=g) * 0.02, wf)
        b = 0 if where == "first" else q.scales.shape[1] - 1
        q.scales[33, b] = E8M0_NAN
        q.scales[40, b] = 245  # 2^118 * 2^(ea - 127): past kFastMaxExp with these rows
        x = torch.randn(4, k, generator=g).to(torch.bfloat16)
        y = ck.mx_linear(x, wf, af, q.codes, q.scales, q.mbs, k, None, torch.float32, MACRO_BLOCK)
        _assert_bits(y, _model(x.float(), q, af, None))
        assert torch.isnan(y[:, 33]).all() and not torch.isnan(y[:, :32]).any()


def _rowwise_equal(run, x: torch.Tensor) -> None:
    y = run(x)
    for i in range(x.shape[0]):
        _assert_bits(run(x[i : i + 1])[0], y[i])


@pytest.mark.parametrize("m", MS[1:], ids=lambda m: f"M{m}")
def test_rows_do_not_depend_on_blocking(ck, m):
    """Every scheme: an M-row call equals its rows computed one at a time, bit for bit."""
    k = 577
    x = _rows(m, k, m, special=m >= 9)
    for wf, af in PAIRS:
        q = quantize(_weight(k, n=45, seed=k) * 0.05, wf)
        _rowwise_equal(
            lambda r, q=q, wf=wf, af=af: ck.mx_linear(
                r, wf, af, q.codes, q.scales, q.mbs, k, None, torch.float32, MACRO_BLOCK
            ),
            x,
        )
    qn = quantize(_weight(k, n=45, seed=1) * 0.05, "nvfp4")
    pn = ck.pack_nvfp4(qn)
    _rowwise_equal(lambda r: ck.nvfp4_linear_packed(r, 45, k, *pn, None, torch.float32), x)
    qm = quantize(_weight(k, n=45, seed=2) * 0.05, "mxplus")
    pm = ck.pack_mxplus(qm)
    _rowwise_equal(lambda r: ck.mxplus_linear_packed(r, 45, k, *pm, None, torch.float32), x)


def test_model_catches_a_wrong_term(ck):
    """The bitwise model is not vacuous: one weight E8M0 code off by one changes outputs."""
    k = 577
    q = quantize(torch.randn(45, k) * 0.05, "mxfp4-16")
    x = _rows(17, k, 3, special=False)
    want = _model(x.float(), q, "mxfp4-16", None)
    bad = q.scales.clone()
    bad[3, 9] += 1
    y = ck.mx_linear(
        x, "mxfp4-16", "mxfp4-16", q.codes, bad, None, k, None, torch.float32, MACRO_BLOCK
    )
    with pytest.raises(AssertionError, match="outputs differ"):
        _assert_bits(y, want)
    assert ceil_div(k, 16) > 9
