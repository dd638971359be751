"""Triton device functions of the activation quantizers (`triton_act_quant`, the fused
sm_90a encoder `triton_act_fp8`): E2M1 codes, E8M0 scales, MBS-S, E4M3 rounding, tile loads.

Each is bit-exact to its `vllm_mxplus.formats` counterpart (docs/numerics.md, "E2M1
elements", "E8M0 block scales", "Macro Block Scaling", "NVFP4"); the module docstring of
`triton_act_quant` says which GPU numerics they avoid and how.
"""

from __future__ import annotations

from vllm_mxplus.backends.triton.launch import tl, triton
from vllm_mxplus.formats import constants as C

# Globals read inside kernels must be tl.constexpr (Triton rejects plain globals).
E8M0_NAN = tl.constexpr(C.E8M0_NAN)
NO_THRESHOLD = -1  # ocp: d is always 0
MBS_STATIC_MASK = tl.constexpr(C.MBS_STATIC_MASK)  # the 8 leading mantissa bits of fp32(6/a)
MBS_STATIC_SHIFT = tl.constexpr(C.MBS_STATIC_SHIFT)
MBS_INV_DENOM = tl.constexpr(1.0 / C.MBS_DENOM)  # 2^-8, exact
MBS_DENOM = tl.constexpr(float(C.MBS_DENOM))
NVFP4_GLOBAL_DIV = tl.constexpr(C.E2M1_MAX * C.F8E4M3_MAX)  # 6 * 448 = 2688
E2M1_MAX = tl.constexpr(C.E2M1_MAX)
F8E4M3_MAX = tl.constexpr(C.F8E4M3_MAX)
F8E4M3_MIN_NORMAL = tl.constexpr(2.0**-6)
F8E4M3_SUB_ROUNDER = tl.constexpr(16384.0)  # 2^14: fp32 ulp 2^-9, the e4m3 subnormal step
NVFP4_BLOCK = tl.constexpr(C.SMALL_BLOCK)  # 16
E2M1_RND_HALF = tl.constexpr(2.0**22)  # x + 2^22 rounds x < 2^22 to a multiple of 0.5
E2M1_RND_ONE = tl.constexpr(2.0**23)
E2M1_RND_TWO = tl.constexpr(2.0**24)
E2M1_TO_CODE = tl.constexpr(2.0**-126)  # E2M1 value -> fp32 bits code << 22
# two fp32 values rounded to E2M1 (RNE, saturated at +-6, signs kept) in one byte: $1's code in
# the high nibble, $2's in the low one (PTX ISA, cvt: "a" upper, "b" lower); sm_100a and later
E2M1X2_CVT = tl.constexpr(
    "{ .reg .b8 t; cvt.rn.satfinite.e2m1x2.f32 t, $1, $2; cvt.u32.u8 $0, t; }"
)
SIGN_BIT = tl.constexpr(-0x80000000)  # 0x80000000 as int32

#: d = 1 above these fp32 mantissa bits, per E8M0 scale rule (docs/numerics.md, "E8M0 block
#: scales"); shared with the fused sm_90a encoder (triton_act_fp8).
MANTISSA_THRESHOLD = {"ocp": NO_THRESHOLD, "floor": C.FLOOR_MANTISSA, "oas": C.OAS_MANTISSA}


@triton.jit
def e2m1_magnitude_code(v, NAN_FREE: tl.constexpr = False):
    """E2M1 magnitude codes 0..7 (int32) of scaled fp32 values v >= 0; ties to even, NaN -> 0
    (NAN_FREE: the caller replaces the codes of NaN elements itself, and skips the check).

    One fp32 addition rounds v to the E2M1 grid: v + 2^22 (ulp 0.5) below 2, v + 2^23
    (ulp 1) below 4, v + 2^24 (ulp 2) above, each a single round-to-nearest-even of the
    exact sum, then minus the same power of two (exact); the thresholds of
    `formats.e2m1_magnitude_code` with their ties (1.75 -> 2, 2.5 -> 2, 3.5 -> 4, 5 -> 4)
    fall out of the ties to even. Saturated at 6, the value r is moved to its code by
    r * 2^-126, whose fp32 bits are the code shifted left by 22 (`gemm_blocks.e2m1_value`
    read backwards; 0.5 * 2^-126 is a subnormal, which mul.f32 without .ftz keeps)."""
    magic = tl.where(v < 2.0, E2M1_RND_HALF, tl.where(v < 4.0, E2M1_RND_ONE, E2M1_RND_TWO))
    r = tl.minimum((v + magic) - magic, E2M1_MAX)
    c = (r * E2M1_TO_CODE).to(tl.int32, bitcast=True) >> 22
    if not NAN_FREE:
        c = tl.where(v == v, c, 0)
    return c


