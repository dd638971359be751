"""The GEMMs' code -> value decoders (`gemm_blocks.e2m1_value`, `e2m1_pair_values`, and the
word decoders `e2m1_word_values` / `e8m0_word_scales` of the decode GEMM's word path)
against `formats`, bit for bit, over every code, every packed byte and every nibble
position of a word (-0.0 included: compared as fp32 bits), with E8M0 scales from the
subnormal 2^-127 to 2^127 and NaN; the MBS factor and its reciprocal (`quant_blocks.
mbs_factor`, `gemm_blocks.mbs_sigma`) on every MBS byte against `formats` and an IEEE
division. On the GPU two of them run inline PTX (a lop3 select, a Newton-refined
reciprocal, the lifted pair decode's rotations and selects), which the interpreter cannot
run: their definitions are checked here on the CPU by emulation (the lop3 truth table, the
funnel shift; the Newton step's rounding, exactly, for every byte and every starting
reciprocal within 4 ulps).

Runs on CPU under TRITON_INTERPRET=1 (tests/backends/conftest.py) or on CUDA when compiled.
"""

from __future__ import annotations

import re
from fractions import Fraction

import numpy as np
import pytest
import torch

from vllm_mxplus.backends.triton.gemm_blocks import (
    E2M1_PAIR_BITS,
    E2M1_PAIR_MAGNITUDES,
    RCP_NEWTON,
    ROTL_LIFT,
    ROTR_PAIR2,
    ROTR_PAIR3,
    SELECT_BY_MASK,
    SELECT_HIGH_MAGS,
    SELECT_LOW_MAGS,
    e2m1_pair_values,
    e2m1_value,
    e2m1_word_pair_bits,
    e2m1_word_values,
    e8m0_word_scales,
    mbs_sigma,
)
from vllm_mxplus.backends.triton.gemm_launch import dot_dtype
from vllm_mxplus.backends.triton.launch import tl, triton
from vllm_mxplus.backends.triton.quant_blocks import mbs_factor
from vllm_mxplus.formats.e2m1 import e2m1_decode
from vllm_mxplus.formats.mx import mbs_factor as formats_mbs_factor


@triton.jit
def _decode_bytes_kernel(b_ptr, lo_ptr, hi_ptr, nib_lo_ptr, nib_hi_ptr, N: tl.constexpr):
    i = tl.arange(0, N)
    b = tl.load(b_ptr + i).to(tl.int32)
    lo, hi = e2m1_pair_values(b)
    tl.store(lo_ptr + i, lo)
    tl.store(hi_ptr + i, hi)
    tl.store(nib_lo_ptr + i, e2m1_value(b & 15))
    tl.store(nib_hi_ptr + i, e2m1_value(b >> 4))


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.int32)


def test_e2m1_decoders_match_formats_on_every_byte(triton_device):
    device = triton_device
    b = torch.arange(256, dtype=torch.int32).to(torch.uint8).to(device)
    outs = [torch.empty(256, dtype=torch.float32, device=device) for _ in range(4)]
    _decode_bytes_kernel[(1,)](b, *outs, N=256)
    lo, hi, nib_lo, nib_hi = (o.cpu() for o in outs)
    want_lo = e2m1_decode((b.cpu() & 15).to(torch.uint8)).to(torch.float32)
    want_hi = e2m1_decode((b.cpu() >> 4).to(torch.uint8)).to(torch.float32)
    assert torch.equal(_bits(lo), _bits(want_lo))
    assert torch.equal(_bits(hi), _bits(want_hi))
    assert torch.equal(_bits(nib_lo), _bits(want_lo))
    assert torch.equal(_bits(nib_hi), _bits(want_hi))
    # the check can fail: code 8 is -0.0, whose bits differ from +0.0's
    assert not torch.equal(_bits(want_lo), _bits(want_lo.abs()))


