"""Fused Hopper activation re-encoding: x [M, K] -> the sm_90a FP8 per-(row, chunk) layout.

One Triton kernel reads bf16/fp16/fp32 activation rows once and writes every field of
`fp8_chunks.Fp8ChunkLayout` for them: FP8 E4M3 elements [M, Kp], the folded fp32 scales
[Kp/128, M] = 2^(ref-127) * fp32(1/F), the reference exponents `ref`, the MBS bytes and the
`exact` flags [M, Kp/128]. It replaces the two-step path of the sm_90a prefill (the Triton
act-quant's codes / E8M0 scales / MBS bytes, then `encode_fp8_chunks`, ~15 torch ops) and is
bit-identical to it:

    act_quant_fp8_chunks(x, fmt, 128)  ==  encode_fp8_chunks(q.codes, q.scales, q.mbs, K)
                                      with q = formats.quantize(x, fmt)

for the activation formats the CUTLASS backend runs (E8M0 scales at block 16):
`mxfp4-mbs-s` (MBS-S + OAS), `mxfp4-16-oas` and `mxfp4-16` (no MBS: F = 1, mbs bytes 0).

Per program: a tile of BLOCK_M rows x BLOCK_K columns, BLOCK_K a whole number of 128-chunks
(= MBS macro blocks), so neither a chunk nor a macro block ever crosses programs.
 1. MBS-S byte m per chunk and y = fp32(x * F) (as `triton_act_quant`), OAS / floor E8M0
    code s per 16-block, E2M1 magnitude codes and signs (NaN/Inf blocks: s = 255, codes 0).
 2. ref = (largest s of a block with a nonzero code) - 6, or 127 for an all-zero chunk.
 3. Element value(code) * 2^(s - ref) in fp32 (d clamped to [-149, 127] as the torch code),
    rounded to E4M3 (RNE like torch's cast: the GPU's conversion, from the bits under the
    interpreter, whose own conversion truncates; `e4m3_convert`). The FP8 byte carries the
    E2M1 sign (so -0 is 0x80).
 4. exact = every element survives (its FP8 value equals the fp32 value, and a nonzero code
    did not underflow to 0), no NaN block, ref >= MIN_EXACT_REF: `encode_fp8_chunks`'s rule.
 5. scale = 2^(ref-127) * div_rn(1, F): the power of two from bits, one fp32 multiply.
"""

from __future__ import annotations

import math
from typing import Any

import torch

from vllm_mxplus.backends.cutlass.fp8_chunks import (
    BLOCK,
    CHUNK,
    MIN_EXACT_REF,
    TOP_SHIFT,
    Fp8ChunkLayout,
)
from vllm_mxplus.backends.library import op_name
from vllm_mxplus.backends.triton.act_quant import GPU_BLOCK_K, act_rows, check_act_input
from vllm_mxplus.backends.triton.launch import check_available, interpreting, launch, tl, triton
from vllm_mxplus.backends.triton.quant_blocks import (
    MANTISSA_THRESHOLD,
    e4m3_convert,
    e8m0_block_quant,
    load_row_tile,
    mbs_static_scale,
    store_codes_and_scales,
)
from vllm_mxplus.formats import FORMATS, FormatSpec, get_format
from vllm_mxplus.formats.constants import E8M0_NAN, ceil_div


def takes(spec: FormatSpec) -> bool:
    """Whether the fused kernel encodes activations of this format: E8M0 scales (floor or OAS
    rule) at block 16, no MBS or MBS-S, no block-max mantissa."""
    return (
        spec.scale_is_e8m0
        and spec.block_size == BLOCK
        and not spec.block_max_mantissa
        and spec.mbs in (None, "static")
    )


SUPPORTED_FORMATS = tuple(name for name, spec in FORMATS.items() if takes(spec))

# Globals read inside kernels must be tl.constexpr.
CHUNK_K = tl.constexpr(CHUNK)
BLOCK_K16 = tl.constexpr(BLOCK)
TOP = tl.constexpr(TOP_SHIFT)
MIN_REF = tl.constexpr(MIN_EXACT_REF)
NAN_CODE = tl.constexpr(E8M0_NAN)