@triton.jit
def load_f32(ptrs, mask, BF16_BITS: tl.constexpr):
    """Load x as fp32 at once (the interpreter's bf16 arithmetic is wrong).

    bf16 arrives as int16 bits and widens by a shift: exact for every value, including
    subnormals, which the interpreter's own bf16 -> fp32 conversion gets wrong.
    """
    if BF16_BITS:
        raw = tl.load(ptrs, mask=mask, other=0).to(tl.int32)
        return ((raw & 0xFFFF) << 16).to(tl.float32, bitcast=True)
    else:
        return tl.load(ptrs, mask=mask, other=0.0).to(tl.float32)


@triton.jit
def nan_max(ax, axis: tl.constexpr):
    """max of non-negative fp32 values ax (|x|: NaN with the sign bit clear allowed) along
    axis, NaN when any is NaN. Taken on the bits: for fp32 >= 0 the int32 order is the float
    order, +inf's bits (0x7F800000) lie above every finite value's and NaN's above +inf's,
    where a float max on the GPU drops NaN. One integer max per element, no NaN test."""
    return tl.max(ax.to(tl.int32, bitcast=True), axis=axis).to(tl.float32, bitcast=True)


@triton.jit
def e8m0_code(absmax, MANT_THRESHOLD: tl.constexpr):
    """E8M0 code (int32) of a block absmax >= 0 (+inf for a non-finite block).

    code = biased_exp(a) - 2 + d, clamped to [0, 254]; 255 for +inf or NaN (`nan_max`). A
    subnormal or zero absmax has biased exponent 0, so it lands on code 0, as the reference's
    clamp does.
    """
    bits = absmax.to(tl.int32, bitcast=True)
    e = (bits >> 23) & 0xFF
    if MANT_THRESHOLD >= 0:
        e += ((bits & 0x7FFFFF) > MANT_THRESHOLD).to(tl.int32)
    code = tl.minimum(tl.maximum(e - 2, 0), 254)
    return tl.where(absmax < float("inf"), code, E8M0_NAN)  # NaN compares false


@triton.jit
def e8m0_reciprocal(code):
    """fp32 2^(127 - code): exact and normal for finite-block codes 0..253 (never 254)."""
    c = tl.minimum(code, 253)
    return ((254 - c) << 23).to(tl.float32, bitcast=True)


