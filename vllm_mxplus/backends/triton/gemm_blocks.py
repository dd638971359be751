"""Triton device functions of the GEMMs (`triton_decode_gemm`, `triton_mx_gemm`): code ->
value decoders that build exact fp32 values from bits, and the pair of dots over the even
and the odd elements that every K step runs.

The values are exact in fp32 and in bf16 (docs/numerics.md, "Kernel numerics and error
bounds"), so the tensor-core dots form exact products; the module docstrings of the two
GEMMs say how the partial sums are scaled.
"""

from __future__ import annotations

from vllm_mxplus.backends.triton.launch import tl, triton
from vllm_mxplus.backends.triton.quant_blocks import mbs_factor

# Globals read inside kernels must be tl.constexpr (Triton rejects plain globals).
E4M3_SUB_STEP = tl.constexpr(2.0**-9)  # the E4M3 subnormal step
E2M1_REBIAS = tl.constexpr(2.0**126)  # E2M1 bits in fp32's fields -> the E2M1 value (exact)
E2M1_PAIR_MAGNITUDES = tl.constexpr(0x01C001C0)  # bits 6..8 and 22..24 of a bf16x2 word
# `e2m1_lifted_pair_bits`: the sign and magnitude bits of a bf16x2 pair of E2M1 values (bits
# 6..8, 15, 22..24, 31), the magnitude bits of nibbles 0, 1, 4, 5 and of 2, 3, 6, 7, and the
# rotation that lifts each nibble's sign bit 6 places
E2M1_PAIR_BITS = tl.constexpr(-0x7E3F7E40)  # 0x81C081C0 as int32
E2M1_LOW_MAGS = tl.constexpr(0x00770077)
E2M1_HIGH_MAGS = tl.constexpr(0x77007700)
E2M1_SIGN_LIFT = tl.constexpr(6)
# the sign bits of the even nibbles (bits 3, 11, 19, 27) and of the odd ones (7, 15, 23, 31)
E2M1_EVEN_SIGNS = tl.constexpr(0x08080808)
E2M1_ODD_SIGNS = tl.constexpr(-0x7F7F7F80)  # 0x80808080 as int32
# a * b on packed bf16 pairs as fma(a, b, -0.0): exactly the product (-0.0 keeps a -0 product's
# sign), one HFMA2 / HMUL2; PTX mul.bf16x2 itself needs sm_90, fma.rn.bf16x2 runs from sm_80
BF16X2_MUL = tl.constexpr("{ .reg .b32 z; mov.b32 z, 0x80008000; fma.rn.bf16x2 $0, $1, $2, z; }")
# r + r (1 - F r) from the approximate reciprocal r of F: `mbs_sigma` (written out, so that
# the negation folds into the FMA: the compiler's own lowering kept a separate negate)
RCP_NEWTON = tl.constexpr(
    "{ .reg .f32 r, e, n; rcp.approx.ftz.f32 r, $1; neg.f32 n, $1;"
    " fma.rn.f32 e, n, r, 0f3F800000; fma.rn.f32 $0, r, e, r; }"
)
# $1 where E2M1_PAIR_MAGNITUDES has a bit, else $2: lop3's table for c ? a : b (a = 0xF0,
# b = 0xCC, c = 0xAA) is 0xE4 (`e2m1_word_pair_bits`)
SELECT_BY_MASK = tl.constexpr(f"lop3.b32 $0, $1, $2, {E2M1_PAIR_MAGNITUDES.value:#010x}, 0xE4;")
# `e2m1_lifted_pair_bits` on the GPU: q rotated left by E2M1_SIGN_LIFT; $1 at the magnitude
# bits of nibbles 0, 1, 4, 5 (2, 3, 6, 7), else $2; rotations right by 2 and 6 (P = 2, 3)
ROTL_LIFT = tl.constexpr(f"shf.l.wrap.b32 $0, $1, $1, {E2M1_SIGN_LIFT.value};")
SELECT_LOW_MAGS = tl.constexpr(f"lop3.b32 $0, $1, $2, {E2M1_LOW_MAGS.value:#010x}, 0xE4;")
SELECT_HIGH_MAGS = tl.constexpr(f"lop3.b32 $0, $1, $2, {E2M1_HIGH_MAGS.value:#010x}, 0xE4;")
ROTR_PAIR2 = tl.constexpr("shf.r.wrap.b32 $0, $1, $1, 2;")
ROTR_PAIR3 = tl.constexpr("shf.r.wrap.b32 $0, $1, $1, 6;")
# NVFP4's folded weight scales (`e4m3_fold_scales`): 2^126 * scale * 2^-E4M3_FOLD_LOG2, from
# the bf16 of scale * 2^-120 by two exact multiplies (2^127 * 2^111 = 2^(120 + 126 - 8))
E4M3_FOLD_LOG2 = 8
E4M3_FOLD_UNDO = tl.constexpr(2.0**E4M3_FOLD_LOG2)  # what the folded sums are multiplied by
E4M3_FOLD_STEP_1 = tl.constexpr(2.0**127)
E4M3_FOLD_STEP_2 = tl.constexpr(2.0**111)
E4M3_FOLD_MUL = tl.constexpr(
    "{ .reg .b32 z, a, b, t; mov.b32 z, 0x80008000; mov.b32 a, 0x7F007F00;"
    " mov.b32 b, 0x77007700; fma.rn.bf16x2 t, $1, a, z; fma.rn.bf16x2 $0, t, b, z; }"
)
BF16_NAN_BITS = tl.constexpr(0x7FC0)
LOW_HALF = tl.constexpr(0xFFFF)
HIGH_HALF = tl.constexpr(-0x10000)  # 0xFFFF0000 as int32
SUM_PIECE = tl.constexpr(512)  # outputs per piece of `reduce_split_tile`'s sum (its docstring)
# programmatic dependent launch (PTX griddepcontrol, sm_90+; `launch.pdl_launch`): wait until
# the grid launched before this one in the stream has finished and its writes are visible;
# let the grid launched after this one start its programs (they wait at their own GRID_WAIT).
# Both are no-ops in a launch that did not ask for it. ($0: an unused output register.)
GRID_WAIT = tl.constexpr("griddepcontrol.wait; // $0")
LAUNCH_DEPENDENTS = tl.constexpr("griddepcontrol.launch_dependents; // $0")