# ----------------------------------------------------------------------------- device helpers
@triton.jit
def e2m1_value(mag):
    """fp32 value of E2M1 magnitude codes 0..7 (0, .5, 1, 1.5, 2, 3, 4, 6), from bits."""
    bits = (((mag >> 1) + 126) << 23) | ((mag & 1) << 22)  # codes 2..7: 2^(c/2-1) * (1, 1.5)
    bits = tl.where(mag == 1, 0x3F000000, bits)  # 0.5
    bits = tl.where(mag == 0, 0, bits)
    return bits.to(tl.float32, bitcast=True)


@triton.jit
def pow2_f32(k):
    """Exact fp32 2^k for int32 k in [-149, 127] (subnormals included), from bits."""
    normal = (tl.minimum(tl.maximum(k, -126), 127) + 127) << 23
    one = tl.full(k.shape, 1, tl.int32)
    subnormal = one << (tl.minimum(tl.maximum(k, -149), -127) + 149)
    return tl.where(k >= -126, normal, subnormal).to(tl.float32, bitcast=True)


@triton.jit
def _quantize_tile(
    x, MANT_THRESHOLD: tl.constexpr, HAS_MBS: tl.constexpr, BLOCK_M: tl.constexpr,
    NC: tl.constexpr, NB: tl.constexpr,
):  # fmt: skip
    """MBS-S per chunk (if HAS_MBS) and the block-16 E8M0 quantization of fp32 x [BLOCK_M,
    NC*128], exactly triton_act_quant's arithmetic: (MBS bytes m [BM, NC] (HAS_MBS only), F
    [BM, NC] (1 without MBS), scale codes s [BM, NB] (255: NaN block), magnitude codes and
    sign bits [BM, NB, 16])."""
    if HAS_MBS:
        m, f, y = mbs_static_scale(x, BLOCK_M, NC, CHUNK_K)
    else:
        m = tl.zeros((BLOCK_M, NC), tl.int32)
        f = tl.full((BLOCK_M, NC), 1.0, tl.float32)
        y = x
    s, mag, neg = e8m0_block_quant(y, MANT_THRESHOLD, BLOCK_M, NB, BLOCK_K16)
    return m, f, s, mag, neg


@triton.jit
def folded_scale(ref, f):
    """The chunk scale 2^(ref-127) * fp32(1/F): the power of two from bits, sigma = 1/F an IEEE
    reciprocal (`div_rn`), one fp32 multiply."""
    sigma = tl.math.div_rn(tl.full(f.shape, 1.0, tl.float32), f)
    return pow2_f32(tl.minimum(tl.maximum(ref - 127, -149), 127)) * sigma


@triton.jit
def encode_live(
    s, mag, neg, live, BLOCK_M: tl.constexpr, NC: tl.constexpr, NB: tl.constexpr,
    HW_FP8: tl.constexpr,
):  # fmt: skip
    """`fp8_chunks._encode` on a tile: the FP8 layout of the blocks where live [BM, NB] is
    nonzero (the others encode as +0). Returns (bytes [BM, NB, 16] int32, ref [BM, NC],
    exact [BM, NC], ok per element [BM, NB, 16])."""
    BPC: tl.constexpr = CHUNK_K // BLOCK_K16
    live3 = live[:, :, None] != 0
    nz = (tl.max(mag, axis=2) > 0) & (live != 0)
    s_max = tl.max(tl.reshape(tl.where(nz, s, -1), (BLOCK_M, NC, BPC)), axis=2)
    ref = tl.where(s_max >= 0, s_max - TOP, 127)
    ref_b = tl.reshape(tl.broadcast_to(ref[:, :, None], (BLOCK_M, NC, BPC)), (BLOCK_M, NB))
    d = tl.minimum(tl.maximum(s - ref_b, -149), 127)
    val = tl.where(live3, e2m1_value(mag) * pow2_f32(d)[:, :, None], 0.0)
    # val is finite in [0, 384] (d <= 6); HW_FP8: the GPU's conversion (`e4m3_convert`). The
    # exact flags do not depend on the rounding: an element survives only if no rounding
    # happens, so the GEMM's inputs are the same whichever conversion runs
    byte, fval = e4m3_convert(val, HW_FP8)
    byte = tl.where(live3, byte | (neg << 7), 0)
    ok = (fval == val) & ((val != 0.0) | (mag == 0) | (live[:, :, None] == 0))
    lost = tl.reshape(tl.where(ok, 0, 1), (BLOCK_M, NC, CHUNK_K))
    survives = tl.max(lost, axis=2) == 0
    nan_live = ((s == NAN_CODE) & (live != 0)).to(tl.int32)
    no_nan = tl.max(tl.reshape(nan_live, (BLOCK_M, NC, BPC)), axis=2) == 0
    return byte, ref, survives & no_nan & (ref >= MIN_REF), ok