@triton.jit
def _decode_words_kernel(q_ptr, s_ptr, out_ptr, R: tl.constexpr, W: tl.constexpr,
                         BS: tl.constexpr, DOT_DTYPE: tl.constexpr):  # fmt: skip
    """out[p, r, c] = value of column c of word tile p (`e2m1_word_values`) x its scale."""
    r = tl.arange(0, R)[:, None]
    q = tl.load(q_ptr + r * W + tl.arange(0, W)[None, :])
    nb: tl.constexpr = W * 8 // BS
    s = tl.load(s_ptr + r * nb + tl.arange(0, nb)[None, :]).to(tl.int32)
    sv = e8m0_word_scales(s, BS // 8, DOT_DTYPE)
    c = tl.arange(0, 2 * W)[None, :]
    for p in tl.static_range(4):
        v = e2m1_word_values(q, p, DOT_DTYPE) * sv
        tl.store(out_ptr + p * R * 2 * W + r * 2 * W + c, v.to(tl.float32))


def _word_reference(codes: torch.Tensor, scales: torch.Tensor, bs: int) -> torch.Tensor:
    """[4, R, 2W]: element 8j + p + 4h of each row at [p, r, 2j + h], x 2^(scale - 127)."""
    rows, k = codes.shape
    v = e2m1_decode(codes.to(torch.uint8)).to(torch.float64)
    e = scales.to(torch.float64)
    sv = torch.where(scales == 255, torch.nan, torch.exp2(e - 127.0))
    v = (v * sv.repeat_interleave(bs, dim=1)).to(torch.float32)
    # element 8j + 4h + p -> [p, r, j, h]
    return v.view(rows, k // 8, 2, 4).permute(3, 0, 1, 2).reshape(4, rows, k // 4)


@pytest.mark.filterwarnings("ignore:overflow encountered:RuntimeWarning")  # 6 x 2^127: Inf
@pytest.mark.parametrize("bs", [16, 32])
def test_word_decoders_match_formats_in_every_nibble(triton_device, bs):
    rows, w = 64, 16  # 128 codes per row
    gen = torch.Generator().manual_seed(bs)
    codes = torch.randint(0, 16, (rows, w * 8), generator=gen)
    codes[:16] = torch.arange(16).repeat(16, w * 8 // 16)  # every code in every position
    scales = torch.randint(100, 150, (rows, w * 8 // bs), generator=gen)
    scales[:, 0] = torch.tensor([0, 1, 2, 126, 127, 128, 253, 254, 255] * 8)[:rows]
    packed = (codes[:, 0::2] | (codes[:, 1::2] << 4)).to(torch.uint8)
    words = packed.view(torch.int32)  # 4 bytes per word, little-endian: element 8j + p in nibble p
    out = torch.empty(4, rows, 2 * w, dtype=torch.float32, device=triton_device)
    _decode_words_kernel[(1,)](
        words.to(triton_device), scales.to(torch.uint8).to(triton_device), out, R=rows, W=w,
        BS=bs, DOT_DTYPE=dot_dtype(),
    )  # fmt: skip
    got = out.cpu()
    want = _word_reference(codes, scales, bs)
    nan = want.isnan()
    assert torch.equal(got.isnan(), nan)
    bad = _bits(got)[~nan] != _bits(want)[~nan]
    assert not bad.any(), f"{int(bad.sum())} values differ"
    # the check can fail: the permutation matters (tile 1 is not tile 0) and so does the sign
    assert not torch.equal(want[0].nan_to_num(), want[1].nan_to_num())
    assert (_bits(want) == _bits(torch.tensor(-0.0))).any()


@triton.jit
def _sigma_kernel(m_ptr, f_ptr, s_ptr, N: tl.constexpr, DOT_DTYPE: tl.constexpr,
                  FMA: tl.constexpr):  # fmt: skip
    i = tl.arange(0, N)
    f = mbs_factor(tl.load(m_ptr + i), FMA)
    tl.store(f_ptr + i, f)
    tl.store(s_ptr + i, mbs_sigma(f, True, tl.bfloat16 == DOT_DTYPE))  # the GPU: Newton


@pytest.mark.parametrize("fma", [False, True], ids=["add-mul", "fma"])
def test_mbs_factor_and_sigma_on_every_byte(fma, triton_device):
    """F = 1 + m/256 in either of `mbs_factor`'s forms equals `formats`' F, and sigma the IEEE
    fp32(1 / F), for all 256 MBS bytes (on the GPU: the Newton-refined reciprocal)."""
    m = torch.arange(256, dtype=torch.int32).to(torch.uint8)
    f = torch.empty(256, dtype=torch.float32, device=triton_device)
    sigma = torch.empty_like(f)
    _sigma_kernel[(1,)](m.to(triton_device), f, sigma, N=256, DOT_DTYPE=dot_dtype(), FMA=fma)
    want_f = formats_mbs_factor(m)
    want_sigma = torch.from_numpy(np.float32(1.0) / want_f.numpy())  # IEEE on the CPU
    assert torch.equal(_bits(f.cpu()), _bits(want_f))
    assert torch.equal(_bits(sigma.cpu()), _bits(want_sigma))
    # the check can fail: the reciprocal is not exact (1 / 1.5 rounds)
    assert float(want_sigma[128]) * 1.5 != 1.0


def _exponent(a: Fraction) -> int:
    """e with 2^23 <= a * 2^e < 2^24 (a > 0): a's fp32 ulp is 2^-e."""
    e = 0
    while a * 2**e < 2**23:
        e += 1
    while a * 2**e >= 2**24:
        e -= 1
    return e


def _rn_f32(x: Fraction) -> Fraction:
    """x rounded to the nearest fp32, ties to even (normal range)."""
    if x == 0:
        return x
    e = _exponent(abs(x))
    q = abs(x) * 2**e
    n = q.numerator // q.denominator
    rest = q - n
    if rest > Fraction(1, 2) or (rest == Fraction(1, 2) and n % 2):
        n += 1
    return (1 if x > 0 else -1) * Fraction(n, 2**e)


def _newton(f: Fraction, r: Fraction) -> Fraction:
    """`RCP_NEWTON` after its reciprocal r: e = fma(-f, r, 1), then fma(r, e, r), each
    rounded once (fp32 FMA), computed exactly."""
    return _rn_f32(r + r * _rn_f32(1 - f * r))


def test_sigma_newton_step_rounds_correctly_for_every_byte():
    """The GPU's sigma (`RCP_NEWTON`): from any starting reciprocal within 4 ulps of 1 / F
    (the approximate reciprocal is within about 1), one Newton step in two fp32 FMAs gives
    fp32(1 / F) exactly, for every MBS byte: the argument of docs/numerics.md computed out,
    with exact rational arithmetic. The PTX is the one these lines emulate."""
    assert re.search(r"rcp\.approx\.ftz\.f32 r, \$1;.*neg\.f32 n, \$1;.*fma\.rn\.f32 e, n, r,"
                     r" 0f3F800000;.*fma\.rn\.f32 \$0, r, e, r;", RCP_NEWTON.value)  # fmt: skip
    far = 0
    for m in range(256):
        f = Fraction(256 + m, 256)
        want = _rn_f32(1 / f)
        ulp = Fraction(1, 2 ** _exponent(want))
        for k in range(-4, 5):
            assert _newton(f, want + k * ulp) == want, (m, k)
        far += _newton(f, want + 2**12 * ulp) != want
    # the check can fail: from 2^12 ulps away (error 2^-12, squared 2^-24) one step is not
    # always enough
    assert far > 0


def _lop3(a: int, b: int, c: int, lut: int) -> int:
    """PTX lop3.b32: bit i of the result is bit (a_i << 2 | b_i << 1 | c_i) of the table."""
    out = 0
    for i in range(32):
        idx = ((a >> i) & 1) << 2 | ((b >> i) & 1) << 1 | ((c >> i) & 1)
        out |= ((lut >> idx) & 1) << i
    return out


def test_select_by_mask_is_the_interpreters_select():
    """`SELECT_BY_MASK` (the GPU's lop3 in `e2m1_word_pair_bits`) computes
    (mag & E2M1_PAIR_MAGNITUDES) | (sgn & ~E2M1_PAIR_MAGNITUDES), the expression the
    interpreter runs, on random words."""
    mt = re.fullmatch(
        r"lop3\.b32 \$0, \$1, \$2, (0x[0-9A-Fa-f]+), (0x[0-9A-Fa-f]+);", SELECT_BY_MASK.value
    )
    assert mt, SELECT_BY_MASK.value
    mask, lut = int(mt.group(1), 16), int(mt.group(2), 16)
    assert mask == E2M1_PAIR_MAGNITUDES.value
    rng = np.random.default_rng(0)
    for a, b in rng.integers(0, 2**32, size=(200, 2), dtype=np.uint64).tolist():
        assert _lop3(a, b, mask, lut) == (a & mask) | (b & ~mask & 0xFFFFFFFF)
    # the check can fail: another table (c ? b : a) gives other bits
    assert _lop3(0xFFFFFFFF, 0, mask, 0xD8) != mask


def _pair_bits_reference(words: np.ndarray, p: int) -> np.ndarray:
    """uint32 bf16x2 bits of nibbles p (low half) and p + 4 (high half) of each word: the
    magnitude (code & 7) on bits 6..8 of its half, the sign (code & 8) on bit 15, as
    `e2m1_value` lays a code into a float's fields (times 2^-126)."""
    out = np.zeros_like(words)
    for h in range(2):
        n = (words >> np.uint32(4 * (p + 4 * h))) & np.uint32(15)
        half = ((n & np.uint32(7)) << np.uint32(6)) | ((n & np.uint32(8)) << np.uint32(12))
        out |= half << np.uint32(16 * h)
    return out


def _pair_words(n: int, seed: int) -> np.ndarray:
    """Random uint32 words, the first 4096 holding every pair of codes in every nibble pair."""
    rng = np.random.default_rng(seed)
    words = rng.integers(0, 2**32, size=n, dtype=np.uint64).astype(np.uint32)
    c = np.arange(256, dtype=np.uint32)
    for p in range(4):  # codes (c & 15, c >> 4) in nibbles (p, p + 4) of words 256p..
        w = words[256 * p : 256 * (p + 1)] & ~np.uint32((15 << 4 * p) | (15 << 4 * (p + 4)))
        words[256 * p : 256 * (p + 1)] = (
            w
            | ((c & np.uint32(15)) << np.uint32(4 * p))
            | ((c >> np.uint32(4)) << np.uint32(4 * (p + 4)))
        )
    return words


@triton.jit
def _pair_bits_kernel(q_ptr, out_ptr, N: tl.constexpr, LIFT: tl.constexpr):
    i = tl.arange(0, N)
    q = tl.load(q_ptr + i)
    for p in tl.static_range(4):
        tl.store(out_ptr + p * N + i, e2m1_word_pair_bits(q, p, False, LIFT))


@pytest.mark.parametrize("lift", [False, True], ids=["signs-apart", "signs-lifted"])
def test_pair_bits_both_constructions_in_every_nibble(triton_device, lift):
    """`e2m1_word_pair_bits`, signs apart and signs lifted (the interpreter's plain integer
    operations; on the GPU the compiler's), give every pair of nibbles' bf16 fields and
    nothing else, with random bits in the other nibbles."""
    n = 8192
    words = _pair_words(n, 1)
    out = torch.empty(4 * n, dtype=torch.int32, device=triton_device)
    q = torch.from_numpy(words.view(np.int32)).to(triton_device)
    _pair_bits_kernel[(1,)](q, out, N=n, LIFT=lift)
    got = out.cpu().numpy().view(np.uint32).reshape(4, n)
    for p in range(4):
        want = _pair_bits_reference(words, p)
        assert np.array_equal(got[p], want), f"pair {p}: {int((got[p] != want).sum())} words differ"
    # the check can fail: pairs 0 and 1 of these words differ, and so do their signs
    assert not np.array_equal(_pair_bits_reference(words, 0), _pair_bits_reference(words, 1))


def _shf_wrap(a: int, n: int, left: bool) -> int:
    """PTX shf.{l,r}.wrap.b32 d, a, a, n: a rotated by n mod 32."""
    n %= 32
    if not left:
        n = (32 - n) % 32
    return ((a << n) | (a >> (32 - n))) & 0xFFFFFFFF if n else a


def _asm_lop3(text: str) -> tuple[int, int]:
    mt = re.fullmatch(r"lop3\.b32 \$0, \$1, \$2, (0x[0-9A-Fa-f]+), (0x[0-9A-Fa-f]+);", text)
    assert mt, text
    return int(mt.group(1), 16), int(mt.group(2), 16)


def _asm_shf(text: str) -> tuple[bool, int]:
    mt = re.fullmatch(r"shf\.([lr])\.wrap\.b32 \$0, \$1, \$1, (\d+);", text)
    assert mt, text
    return mt.group(1) == "l", int(mt.group(2))


def _lifted_on_gpu(q: int, p: int) -> int:
    """`e2m1_lifted_pair_bits`' ASM branch, instruction by instruction, on one word."""
    left, n = _asm_shf(ROTL_LIFT.value)
    q6 = _shf_wrap(q, n, left)
    mask, lut = _asm_lop3((SELECT_LOW_MAGS if p < 2 else SELECT_HIGH_MAGS).value)
    u = _lop3(q, q6, mask, lut)
    if p < 2:
        r = (u << (6 - 4 * p)) & 0xFFFFFFFF
    else:
        left, n = _asm_shf((ROTR_PAIR2 if p == 2 else ROTR_PAIR3).value)
        r = _shf_wrap(u, n, left)
    return r & (E2M1_PAIR_BITS.value & 0xFFFFFFFF)


def test_lifted_pair_bits_gpu_instructions_by_emulation():
    """The PTX of the lifted construction (a funnel-shift rotation, two lop3 selects, the
    pair rotations), emulated from its strings, gives the reference bits on words holding
    every pair of codes in every nibble pair (random bits elsewhere)."""
    assert _asm_shf(ROTL_LIFT.value) == (True, 6)
    words = _pair_words(4096 + 512, 2).tolist()
    for p in range(4):
        want = _pair_bits_reference(np.array(words, dtype=np.uint32), p).tolist()
        got = [_lifted_on_gpu(q, p) for q in words]
        assert got == want, f"pair {p}"
    # the check can fail: without the wrap, pair 3's high sign (from bit 5) is lost
    q = 1 << 31  # nibble 7's sign
    assert _lifted_on_gpu(q, 3) == 1 << 31
    assert (_lop3(q, _shf_wrap(q, 6, True), *_asm_lop3(SELECT_HIGH_MAGS.value)) >> 6) & (
        1 << 31
    ) == 0