@triton.jit
def wait_prior_grid():
    """GRID_WAIT: before any global access of a kernel launched with `launch_pdl`."""
    tl.inline_asm_elementwise(GRID_WAIT, "=r", [], dtype=tl.int32, is_pure=False, pack=1)


@triton.jit
def launch_dependents():
    """LAUNCH_DEPENDENTS: the next kernel's programs may start (each waits in GRID_WAIT)."""
    tl.inline_asm_elementwise(LAUNCH_DEPENDENTS, "=r", [], dtype=tl.int32, is_pure=False, pack=1)


@triton.jit
def e2m1_value(c):
    """fp32 value of E2M1 codes c (int32, 0..15): magnitudes 0, .5, 1, ..., 6; code 8 is -0.0.

    With e = (c & 7) >> 1 and m = c & 1, the bits (c & 7) << 22 are the fp32 with exponent
    field e and mantissa m/2: 2^(e-127) * (1 + m/2) for e >= 1, the subnormal m * 2^-127 for
    e = 0. One multiply by 2^126 is exact and gives 2^(e-1) * (1 + m/2), resp. m/2: the E2M1
    magnitudes (PTX mul.f32 without .ftz keeps subnormal operands).
    """
    bits = ((c & 7) << 22) | ((c & 8) << 28)
    return bits.to(tl.float32, bitcast=True) * E2M1_REBIAS


@triton.jit
def e2m1_pair_values(b):
    """(value of the low nibble, value of the high nibble) of packed E2M1 bytes b (int32,
    0..255) as `e2m1_value` builds them, each nibble's bits moved straight from the byte into
    the fp32 exponent / mantissa / sign fields (no separate nibble extraction)."""
    lo = ((b & 7) << 22) | ((b & 8) << 28)
    hi = ((b & 0x70) << 18) | ((b & 0x80) << 24)
    return (
        lo.to(tl.float32, bitcast=True) * E2M1_REBIAS,
        hi.to(tl.float32, bitcast=True) * E2M1_REBIAS,
    )


@triton.jit
def bf16_values(v, DOT_DTYPE: tl.constexpr):
    """bf16 values v as DOT_DTYPE: themselves on the GPU; under the interpreter (fp32) from
    the bits (bf16 is fp32's top half), since its bf16 -> fp32 conversion loses subnormals."""
    if DOT_DTYPE == tl.float32:  # noqa: SIM300 (DOT_DTYPE is a parameter, not a constant)
        v = (v.to(tl.int16, bitcast=True).to(tl.int32) << 16).to(tl.float32, bitcast=True)
    return v