# ----------------------------------------------------------------------------- kernel
@triton.jit
def _act_fp8_chunks_kernel(
    x_ptr, fp8_ptr, scale_ptr, ref_ptr, mbs_ptr, exact_ptr, codes_ptr, pscales_ptr,
    M, K, KP, NCH, stride_xm, stride_fm, stride_sc, stride_cm, stride_pc, stride_ps,
    MANT_THRESHOLD: tl.constexpr, HAS_MBS: tl.constexpr,
    BF16_BITS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr,
    HW_FP8: tl.constexpr, PACKED: tl.constexpr,
):  # fmt: skip
    NC: tl.constexpr = BLOCK_K // CHUNK_K  # chunks (= macro blocks) per tile
    NB: tl.constexpr = BLOCK_K // BLOCK_K16  # 16-blocks per tile
    pid_k = tl.program_id(1)
    offs_m, offs_k, mask_m, x = load_row_tile(x_ptr, M, K, stride_xm, BF16_BITS, BLOCK_M, BLOCK_K)

    # -- 1. MBS-S and the block-16 quantization (exactly triton_act_quant's arithmetic)
    m, f, s, mag, neg = _quantize_tile(x, MANT_THRESHOLD, HAS_MBS, BLOCK_M, NC, NB)
    if PACKED:  # the same codes and E8M0 scales in formats' packed layout (exact fallback)
        store_codes_and_scales(
            codes_ptr, pscales_ptr, mag | (neg << 3), s, offs_m, mask_m, stride_pc, stride_ps,
            pid_k, K, BLOCK_K16, BLOCK_M, BLOCK_K,
        )  # fmt: skip

    # -- 2.-4. reference exponents, FP8 bytes and exact flags of every block
    every = tl.full((BLOCK_M, NB), 1, tl.int32)
    byte, ref, exact, _ok = encode_live(s, mag, neg, every, BLOCK_M, NC, NB, HW_FP8)
    fp8 = tl.reshape(byte, (BLOCK_M, BLOCK_K))

    # -- 5. folded scale 2^(ref-127) * fp32(1/F)
    scale = folded_scale(ref, f)

    # offs_m is int64 (load_row_tile): M * Kp and Kp/128 * M may pass 2^31
    tl.store(
        fp8_ptr + offs_m[:, None] * stride_fm + offs_k[None, :],
        fp8.to(tl.uint8),
        mask=mask_m[:, None] & (offs_k[None, :] < KP),
    )
    offs_c = pid_k * NC + tl.arange(0, NC)
    cmask = mask_m[:, None] & (offs_c[None, :] < NCH)
    cptr = offs_m[:, None] * stride_cm + offs_c[None, :]
    tl.store(ref_ptr + cptr, ref, mask=cmask)
    tl.store(mbs_ptr + cptr, m.to(tl.uint8), mask=cmask)
    tl.store(exact_ptr + cptr, exact.to(tl.uint8), mask=cmask)
    tl.store(
        scale_ptr + offs_c.to(tl.int64)[None, :] * stride_sc + offs_m[:, None], scale, mask=cmask
    )


# ----------------------------------------------------------------------------- launcher
def _tile_sizes(m: int, kp: int) -> tuple[int, int]:
    """(BLOCK_M, BLOCK_K), BLOCK_K a power of two >= 128. The interpreter pays per program:
    large tiles; the GPU: ~2K elements per program (memory-bound, like triton_act_quant)."""
    kp2 = triton.next_power_of_2(kp)
    if interpreting():
        return min(64, triton.next_power_of_2(m)), min(kp2, 4096)
    return min(4, triton.next_power_of_2(m)), min(kp2, GPU_BLOCK_K)


