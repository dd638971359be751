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
  per MBS chunk the row sum y = fma(S, t, y) with t = fl(fl(1/Fa) * fl(1/Fw)) (one rounding;
  `fma32`), then the bias. Equal bits,
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


def _model(
    x: torch.Tensor, q, act_fmt: str, bias: torch.Tensor | None, macro: int = MACRO_BLOCK
) -> torch.Tensor:
    """The kernel's documented operations in fp32, in its order (module docstring)."""
    k = x.shape[-1]
    qa = quantize(x, act_fmt, macro_block=macro)
    spec_w, spec_a = get_format(q.fmt), get_format(act_fmt)
    block = spec_a.block_size
    xa, xw = _doubled(qa, k), _doubled(q, k)
    ea = _block_exponents(xa, qa.scales, block)  # [M, nb]
    ew = _block_exponents(xw, q.scales, block)  # [N, nb]
    nb = ea.shape[1]
    mbs = spec_w.mbs is not None or spec_a.mbs is not None
    per_chunk = macro // block if mbs else nb
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
            t = torch.ones(m, n, dtype=torch.float32)
            if fw is not None:
                t = t * (1 / fw[None, :, c])
            if fa is not None:
                t = (1 / fa[:, c, None]) * t
            y = fma32(acc, t, y)
            acc = torch.zeros_like(acc)
    if not mbs:
        y = acc
    if bias is not None:
        y = y + bias.to(torch.float32)
    return y


def fma32(a: torch.Tensor, b: torch.Tensor, c: torch.Tensor) -> torch.Tensor:
    """fp32 a * b + c with one rounding to nearest even, as an FMA instruction computes it.
    a * b is exact in float64 (24-bit significands); the sum is hi + lo exactly (TwoSum), and
    hi rounds to the fp32 of hi + lo unless hi lies on a midpoint between two fp32 values with
    lo != 0, where lo decides: hi moves one float64 step toward it first."""
    p = a.double() * b.double()
    cd = c.double()
    hi = p + cd
    bb = hi - p
    lo = (p - (hi - bb)) + (cd - bb)
    r = hi.float()
    below = torch.where(r.double() <= hi, r, torch.nextafter(r, r.new_tensor(-float("inf"))))
    above = torch.nextafter(below, below.new_tensor(float("inf")))
    mid = (below.double() + above.double()) / 2
    tie = torch.isfinite(hi) & (hi == mid) & (lo != 0)
    toward = torch.where(lo > 0, float("inf"), -float("inf")).to(hi.dtype)
    hi = torch.where(tie, torch.nextafter(hi, toward), hi)
    return hi.float()


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


def _spread(codes: torch.Tensor, counted: torch.Tensor, per_chunk: int) -> torch.Tensor:
    """Per row and chunk of `per_chunk` blocks: the span (max - min) of the E8M0 codes of
    the counted blocks (0 where none), inf where a block's code is 255."""
    rows, nb = codes.shape
    c = codes.to(torch.float64)
    out = []
    for b0 in range(0, nb, per_chunk):
        ch, cnt = c[:, b0 : b0 + per_chunk], counted[:, b0 : b0 + per_chunk]
        hi = ch.masked_fill(~cnt, -1e9).amax(1)
        lo = ch.masked_fill(~cnt, 1e9).amin(1)
        s = torch.where(cnt.any(1), hi - lo, torch.zeros_like(hi))
        out.append(s.masked_fill((ch == E8M0_NAN).any(1), float("inf")))
    return torch.stack(out, 1)