@triton.jit
def word_halves(wd, DOT_DTYPE: tl.constexpr):
    """The two 16-bit halves of int32 words wd [R, W], each a bf16 bit pattern, as DOT_DTYPE
    values [R, 2W] (column 2j + h: half h of word j). On the GPU (bf16) a reinterpretation:
    a 32-bit register holding both halves is the packed bf16x2 operand of the multiplies that
    follow (HMUL2, one instruction per two values). Under the interpreter (fp32, whose bf16
    arithmetic is wrong) the same bits become the top half of an fp32: the same value, since
    bf16 is fp32's top 16 bits."""
    if DOT_DTYPE == tl.bfloat16:  # noqa: SIM300 (DOT_DTYPE is a parameter, not a constant)
        lo = (wd & LOW_HALF).to(tl.int16).to(tl.bfloat16, bitcast=True)
        hi = (wd >> 16).to(tl.int16).to(tl.bfloat16, bitcast=True)
    else:
        lo = (wd << 16).to(tl.float32, bitcast=True)
        hi = (wd & HIGH_HALF).to(tl.float32, bitcast=True)
    return tl.reshape(tl.join(lo, hi), (wd.shape[0], wd.shape[1] * 2))


@triton.jit
def e2m1_word_pair_bits(q, P: tl.constexpr, ASM: tl.constexpr, LIFT: tl.constexpr = False):
    """int32 words whose halves are the bf16 bits of nibbles P and P + 4 of words q, the
    E2M1 values times 2^-126 (`e2m1_word_values` before its multiply): nibble P's magnitude
    bits on bits 6..8 (nibble P + 4's on 22..24, E2M1_PAIR_MAGNITUDES), its sign on bit 15
    (P + 4's on 31). Two constructions of the same bits:

    - Signs apart (LIFT False): one shift of q moves the magnitudes; the sign bits come from
      q masked to the sign bits of the nibbles of P's parity (one mask per parity and word),
      shifted so that nibble P's lands on bit 15 and nibble P + 4's on bit 31. The shifted
      signs of the other nibbles of that parity land on bits 7 and 23, inside the magnitude
      field, or past bit 31, so one select by the magnitude mask merges the two: 3
      instructions per pair of values (2 for P = 3, whose signs need no shift) and 2 per
      word. Arithmetic right shifts (P >= 2) bring their copies of bit 31 in above bit 25,
      outside the magnitude field.
    - Signs lifted (LIFT True, `e2m1_lifted_pair_bits`): 2 instructions per pair and 3 per
      word (15 per word with the 4 multiplies, where the other takes 17).

    ASM (the GPU only): the selects and rotations written as the LOP3 / SHF.W themselves;
    left to the compiler, the masks were folded back into the shifted word and two LOP3s
    issued (`e2m1_folded_word_values` asks for it where it helps; `e2m1_word_values`, whose
    halves are split and multiplied apart, counts fewer instructions without)."""
    if LIFT:
        return e2m1_lifted_pair_bits(q, P, ASM)
    if P < 2:
        mag = q << (6 - 4 * P)
    else:
        mag = q >> (4 * P - 6)
    if P % 2 == 0:
        sgn = (q & E2M1_EVEN_SIGNS) << (12 - 4 * P)
    else:
        sgn = (q & E2M1_ODD_SIGNS) << (12 - 4 * P)
    if ASM:
        return tl.inline_asm_elementwise(
            SELECT_BY_MASK, "=r,r,r", [mag, sgn], dtype=tl.int32, is_pure=True, pack=1
        )
    return (mag & E2M1_PAIR_MAGNITUDES) | (sgn & ~E2M1_PAIR_MAGNITUDES)


@triton.jit
def _rotate_left(q, N: tl.constexpr):
    """int32 words q rotated left by N bits (0 < N < 32), in plain integer operations."""
    u = q.to(tl.uint32, bitcast=True)
    return ((u << N) | (u >> (32 - N))).to(tl.int32, bitcast=True)