def _check(x: torch.Tensor, fmt: str, macro_block: int) -> None:
    spec = check_act_input(x, fmt, takes, "act_quant_fp8_chunks", "fused kernel")
    if spec.mbs and macro_block != CHUNK:
        raise ValueError(
            f"act_quant_fp8_chunks: the FP8 layout's chunk is the MBS macro block "
            f"({CHUNK}), got macro_block={macro_block}"
        )


def _layout_dims(x: torch.Tensor, fmt: str, macro_block: int) -> tuple[int, int]:
    """(Kp, Kp/128): the FP8 layout's padded K and chunks of x [..., K], after the input,
    format and device checks."""
    _check(x, fmt, macro_block)
    check_available(x)
    kp = ceil_div(x.shape[-1], CHUNK) * CHUNK
    return kp, kp // CHUNK


def _launch(
    kernel: Any, x: torch.Tensor, fmt: str, rows: int, outputs: tuple, packed: bool = False
) -> None:
    """Launch `kernel` over `rows` rows of x [..., K] quantized with fmt: (row tile, K tile)
    programs; outputs: its pointer arguments after x, then the row strides it takes; packed:
    it also writes the packed codes and E8M0 scales (PACKED)."""
    if not rows:
        return
    spec = get_format(fmt)
    x2, x_arg, bf16_bits = act_rows(x)
    k = x2.shape[1]
    kp = ceil_div(k, CHUNK) * CHUNK
    block_m, block_k = _tile_sizes(rows, kp)
    pointers, strides = outputs
    launch(
        kernel,
        (triton.cdiv(rows, block_m), triton.cdiv(kp, block_k)),
        x_arg,
        *pointers,
        rows,
        k,
        kp,
        kp // CHUNK,
        x2.stride(0),
        *strides,
        MANT_THRESHOLD=MANTISSA_THRESHOLD[spec.scale_rule],
        HW_FP8=not interpreting(),
        PACKED=packed,
        HAS_MBS=bool(spec.mbs),
        BF16_BITS=bf16_bits,
        BLOCK_M=block_m,
        BLOCK_K=block_k,
    )


def _fields(x: torch.Tensor, fmt: str, macro_block: int, packed: bool = False):
    """Launch the kernel: (fp8, scale, ref, mbs, exact) for the rows of x [..., K], and with
    `packed` also (codes uint8 [R, ceil(K/2)], E8M0 scales uint8 [R, ceil(K/16)]): formats'
    fields of the same quantization (the MBS bytes are `mbs`)."""
    kp, nc = _layout_dims(x, fmt, macro_block)
    k = x.shape[-1]
    m, dev = math.prod(x.shape[:-1]), x.device
    fp8 = torch.empty((m, kp), dtype=torch.uint8, device=dev)
    scale = torch.empty((nc, m), dtype=torch.float32, device=dev)
    ref = torch.empty((m, nc), dtype=torch.int32, device=dev)
    mbs = torch.empty((m, nc), dtype=torch.uint8, device=dev)
    exact = torch.empty((m, nc), dtype=torch.uint8, device=dev)
    codes = torch.empty((m, ceil_div(k, 2) if packed else 0), dtype=torch.uint8, device=dev)
    scales = torch.empty((m, ceil_div(k, BLOCK) if packed else 0), dtype=torch.uint8, device=dev)
    strides = (fp8.stride(0), scale.stride(0), ref.stride(0), codes.stride(0), scales.stride(0))
    pointers = (fp8, scale, ref, mbs, exact, codes if packed else exact,
                scales if packed else exact)  # fmt: skip
    _launch(_act_fp8_chunks_kernel, x, fmt, m, (pointers, strides), packed)
    out = (fp8.view(torch.float8_e4m3fn), scale, ref, mbs, exact.view(torch.bool))
    return (*out, codes, scales) if packed else out