@triton.jit
def pack_nibbles(codes, BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr):
    """[BLOCK_M, BLOCK_K] int32 codes -> [BLOCK_M, BLOCK_K // 2] bytes, element 2i low nibble."""
    lo, hi = tl.split(tl.reshape(codes, (BLOCK_M, BLOCK_K // 2, 2)))
    return (lo | (hi << 4)).to(tl.uint8)


@triton.jit
def load_row_tile(
    x_ptr, M, K, stride_xm, BF16_BITS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr
):
    """This program's tile: (offs_m, offs_k, row mask, fp32 x [BLOCK_M, BLOCK_K]), zeros past
    M and K (zeros change no absmax and encode as +0, like the torch path's padding)."""
    offs_m = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_k = tl.program_id(1) * BLOCK_K + tl.arange(0, BLOCK_K)
    mask_m = offs_m < M
    offs_m = offs_m.to(tl.int64)  # row * stride overflows int32 for M*K >= 2^31
    x = load_f32(
        x_ptr + offs_m[:, None] * stride_xm + offs_k[None, :],
        mask_m[:, None] & (offs_k[None, :] < K),
        BF16_BITS,
    )
    return offs_m, offs_k, mask_m, x


@triton.jit
def mbs_factor(m, FMA: tl.constexpr = False):
    """F = 1 + m/256 in fp32 (exact) of MBS bytes m: as m * 2^-8 + 1 where FMA (one FFMA after
    the convert), else as (m + 256) * 2^-8 (an add and a multiply), the same exact value.
    Which form is a register-allocation choice made by count (`benchmarks/gpu_static_model.py`,
    `mxplus kernels --aot`): the FMA form saves 7 of 492 instructions per warp and step in the
    decode GEMM's word path at macro block 16 on sm_90 (its weight factors), but made ptxas
    spill where it computed x's factors there, and `mx_gemm`'s macro-16 tiles, on sm_100."""
    if FMA:
        return m.to(tl.float32) * MBS_INV_DENOM + 1.0
    return (m.to(tl.float32) + MBS_DENOM) * MBS_INV_DENOM


@triton.jit
def mbs_static_scale(x, BLOCK_M: tl.constexpr, NM: tl.constexpr, MACRO: tl.constexpr):
    """MBS-S of fp32 tile rows x [BLOCK_M, NM*MACRO]: (m int32 [BLOCK_M, NM], F fp32
    [BLOCK_M, NM], y = fp32(x*F)).

    Paper eq. 3: m = 8 leading mantissa bits of fp32(6 / a); a = 0 or a non-finite macro
    block -> m = 0."""
    a = nan_max(tl.reshape(tl.abs(x), (BLOCK_M, NM, MACRO)), 2)
    finite = (a > 0.0) & (a < float("inf"))  # NaN compares false
    r = tl.math.div_rn(tl.full(a.shape, E2M1_MAX, tl.float32), tl.where(finite, a, 1.0))
    m = (r.to(tl.int32, bitcast=True) & MBS_STATIC_MASK) >> MBS_STATIC_SHIFT
    m = tl.where(finite, m, 0)
    f = mbs_factor(m)
    y = tl.reshape(
        tl.reshape(x, (BLOCK_M, NM, MACRO)) * f[:, :, None], (BLOCK_M, NM * MACRO)
    )  # one fp32 multiply (RNE)
    return m, f, y


@triton.jit
def e8m0_block_quant(
    y, MANT_THRESHOLD: tl.constexpr, BLOCK_M: tl.constexpr, NB: tl.constexpr, BLOCK: tl.constexpr
):
    """E8M0 block quantization of fp32 y [BLOCK_M, NB*BLOCK]: (scale codes int32 [BM, NB],
    255 = NaN block; magnitude codes [BM, NB, BLOCK]; sign bits [BM, NB, BLOCK]). Elements
    of a NaN block get magnitude and sign 0."""
    return e8m0_block_quant_abs(y, tl.abs(y), MANT_THRESHOLD, BLOCK_M, NB, BLOCK)


@triton.jit
def e8m0_block_quant_abs(
    sgn,
    ay,
    MANT_THRESHOLD: tl.constexpr,
    BLOCK_M: tl.constexpr,
    NB: tl.constexpr,
    BLOCK: tl.constexpr,
):
    """`e8m0_block_quant` of y given ay = |y| (NaN with the sign bit clear, as tl.abs and a
    product of it by F > 0 leave it) and any tensor sgn with y's signs (the MBS-S quantizer
    passes x for y = x F)."""
    ay = tl.reshape(ay, (BLOCK_M, NB, BLOCK))
    code = e8m0_code(nan_max(ay, 2), MANT_THRESHOLD)
    nan_blk = (code == E8M0_NAN)[:, :, None]
    # a NaN in ay makes its block's code 255, whose elements are 0 here: no NaN test needed
    mag = tl.where(nan_blk, 0, e2m1_magnitude_code(ay * e8m0_reciprocal(code)[:, :, None], True))
    neg = tl.reshape((sgn.to(tl.int32, bitcast=True) < 0).to(tl.int32), (BLOCK_M, NB, BLOCK))
    return code, mag, tl.where(nan_blk, 0, neg)


@triton.jit
def e8m0_block_scaled(sgn, ay, MANT_THRESHOLD: tl.constexpr, BLOCK_M: tl.constexpr,
                      NB: tl.constexpr, BLOCK: tl.constexpr):  # fmt: skip
    """`e8m0_block_quant_abs` up to the rounding: (scale codes int32 [BM, NB], the scaled
    values |y| * 2^(127 - code) with y's signs (sgn's) fp32 [BM, NB * BLOCK]), +0 in a NaN
    block, for `e2m1_packed_hw` to round."""
    ay = tl.reshape(ay, (BLOCK_M, NB, BLOCK))
    code = e8m0_code(nan_max(ay, 2), MANT_THRESHOLD)
    v = ay * e8m0_reciprocal(code)[:, :, None]
    sb = tl.reshape(sgn.to(tl.int32, bitcast=True), (BLOCK_M, NB, BLOCK)) & SIGN_BIT
    v = (v.to(tl.int32, bitcast=True) | sb).to(tl.float32, bitcast=True)
    # a NaN block's elements: magnitude and sign 0 (its x may hold -NaN, -Inf or -0)
    v = tl.where((code == E8M0_NAN)[:, :, None], 0.0, v)
    return code, tl.reshape(v, (BLOCK_M, NB * BLOCK))


@triton.jit
def e2m1_packed_hw(v, BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr, ASM: tl.constexpr):
    """Signed scaled fp32 values v [BLOCK_M, BLOCK_K] rounded to E2M1 by the GPU's conversion
    (ASM: E2M1X2_CVT, one per two values; sm_100a and later), packed two per byte as
    `pack_nibbles` packs (element 2i in the low nibble): uint8 [BLOCK_M, BLOCK_K // 2].
    The conversion rounds to nearest even and saturates at 6, keeping the sign: the
    rounding of `e2m1_magnitude_code` (its ties are ties to even in each binade, and it
    saturates at 6), with the sign bit of v (a negative value that rounds to 0 is -0, code
    8, as the reference's sign bit gives). Without ASM (the interpreter, which runs no PTX)
    that rounding stands in for the conversion, so the tests run the rest of the path."""
    lo, hi = tl.split(tl.reshape(v, (BLOCK_M, BLOCK_K // 2, 2)))
    if ASM:
        b = tl.inline_asm_elementwise(E2M1X2_CVT, "=r,r,r", [hi, lo], dtype=tl.int32,
                                      is_pure=True, pack=1)  # fmt: skip
    else:
        b = _e2m1_signed_code(lo) | (_e2m1_signed_code(hi) << 4)
    return b.to(tl.uint8)


@triton.jit
def _e2m1_signed_code(v):
    """Signed E2M1 codes (int32) of scaled fp32 values v (no NaN): E2M1X2_CVT's result."""
    sign = (v.to(tl.int32, bitcast=True) < 0).to(tl.int32)
    return e2m1_magnitude_code(tl.abs(v), True) | (sign << 3)


@triton.jit
def e4m3_round(s):
    """Round fp32 s in [0, 448] or NaN to float8_e4m3fn (RNE): (byte int32, value fp32)."""
    is_nan = s != s
    s = tl.where(is_nan, 0.0, s)  # keeps NaN out of the float -> int conversion below
    bits = s.to(tl.int32, bitcast=True)
    # normal range: round the 23-bit mantissa to 3 bits, ties to even, carry into the exponent
    rb = (bits + 0x7FFFF + ((bits >> 20) & 1)) & ~0xFFFFF
    normal_byte = (((rb >> 23) - 120) << 3) | ((rb >> 20) & 7)
    normal_val = rb.to(tl.float32, bitcast=True)
    # subnormal range: multiples of 2^-9; q = 8 is 2^-6, whose byte 0x08 is the smallest normal
    sub_val = (s + F8E4M3_SUB_ROUNDER) - F8E4M3_SUB_ROUNDER
    sub_byte = (sub_val * 512.0).to(tl.int32)
    is_normal = s >= F8E4M3_MIN_NORMAL
    byte = tl.where(is_normal, normal_byte, sub_byte)
    val = tl.where(is_normal, normal_val, sub_val)
    return tl.where(is_nan, 0x7F, byte), tl.where(is_nan, float("nan"), val)


@triton.jit
def e4m3_convert(v, HW: tl.constexpr):
    """(byte int32, value fp32) of fp32 v in [0, 448], rounded to float8_e4m3fn (RNE). HW: the
    GPU's conversion (cvt.rn.satfinite, one per two values; sm_89 and later); else from the
    bits (`e4m3_round`), as under the interpreter, whose own conversion truncates subnormals
    and ties. Both are torch's cast on these values."""
    if HW:
        f8 = v.to(tl.float8e4nv)
        byte = f8.to(tl.uint8, bitcast=True).to(tl.int32)
        val = f8.to(tl.float32)
    else:
        byte, val = e4m3_round(v)
    return byte, val


@triton.jit
def nvfp4_block_quant(x, g, BLOCK_M: tl.constexpr, NB: tl.constexpr, BLOCK: tl.constexpr):
    """NVFP4 block quantization of fp32 x [BLOCK_M, NB*BLOCK] with the rows' global scales
    g [BLOCK_M]: (E4M3 scale bytes int32 [BM, NB], signed E2M1 codes int32 [BM, NB, BLOCK]).

    Block absmax with torch.amax semantics (NaN wins, else the max, Inf included); a NaN / Inf
    block gets the NaN scale and codes 0, like a zero scale (`formats.nvfp4`)."""
    xb = tl.reshape(x, (BLOCK_M, NB, BLOCK))
    ax = tl.abs(xb)
    has_nan = tl.max((ax != ax).to(tl.int32), axis=2) > 0
    bmax = tl.max(tl.where(ax == ax, ax, 0.0), axis=2)
    nonfinite = has_nan | (bmax == float("inf"))
    bmax = tl.where(nonfinite, 0.0, bmax)
    gb = tl.broadcast_to(g[:, None], bmax.shape)
    s32 = tl.math.div_rn(
        tl.math.div_rn(bmax, tl.full(bmax.shape, E2M1_MAX, tl.float32)),
        tl.where(gb > 0.0, gb, 1.0),
    )
    s32 = tl.where(gb > 0.0, s32, 0.0)
    s32 = tl.where(nonfinite, float("nan"), s32)
    s32 = tl.where(s32 > F8E4M3_MAX, F8E4M3_MAX, s32)  # saturate; NaN stays NaN
    sbyte, sf = e4m3_round(s32)
    zero = (sf == 0.0) | (sf != sf)
    denom = tl.where(zero, 1.0, sf * gb)
    v = tl.math.div_rn(ax, tl.broadcast_to(denom[:, :, None], ax.shape))
    neg = (xb.to(tl.int32, bitcast=True) < 0).to(tl.int32)
    return sbyte, tl.where(zero[:, :, None], 0, e2m1_magnitude_code(v) | (neg << 3))


@triton.jit
def store_row_tile(ptr, vals, offs_m, mask_m, stride_m, tile, n_cols, WIDTH: tl.constexpr):
    """Store vals [BLOCK_M, WIDTH] at columns tile*WIDTH.. of rows offs_m (int64) of a row-major
    output; rows past M (mask_m False) and columns past n_cols are not written."""
    offs = tile * WIDTH + tl.arange(0, WIDTH)
    mask = mask_m[:, None] & (offs[None, :] < n_cols)
    tl.store(ptr + offs_m[:, None] * stride_m + offs[None, :], vals, mask=mask)


@triton.jit
def store_codes_and_scales(
    codes_ptr,
    scales_ptr,
    c,
    s,
    offs_m,
    mask_m,
    stride_cm,
    stride_sm,
    tile,
    K,
    BLOCK: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    """Store K tile `tile` of rows offs_m: signed E2M1 codes c [BLOCK_M, NB, BLOCK] packed two
    per byte (`pack_nibbles`), or already packed (uint8 [BLOCK_M, BLOCK_K // 2]), and the
    scale bytes s [BLOCK_M, NB] (int32 codes)."""
    if c.dtype == tl.uint8:
        packed = c
    else:
        packed = pack_nibbles(tl.reshape(c, (BLOCK_M, BLOCK_K)), BLOCK_M, BLOCK_K)
    store_row_tile(codes_ptr, packed, offs_m, mask_m, stride_cm, tile, tl.cdiv(K, 2), BLOCK_K // 2)
    sb = s.to(tl.uint8)
    store_row_tile(
        scales_ptr, sb, offs_m, mask_m, stride_sm, tile, tl.cdiv(K, BLOCK), BLOCK_K // BLOCK
    )