@triton.jit
def e2m1_lifted_pair_bits(q, P: tl.constexpr, ASM: tl.constexpr):
    """`e2m1_word_pair_bits` with the signs lifted once per word. A sign must end 7 bits above
    its nibble's magnitude top bit, where the code has it 1 above; so each word q is merged
    with itself rotated left by 6 (q6: every nibble's sign bit 6 places up). A word u takes
    the magnitude bits of the nibbles of P's quarter pair (nibbles 0, 1, 4, 5 for P < 2, else
    2, 3, 6, 7: E2M1_LOW_MAGS / E2M1_HIGH_MAGS) from q and every other bit from q6, which
    there holds each of those nibbles' sign 7 above its magnitude's top bit (q6's bits at
    the other nibbles' magnitude positions are not needed from u). Then one shift of u
    (P < 2: left by 6 - 4P) or rotation (P >= 2: right by 4P - 6; nibble P + 4's sign wraps
    past bit 31 to bit 4P - 7, where q6 holds it) puts both nibbles' fields in place, and
    one mask (E2M1_PAIR_BITS) clears the rest."""
    if ASM:
        q6 = tl.inline_asm_elementwise(ROTL_LIFT, "=r,r", [q], dtype=tl.int32, is_pure=True,
                                       pack=1)  # fmt: skip
        if P < 2:
            u = tl.inline_asm_elementwise(SELECT_LOW_MAGS, "=r,r,r", [q, q6], dtype=tl.int32,
                                          is_pure=True, pack=1)  # fmt: skip
            r = u << (6 - 4 * P)
        else:
            u = tl.inline_asm_elementwise(SELECT_HIGH_MAGS, "=r,r,r", [q, q6], dtype=tl.int32,
                                          is_pure=True, pack=1)  # fmt: skip
            r = tl.inline_asm_elementwise(ROTR_PAIR2 if P == 2 else ROTR_PAIR3, "=r,r", [u],
                                          dtype=tl.int32, is_pure=True, pack=1)  # fmt: skip
    else:
        q6 = _rotate_left(q, E2M1_SIGN_LIFT)
        if P < 2:
            u = (q & E2M1_LOW_MAGS) | (q6 & ~E2M1_LOW_MAGS)
            r = u << (6 - 4 * P)
        else:
            u = (q & E2M1_HIGH_MAGS) | (q6 & ~E2M1_HIGH_MAGS)
            r = _rotate_left(u, 32 - (4 * P - 6))  # right by 4P - 6
    return r & E2M1_PAIR_BITS


@triton.jit
def e2m1_word_values(q, P: tl.constexpr, DOT_DTYPE: tl.constexpr):
    """Values of nibbles P and P + 4 (P = 0..3) of int32 words q [R, W] of packed E2M1 codes
    (8 per word: element 8j + p is nibble p of word j, the packed layout read 4 bytes at a
    time, little-endian) as DOT_DTYPE [R, 2W]: column 2j + h holds element 8j + P + 4h.

    `e2m1_value`'s construction in bf16's fields (bf16 has fp32's exponent field): one shift
    of the word moves nibble P's magnitude bits to bits 6..8 (lowest exponent bits and top
    mantissa bit) and nibble P + 4's to bits 22..24, another moves their sign bits to 15
    and 31, so each instruction builds two values (`e2m1_word_pair_bits`); then one multiply by
    2^126, exact (PTX mul.bf16x2 keeps subnormal operands: E2M1 code 1 is the subnormal
    2^-127 here)."""
    return word_halves(e2m1_word_pair_bits(q, P, False), DOT_DTYPE) * E2M1_REBIAS


@triton.jit
def e8m0_word_scales(s, WORDS_PER_BLOCK: tl.constexpr, DOT_DTYPE: tl.constexpr):
    """E8M0 scale codes s (int32) [R, NB] of NB consecutive blocks as DOT_DTYPE values
    [R, NB * 2 * WORDS_PER_BLOCK] in `e2m1_word_values`' column order (block b's words
    b * WORDS_PER_BLOCK.. hold columns 2 * WORDS_PER_BLOCK * b..). Powers of two from 2^-127
    to 2^127 and NaN: exact in bf16."""
    return _word_columns(e8m0_value(s).to(DOT_DTYPE), WORDS_PER_BLOCK)


@triton.jit
def block_scale_values(s, NVFP4: tl.constexpr):
    """fp32 values of block scale bytes s (int32): E4M3 (`e4m3_value`) for NVFP4, else E8M0
    (`e8m0_value`)."""
    if NVFP4:
        return e4m3_value(s)
    return e8m0_value(s)