def act_quant_fp8_chunks(x: torch.Tensor, fmt: str, macro_block: int) -> Fp8ChunkLayout:
    """Quantize activation rows x [..., K] (bf16/fp16/fp32) with `fmt` and re-encode them for
    the sm_90a FP8 GEMM in one kernel. Rows are x's leading dims flattened (R = numel / K).

    Bit-identical to `encode_fp8_chunks(q.codes, q.scales, q.mbs, K)` with
    q = `formats.quantize(x, fmt)` (module docstring)."""
    fp8, scale, ref, mbs, exact = _fields(x, fmt, macro_block)
    return Fp8ChunkLayout(fp8=fp8, scale=scale, ref=ref, mbs=mbs, exact=exact, k=x.shape[-1])


# ----------------------------------------------------------------------------- custom op
def _field_shapes(x: torch.Tensor):
    k = x.shape[-1]
    rows = math.prod(x.shape[:-1])
    nc = ceil_div(k, CHUNK)
    return (
        ((rows, nc * CHUNK), torch.float8_e4m3fn),
        ((nc, rows), torch.float32),
        ((rows, nc), torch.int32),
        ((rows, nc), torch.uint8),
        ((rows, nc), torch.bool),
    )


@torch.library.custom_op(op_name("triton_act_fp8_chunks"), mutates_args=())
def _act_fp8_chunks_op(
    x: torch.Tensor, fmt: str, macro_block: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    return _fields(x, fmt, macro_block)


@_act_fp8_chunks_op.register_fake
def _act_fp8_chunks_fake(x: torch.Tensor, fmt: str, macro_block: int):
    _check(x, fmt, macro_block)
    return tuple(x.new_empty(shape, dtype=dtype) for shape, dtype in _field_shapes(x))


def act_quant_fp8_chunks_op(x: torch.Tensor, fmt: str, macro_block: int) -> Fp8ChunkLayout:
    """`act_quant_fp8_chunks` through the custom op (traceable by torch.compile)."""
    fp8, scale, ref, mbs, exact = torch.ops.vllm_mxplus.triton_act_fp8_chunks(x, fmt, macro_block)
    return Fp8ChunkLayout(fp8=fp8, scale=scale, ref=ref, mbs=mbs, exact=exact, k=x.shape[-1])


def _packed_field_shapes(x: torch.Tensor):
    k, rows = x.shape[-1], math.prod(x.shape[:-1])
    return (
        *_field_shapes(x),
        ((rows, ceil_div(k, 2)), torch.uint8),
        ((rows, ceil_div(k, BLOCK)), torch.uint8),
    )


@torch.library.custom_op(op_name("triton_act_fp8_chunks_packed"), mutates_args=())
def _act_fp8_chunks_packed_op(
    x: torch.Tensor, fmt: str, macro_block: int
) -> tuple[
    torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor,
    torch.Tensor,
]:  # fmt: skip
    return _fields(x, fmt, macro_block, packed=True)


@_act_fp8_chunks_packed_op.register_fake
def _act_fp8_chunks_packed_fake(x: torch.Tensor, fmt: str, macro_block: int):
    _check(x, fmt, macro_block)
    return tuple(x.new_empty(shape, dtype=dtype) for shape, dtype in _packed_field_shapes(x))


def act_fp8_and_packed_op(
    x: torch.Tensor, fmt: str, macro_block: int
) -> tuple[Fp8ChunkLayout, torch.Tensor, torch.Tensor]:
    """(the FP8-chunk layout of x, codes, E8M0 scales) from one kernel launch through a
    custom op: the layout as `act_quant_fp8_chunks_op` gives it, and formats' packed codes and
    scales of the same quantization (bit for bit `formats.quantize(x, fmt)`; its MBS bytes
    are the layout's `mbs`), which the prefill's exact fallback reads."""
    fp8, scale, ref, mbs, exact, codes, scales = torch.ops.vllm_mxplus.triton_act_fp8_chunks_packed(
        x, fmt, macro_block
    )
    lay = Fp8ChunkLayout(fp8=fp8, scale=scale, ref=ref, mbs=mbs, exact=exact, k=x.shape[-1])
    return lay, codes, scales


def supports(fmt: str | None) -> bool:
    """Whether the fused kernel handles activation format `fmt` (`takes`)."""
    return fmt is not None and takes(get_format(fmt))