@pytest.mark.parametrize("pair", [("mxfp4-mbs-d", "mxfp4-mbs-s"), ("mxfp4-mbs-s", "mxfp4-mbs-s")])
@pytest.mark.parametrize("macro", [64, 128, 256, 512])
def test_folded_chunks_bits_equal_model(ck, pair, macro):
    """The panel kernel (M >= 32) sums an MBS chunk in int32 and adds one term where every
    weight row of its tile pair and every activation row of its 4-row tile fold over the chunk
    (block codes spanning at most 3; an activation's all-zero blocks not counted), else block
    by block against the same folded operands (docs/cpu_kernels.md, "Folded chunks"): the same
    bits as the model either way. Weights and rows are planted so that, as computed here from
    their scales, every case occurs: both sides fold; the weights fold and a row does not (one
    block 100x its neighbours); a row folds and a weight tile does not (one block 64x); a row
    folds only because its zero blocks are not counted; a whole zero chunk. K = 600 ends in a
    partial chunk; macro 512 (past the 256 elements a folded chunk may have) folds nothing."""
    wf, af = pair
    k, n, m = 600, 64, 40
    g = torch.Generator().manual_seed(macro)
    w = torch.randn(n, k, generator=g) * 0.02
    w[20, 144:160] *= 64  # tile 1, block 9
    x = torch.randn(m, k, generator=g) * 2
    x[5, 272:288] *= 100  # row 5, block 17
    x[9, 128:160] = 0.0  # row 9, blocks 8 and 9 zero (code 0), block 10 above the rest
    x[9, 160:176] *= 6
    x[12, 384:512] = 0.0  # row 12: blocks 24 .. 31
    # the limit: in the first 64 elements (one chunk at every macro) block maxima of exactly
    # s and one block f times that: codes spanning 3 (fold, codes up to 96) or 4 (do not)
    limit = ((x[20], 1.0, 1, 16), (x[24], 1.0, 2, 8), (w[33], 0.02, 2, 16), (w[40], 0.02, 3, 8))
    for r, s, b, f in limit:
        r[:64] = torch.randn(64, generator=g).clamp(-1, 1) * s
        r[0:64:16] = s
        r[16 * b : 16 * b + 16] *= f
    q = quantize(w, wf, macro_block=macro)
    y = ck.mx_linear(x, wf, af, q.codes, q.scales, q.mbs, k, None, torch.float32, macro)
    _assert_bits(y, _model(x.float(), q, af, None, macro=macro))
    for i in (5, 9, 12, 33):
        _assert_bits(
            ck.mx_linear(
                x[i : i + 1], wf, af, q.codes, q.scales, q.mbs, k, None, torch.float32, macro
            )[0],
            y[i],
        )

    qa = quantize(x.float(), af, macro_block=macro)
    per_chunk = macro // 16
    nb = qa.scales.shape[1]
    codes = torch.nn.functional.pad(_doubled(qa, k), (0, nb * 16 - k))
    nonzero = (codes != 0).view(m, nb, 16).any(-1)  # [M, nb]
    rows = _spread(qa.scales, nonzero, per_chunk) <= 3  # [M, nc]
    all_rows = _spread(qa.scales, torch.ones_like(nonzero), per_chunk) <= 3
    cols = _spread(q.scales, torch.ones_like(nonzero[:1]).expand(n, -1), per_chunk) <= 3
    tiles = cols.view(n // 16, 16, -1).all(1)  # [tiles, nc]
    row_tiles = rows.view(m // 4, 4, -1).all(1)  # [row tiles, nc]
    pairs = tiles.view(n // 32, 2, -1).all(1)  # [tile pairs, nc]
    if macro > 256:
        return
    both = row_tiles[:, None] & pairs[None]
    assert both.any(), "no chunk folds on both sides"
    assert (~row_tiles[:, None] & pairs[None]).any(), "no chunk folds on the weights only"
    assert (row_tiles[:, None] & ~pairs[None]).any(), "no chunk folds on the rows only"
    assert (rows & ~all_rows).any(), "no row folds only for its zero blocks"
    span_x = _spread(qa.scales, nonzero, per_chunk)
    span_w = _spread(q.scales, torch.ones(n, nb, dtype=torch.bool), per_chunk)
    assert span_x[20, 0] == 4 and span_x[24, 0] == 3, "the rows at the limit moved"
    assert span_w[33, 0] == 4 and span_w[40, 0] == 3, "the weight rows at the limit moved"


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


def test_fma32_rounds_once():
    """fma32 against exact rational arithmetic: random operands, products that cancel c, and
    sums that fall on an fp32 midpoint with a tail (where rounding the float64 sum again would
    be wrong)."""
    from fractions import Fraction

    g = torch.Generator().manual_seed(5)
    a = torch.randn(4000, generator=g) * torch.exp2(torch.randint(-8, 8, (4000,), generator=g))
    b = torch.randn(4000, generator=g)
    c = torch.randn(4000, generator=g)
    c[:1000] = -(a[:1000].double() * b[:1000].double()).float()  # cancellation
    a[1000:1010], b[1000:1010], c[1000:1010] = 1 + 2.0**-23, 1 - 2.0**-24, 0.0  # below a tie
    a[1010], b[1010], c[1010] = 1 + 2.0**-12, 1 + 2.0**-12, 0.0  # 1 + 2^-11 + 2^-24: a tie
    a[1011], b[1011], c[1011] = 1 + 2.0**-12, 1 + 2.0**-12, 2.0**-60  # the tie and a tail
    a[1012], b[1012], c[1012] = 1 + 2.0**-12, 1 + 2.0**-12, -(2.0**-60)
    got = fma32(a, b, c)
    for i in range(a.numel()):
        exact = Fraction(a[i].item()) * Fraction(b[i].item()) + Fraction(c[i].item())
        want = _round_fp32(exact)
        assert got[i].item() == want, (i, a[i].item(), b[i].item(), c[i].item())


def _round_fp32(x) -> float:
    """The fp32 nearest the rational x (ties to even), for normal results."""
    from fractions import Fraction

    if x == 0:
        return 0.0
    sign = -1 if x < 0 else 1
    x = abs(x)
    e = x.numerator.bit_length() - x.denominator.bit_length()
    while Fraction(2) ** e > x:
        e -= 1
    while Fraction(2) ** (e + 1) <= x:
        e += 1
    q = x / Fraction(2) ** (e - 23)  # in [2^23, 2^24)
    n, r = divmod(q.numerator, q.denominator)
    twice = 2 * r
    if twice > q.denominator or (twice == q.denominator and n % 2):
        n += 1
    return sign * float(Fraction(n) * Fraction(2) ** (e - 23))