@triton.jit
def block_word_scales(s, WORDS_PER_BLOCK: tl.constexpr, DOT_DTYPE: tl.constexpr,
                      NVFP4: tl.constexpr):  # fmt: skip
    """`e8m0_word_scales`, or for NVFP4 the E4M3 scales s (int32 bytes) [R, NB] likewise:
    values of at most 4 significant bits in [2^-9, 448] and NaN, exact in bf16."""
    if NVFP4:
        return _word_columns(e4m3_value(s).to(DOT_DTYPE), WORDS_PER_BLOCK)
    return e8m0_word_scales(s, WORDS_PER_BLOCK, DOT_DTYPE)


@triton.jit
def e8m0_fold_scales(s, WORDS_PER_BLOCK: tl.constexpr, DOT_DTYPE: tl.constexpr):
    """E8M0 scale codes s (int32) [R, NB], all <= 128 (`decode_gemm.small_weight_scales`), as
    `e2m1_folded_word_values`' multipliers of each block's words [R, NB * WORDS_PER_BLOCK]:
    2^126 * scale = 2^(s - 1). On the GPU (bf16) a packed bf16 pair, (s + 126) << 7 in both
    halves; under the interpreter (fp32) the fp32 value."""
    if DOT_DTYPE == tl.bfloat16:  # noqa: SIM300 (DOT_DTYPE is a parameter, not a constant)
        sc = _word_columns_i32(((s + 126) << 7) * 0x10001, WORDS_PER_BLOCK)
    else:
        sc = _word_columns_i32(((s + 126) << 23), WORDS_PER_BLOCK).to(tl.float32, bitcast=True)
    return sc


@triton.jit
def e4m3_fold_scales(s, WORDS_PER_BLOCK: tl.constexpr, DOT_DTYPE: tl.constexpr):
    """NVFP4's E4M3 scale bytes s (int32 0..255) [R, NB] as `e2m1_folded_word_values`'
    multipliers of each block's words: 2^126 * scale * 2^-E4M3_FOLD_LOG2, so that the folded
    weight values are value * scale * 2^-E4M3_FOLD_LOG2 (the caller multiplies its sums by
    2^E4M3_FOLD_LOG2, exactly). Every E4M3 value times 2^(126 - 8) is a normal bf16 (2^109
    to 448 * 2^118 < 2^127), and the products value * scale have at most 6 significant bits
    and lie in [2^-18, 10.5]: exact in bf16.

    Built from the bits: the byte's magnitude shifted into bf16's fields (E4M3's exponent
    and mantissa on bf16's lowest exponent and top mantissa bits) is the bf16 of
    scale * 2^-120, subnormals included (E4M3's subnormal m * 2^-9 becomes bf16's subnormal
    m * 2^-129), its sign bit moved to bit 15, NaN (0x7F / 0xFF) the bf16 NaN; then two
    exact multiplies by 2^127 and 2^111 (E4M3_FOLD_STEPS: a subnormal operand times a power
    of two, kept by PTX's bf16x2 FMA). On the GPU a packed bf16 pair per block; under the
    interpreter (fp32) the same bits as the top half of an fp32, multiplied in fp32."""
    mag = s & 0x7F
    raw = (mag << 4) | ((s & 0x80) << 8)
    raw = tl.where(mag == 0x7F, BF16_NAN_BITS, raw)
    if DOT_DTYPE == tl.bfloat16:  # noqa: SIM300 (DOT_DTYPE is a parameter, not a constant)
        pair = tl.inline_asm_elementwise(
            E4M3_FOLD_MUL, "=r,r", [raw * 0x10001], dtype=tl.int32, is_pure=True, pack=1
        )
        sc = _word_columns_i32(pair, WORDS_PER_BLOCK)
    else:
        v = (raw << 16).to(tl.float32, bitcast=True) * E4M3_FOLD_STEP_1 * E4M3_FOLD_STEP_2
        sc = _word_columns_i32(v.to(tl.int32, bitcast=True), WORDS_PER_BLOCK).to(
            tl.float32, bitcast=True
        )
    return sc


@triton.jit
def e2m1_folded_word_values(q, sc, P: tl.constexpr, DOT_DTYPE: tl.constexpr,
                            ASM: tl.constexpr = False, LIFT: tl.constexpr = False):  # fmt: skip
    """`e2m1_word_values` of int32 words q [R, W] times their blocks' scales, with the
    E2M1 rebias folded into the scale: sc [R, W] from `e8m0_fold_scales` (2^126 * scale,
    E8M0 codes <= 128) or `e4m3_fold_scales` (NVFP4, 2^126 * scale * 2^-E4M3_FOLD_LOG2). One
    multiply per two values, exact (the product is the same representable value).

    On the GPU the multiply is one bf16x2 instruction (`BF16X2_MUL`) on the packed word and
    the packed pair of its scale: the pairing of halves is the word's, so no register
    shuffles (left to the compiler, the bf16 multiplies of `word_halves`' values were paired
    across words and their halves swapped back, one PRMT per pair)."""
    bits = e2m1_word_pair_bits(q, P, ASM and tl.bfloat16 == DOT_DTYPE, LIFT)
    if DOT_DTYPE == tl.bfloat16:  # noqa: SIM300 (DOT_DTYPE is a parameter, not a constant)
        prod = tl.inline_asm_elementwise(
            BF16X2_MUL, "=r,r,r", [bits, sc], dtype=tl.int32, is_pure=True, pack=1
        )
        v = word_halves(prod, DOT_DTYPE)
    else:
        v = word_halves(bits, DOT_DTYPE) * _word_columns_f32(sc)
    return v


@triton.jit
def _word_columns_i32(v, WORDS_PER_BLOCK: tl.constexpr):
    """Per-block int32 values v [R, NB] repeated over each block's WORDS_PER_BLOCK words."""
    v = tl.broadcast_to(v[:, :, None], (v.shape[0], v.shape[1], WORDS_PER_BLOCK))
    return tl.reshape(v, (v.shape[0], v.shape[1] * WORDS_PER_BLOCK))


@triton.jit
def _word_columns_f32(v):
    """Per-word values v [R, W] repeated over each word's two columns (`word_halves`')."""
    v = tl.broadcast_to(v[:, :, None], (v.shape[0], v.shape[1], 2))
    return tl.reshape(v, (v.shape[0], v.shape[1] * 2))


@triton.jit
def _word_columns(v, WORDS_PER_BLOCK: tl.constexpr):
    """Per-block values v [R, NB] repeated over each block's 2 * WORDS_PER_BLOCK columns."""
    cols: tl.constexpr = 2 * WORDS_PER_BLOCK
    v = tl.broadcast_to(v[:, :, None], (v.shape[0], v.shape[1], cols))
    return tl.reshape(v, (v.shape[0], v.shape[1] * cols))


@triton.jit
def e8m0_value(code):
    """fp32 2^(code - 127) from the bits; code 0 is the subnormal 2^-127, code 255 is NaN."""
    bits = tl.where(code == 0, 1 << 22, code << 23)
    bits = tl.where(code == 255, 0x7FC00000, bits)
    return bits.to(tl.float32, bitcast=True)


@triton.jit
def e4m3_value(b):
    """fp32 value of float8_e4m3fn bytes b (int32 0..255): normal (8 + m) * 2^(e - 10), the
    subnormal m * 2^-9, 0x7F / 0xFF NaN; exact (built from the bits)."""
    e = (b >> 3) & 15
    mnt = b & 7
    normal = (((e + 120) << 23) | (mnt << 20)).to(tl.float32, bitcast=True)
    v = tl.where(e == 0, mnt.to(tl.float32) * E4M3_SUB_STEP, normal)
    v = tl.where((b & 0x80) != 0, -v, v)
    return tl.where((b & 0x7F) == 0x7F, float("nan"), v)


@triton.jit
def mbs_factors(x_ptrs, w_ptrs, valid, mask_m, mask_n, X_MBS: tl.constexpr, W_MBS: tl.constexpr,
                W_FMA: tl.constexpr = False):  # fmt: skip
    """(Fx [BLOCK_M], Fw [BLOCK_N]): the MBS factors F = 1 + m/256 of one macro block of the
    tile's x and weight rows, their bytes at x_ptrs / w_ptrs; 1 for an operand without MBS
    (nothing read), and 1 where `valid` is False (a macro block past K: nothing to read).
    W_FMA: the weight's in `mbs_factor`'s FMA form (the caller's choice, by count)."""
    fx = tl.full(mask_m.shape, 1.0, tl.float32)
    fw = tl.full(mask_n.shape, 1.0, tl.float32)
    if X_MBS:
        fx = mbs_factor(tl.load(x_ptrs, mask=mask_m & valid, other=0))
    if W_MBS:
        fw = mbs_factor(tl.load(w_ptrs, mask=mask_n & valid, other=0), W_FMA)
    return fx, fw


@triton.jit
def mbs_sigma(f, HAS_MBS: tl.constexpr, NEWTON: tl.constexpr):
    """sigma = fp32(1 / F), the correctly rounded reciprocal, of `mbs_factors`' F = 1 + m/256;
    1 for an operand without MBS (the paper's per-chunk sigma_A, sigma_B, section 4.3.2).

    NEWTON (the GPU only, inline PTX): one approximate reciprocal (MUFU.RCP, relative error below
    2^-22) and one Newton step in two FMAs (`RCP_NEWTON`, inline PTX): its result is within
    about 2^-44 of 1 / F, and 256 / (256 + m) lies at least 2^-34 (relatively) from every
    rounding boundary of fp32 for m = 1..255 (m = 0: exactly 1), so the step's rounding is
    the correct one (docs/numerics.md, "Kernel numerics and error bounds"); an IEEE division
    (`div_rn`; the default `/` lowers to the approximate div.full.f32) adds a check and a
    branch to a slow path to the same three instructions. Else (and under the interpreter)
    `div_rn`: the decode GEMM's byte path keeps it (with the Newton step ptxas spilled a
    narrow-macro-block tile on sm_80)."""
    if HAS_MBS:
        if NEWTON:
            f = tl.inline_asm_elementwise(
                RCP_NEWTON, "=f,f", [f], dtype=tl.float32, is_pure=True, pack=1
            )
        else:
            f = tl.math.div_rn(tl.full(f.shape, 1.0, tl.float32), f)
    return f


@triton.jit
def dot_f32(x, w, acc, DOT_DTYPE: tl.constexpr):
    """acc + x @ w in fp32, operands in DOT_DTYPE (`gemm_launch.dot_dtype`): bf16 on the GPU,
    whose tensor-core products of these values are exact; fp32 under the interpreter (its
    bf16 is wrong), multiplied in IEEE fp32."""
    if DOT_DTYPE == tl.float32:  # noqa: SIM300 (DOT_DTYPE is a parameter, not a constant)
        acc = tl.dot(x, w, acc, input_precision="ieee", out_dtype=tl.float32)
    else:
        acc = tl.dot(x, w, acc, out_dtype=tl.float32)
    return acc


@triton.jit
def pair_dot(x_lo, x_hi, w_lo, w_hi, acc, DOT_DTYPE: tl.constexpr):
    """acc + x_lo @ w_lo + x_hi @ w_hi in fp32 (`dot_f32`): the packed layout's even and odd
    elements (element 2i in the low nibble of byte i), so the kernels never interleave them."""
    acc = dot_f32(x_lo, w_lo, acc, DOT_DTYPE)
    return dot_f32(x_hi, w_hi, acc, DOT_DTYPE)


@triton.jit
def macro_block_dot(
    x_lo, x_hi, w_lo, w_hi, j, MACRO: tl.constexpr, BLOCK_K: tl.constexpr, DOT_DTYPE: tl.constexpr
):
    """`pair_dot` from zero over macro block j of a K step of BLOCK_K > MACRO elements: x's
    columns of the step's other macro blocks zeroed (x is the small operand; the weight tile
    is loaded and dequantized once per step), so each macro block's partial can be scaled
    by its own factors (docs/numerics.md, "Kernel numerics and error bounds")."""
    sel = tl.arange(0, BLOCK_K // 2)[None, :] // (MACRO // 2) == j
    acc = tl.zeros((x_lo.shape[0], w_lo.shape[1]), tl.float32)
    acc = dot_f32(tl.where(sel, x_lo, 0.0).to(DOT_DTYPE), w_lo, acc, DOT_DTYPE)
    return dot_f32(tl.where(sel, x_hi, 0.0).to(DOT_DTYPE), w_hi, acc, DOT_DTYPE)


@triton.jit
def reduce_split_tile(
    part_ptr,
    acc,
    bias_ptr,
    y_ptr,
    cnt_ptr,
    m0,
    n0,
    M,
    N,
    pid_s,
    stride_os,
    stride_om,
    stride_ym,
    HAS_BIAS: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    MAX_SPLIT: tl.constexpr,
):
    """The split-K sum inside the GEMM's launch. K slice pid_s stores its fp32 partial acc
    [BLOCK_M, BLOCK_N] of rows m0.. and columns n0.. (consecutive rows: not the grouped
    experts' gathered ones) in its plane of part_ptr, as `store_out_tile` does, and counts
    itself in the tile's counter (cnt_ptr + tile, tile = program_id(2) * num_programs(0) +
    program_id(0)); the last slice to arrive sums the planes in slice order, (p[0] + p[1]) +
    ... + p[split - 1] (+ bias), as `gemm_launch.finish_output` does: the same bits, one
    launch fewer. It then sets the counter back to 0 for the next launch
    (`gemm_launch.split_counters`).

    Ordering, as CUTLASS's split-K semaphore: a CTA barrier after every thread's store, then
    one thread's acq_rel atomic at GPU scope (release: the tile's stores happen before it;
    acquire for the last slice: the other slices' stores happen before its loads, which the
    barrier Triton puts behind the atomic's broadcast passes to every thread). The partials
    are loaded with ld.global.cg (L2, never a stale L1 line).

    The sum's loop over the planes is unrolled to MAX_SPLIT (planes past the split masked)
    and runs over column pieces of SUM_PIECE outputs: a loop with a runtime bound made ptxas
    schedule the decode GEMM's K loop with 16 more instructions per step (sm_90, the sign
    masks recomputed per pair), and the whole 16 x 128 tile at once held its 15 loads in
    flight at 174 registers (2 programs per SM instead of 3; the 128 x 128 FP8 tile
    spilled); so the K loops count as with `finish_output` (`benchmarks/gpu_static_model.py`)."""
    rows = m0 + tl.arange(0, BLOCK_M)
    cols = n0 + tl.arange(0, BLOCK_N)
    offs = rows.to(tl.int64)[:, None] * stride_om + cols[None, :]
    mask = (rows < M)[:, None] & (cols < N)[None, :]
    tl.store(part_ptr + pid_s.to(tl.int64) * stride_os + offs, acc, mask=mask)
    tl.debug_barrier()
    tile = tl.program_id(2) * tl.num_programs(0) + tl.program_id(0)
    split = tl.num_programs(1)
    if tl.atomic_add(cnt_ptr + tile, 1, sem="acq_rel", scope="gpu") == split - 1:
        PIECES: tl.constexpr = max(1, BLOCK_M * BLOCK_N // SUM_PIECE)
        for h in tl.static_range(PIECES):
            c = n0 + h * (BLOCK_N // PIECES) + tl.arange(0, BLOCK_N // PIECES)
            mask_h = (rows < M)[:, None] & (c < N)[None, :]
            ptrs = part_ptr + rows.to(tl.int64)[:, None] * stride_om + c[None, :]
            tot = tl.load(ptrs, mask=mask_h, other=0.0, cache_modifier=".cg")
            for s in tl.static_range(1, MAX_SPLIT):
                ptrs += stride_os  # the next plane, on 64-bit pointers
                tot += tl.load(ptrs, mask=mask_h & (s < split), other=0.0, cache_modifier=".cg")
            if HAS_BIAS:
                tot += tl.load(bias_ptr + c, mask=c < N, other=0.0).to(tl.float32)[None, :]
            y_ptrs = y_ptr + rows.to(tl.int64)[:, None] * stride_ym + c[None, :]
            tl.store(y_ptrs, tot.to(y_ptr.dtype.element_ty), mask=mask_h)
        tl.atomic_xchg(cnt_ptr + tile, 0, sem="relaxed", scope="gpu")


@triton.jit
def store_out_tile(
    out_ptr,
    acc,
    bias_ptr,
    out_row,
    n0,
    mask_m,
    mask_n,
    pid_s,
    stride_os,
    stride_om,
    HAS_BIAS: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    """acc [BLOCK_M, BLOCK_N] (+ bias[n0:]) into rows out_row (int64) and columns n0.. of out,
    in its dtype; K slice pid_s's plane of fp32 partials when split (stride_os 0 if not)."""
    i_n = tl.arange(0, BLOCK_N)
    if HAS_BIAS:
        acc += tl.load(bias_ptr + n0 + i_n, mask=mask_n, other=0.0).to(tl.float32)[None, :]
    out_ptrs = out_ptr + pid_s.to(tl.int64) * stride_os + out_row[:, None] * stride_om
    tl.store(
        out_ptrs + (n0 + i_n)[None, :],
        acc.to(out_ptr.dtype.element_ty),
        mask=mask_m[:, None] & mask_n[None, :],
    )
