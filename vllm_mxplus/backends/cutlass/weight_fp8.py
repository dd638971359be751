"""The sm_90a weight operand, re-encoded per call: packed MXFP4 -> FP8 E4M3 chunks.

The Hopper GEMM multiplies FP8 E4M3 operands with one fp32 scale per (row, 128-K chunk)
(`fp8_chunks`). Holding that re-encoding of every weight would cost 1 byte per weight plus
4 per 128 beside the packed format's 0.57 (which the decode kernels and the exact fallback
read); so the weight keeps only its packed form, and each prefill call re-encodes it into
a temporary with this kernel, one pass that reads 0.57 bytes per weight and writes 1.03.
The temporary lives for one GEMM (the caching allocator hands the same block to the next
layer); the held bytes per weight stay the packed format's.

    weight_fp8_chunks(codes, scales, mbs, k, rows)  ==  (lay.fp8, lay.scale)
        with lay = encode_fp8_chunks(pad_rows(codes, rows), pad_rows(scales, rows),
                                     pad_rows(mbs, rows), k)

bit for bit on every chunk (tests/backends/cutlass/test_cutlass_weight_fp8.py, under the
interpreter). Which weight rows hold a chunk the FP8 form cannot represent exactly is decided
once at load from the definition (`gemm.prepare_weight`); the GEMM recomputes those output
columns from the packed operands, so this kernel writes no `exact` flags.

Two kernels, per program BLOCK_M rows x BLOCK_K columns, BLOCK_K a whole number of chunks:

- on words (`_weight_fp8_words_kernel`), where the code rows vectorize
  (`gemm_launch.codes_aligned`: whole int32 words of 8 codes): a block is nonzero iff its two
  words have a magnitude bit set (one OR and one AND per block), which gives each chunk's
  reference exponent ref (`fp8_chunks`: the largest nonzero block's scale - 6); the values
  are built two per 32-bit register as the decode GEMM builds them
  (`gemm_blocks.e2m1_word_values`: bf16 pairs, exact), multiplied by 2^(s - ref) per block
  (exact in bf16: a power of two times at most two significant bits) and converted to E4M3
  with round-to-nearest-even, which on every chunk the definition calls exact is no rounding
  at all. 0.37 warp-instructions per weight on sm_90 where the byte kernel takes 1.58
  (`benchmarks/gpu_static_model.py`, `encode weight-fp8`: a static count).
- on bytes (`_weight_fp8_chunks_kernel`), any row: `act_fp8`'s chunk arithmetic
  (`encode_live`, `folded_scale`, E4M3 rounding in software) on codes unpacked from the
  nibbles (element 2i in the low nibble).

Both write the folded scale 2^(ref-127) * fp32(1/F) per (row, chunk) (`folded_scale`).
"""

from __future__ import annotations

import torch

from vllm_mxplus.backends.cutlass.act_fp8 import CHUNK_K, TOP, encode_live, folded_scale
from vllm_mxplus.backends.cutlass.fp8_chunks import CHUNK, ceil_to
from vllm_mxplus.backends.triton.gemm_blocks import e2m1_word_values, e8m0_word_scales
from vllm_mxplus.backends.triton.gemm_launch import codes_aligned, dot_dtype
from vllm_mxplus.backends.triton.launch import check_available, interpreting, launch, tl, triton
from vllm_mxplus.backends.triton.quant_blocks import e4m3_convert, mbs_factor
from vllm_mxplus.formats.constants import ceil_div

GPU_BLOCK_K = 512  # columns per program on the GPU (256 bytes of codes per row)
GPU_BLOCK_M = 4
WORDS_BLOCK_M = 16  # the word kernel: 16 rows x 512 columns (1024 words) per program
E2M1_MAGNITUDE_BITS = tl.constexpr(0x77777777)  # the magnitude bits of a word's 8 codes
# 2^(s - ref) as an E8M0 code, kept normal and finite
WORD_SCALE_MIN, WORD_SCALE_MAX = tl.constexpr(1), tl.constexpr(254)


@triton.jit
def _load_block_scales(scales_ptr, rows, live_m, k0, K, stride_sm, NB: tl.constexpr):
    """The E8M0 scale codes (int32) [rows, NB] of the tile's 16-blocks from K element k0;
    code 0 past K (the padding's) and past N."""
    sb = k0 // 16 + tl.arange(0, NB)
    return tl.load(
        scales_ptr + rows[:, None] * stride_sm + sb[None, :],
        mask=live_m[:, None] & (sb[None, :] < (K + 15) // 16),
        other=0,
    ).to(tl.int32)


@triton.jit
def _store_chunk_scales(
    mbs_ptr, scale_ptr, ref, rows, live_m, in_rows, NCH, stride_mm, stride_sc,
    HAS_MBS: tl.constexpr, NC: tl.constexpr,
):  # fmt: skip
    """Store the tile's folded chunk scales 2^(ref-127) * fp32(1/F) (`folded_scale`, F from
    the MBS bytes; 1 without MBS) at scale[chunk, row]."""
    offs_c = tl.program_id(1) * NC + tl.arange(0, NC)
    if HAS_MBS:
        m = tl.load(
            mbs_ptr + rows[:, None] * stride_mm + offs_c[None, :],
            mask=live_m[:, None] & (offs_c[None, :] < NCH),
            other=0,
        ).to(tl.int32)
    else:
        m = tl.zeros(ref.shape, tl.int32)
    tl.store(
        scale_ptr + offs_c.to(tl.int64)[None, :] * stride_sc + rows[:, None],
        folded_scale(ref, mbs_factor(m)),
        mask=in_rows[:, None] & (offs_c[None, :] < NCH),
    )


@triton.jit
def _weight_fp8_words_kernel(
    codes_ptr, scales_ptr, mbs_ptr, fp8_ptr, scale_ptr,
    N, K, KP, NCH, ROWS,
    stride_cm, stride_sm, stride_mm, stride_fm, stride_sc,
    HAS_MBS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr,
    VAL_DTYPE: tl.constexpr, HW_FP8: tl.constexpr,
):  # fmt: skip
    W: tl.constexpr = BLOCK_K // 8  # words per tile row
    NB: tl.constexpr = BLOCK_K // 16  # 16-blocks per tile row (two words each)
    NC: tl.constexpr = BLOCK_K // CHUNK_K  # chunks per tile row
    BPC: tl.constexpr = CHUNK_K // 16
    offs_m = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    k0 = tl.program_id(1) * BLOCK_K
    live_m = offs_m < N  # rows N..ROWS-1 are the padding: zeros
    rows = offs_m.to(tl.int64)

    # the codes as int32 words (8 codes, element 8j + p in nibble p); zeros past K and N
    wj = k0 // 8 + tl.arange(0, W)
    words_ptr = codes_ptr.to(tl.pointer_type(tl.int32), bitcast=True)
    q = tl.load(
        words_ptr + rows[:, None] * (stride_cm // 4) + wj[None, :],
        mask=live_m[:, None] & (wj[None, :] < K // 8),
        other=0,
    )
    s = _load_block_scales(scales_ptr, rows, live_m, k0, K, stride_sm, NB)

    # ref per chunk: the largest scale of a block with a nonzero magnitude, minus TOP
    mag = tl.reshape(q & E2M1_MAGNITUDE_BITS, (BLOCK_M, NB, 2))
    nonzero = tl.max(mag, axis=2) != 0
    s_max = tl.max(tl.reshape(tl.where(nonzero, s, -1), (BLOCK_M, NC, BPC)), axis=2)
    ref = tl.where(s_max >= 0, s_max - TOP, 127)
    ref_b = tl.reshape(tl.broadcast_to(ref[:, :, None], (BLOCK_M, NC, BPC)), (BLOCK_M, NB))
    shift = tl.minimum(tl.maximum(s - ref_b + 127, WORD_SCALE_MIN), WORD_SCALE_MAX)
    fac = e8m0_word_scales(shift, 2, VAL_DTYPE)  # 2^(s - ref) in the planes' column order

    # values of nibbles p and p + 4 (plane p: column 2j + h is element 8j + p + 4h), scaled
    v0 = tl.reshape(e2m1_word_values(q, 0, VAL_DTYPE) * fac, (BLOCK_M, W, 2))
    v1 = tl.reshape(e2m1_word_values(q, 1, VAL_DTYPE) * fac, (BLOCK_M, W, 2))
    v2 = tl.reshape(e2m1_word_values(q, 2, VAL_DTYPE) * fac, (BLOCK_M, W, 2))
    v3 = tl.reshape(e2m1_word_values(q, 3, VAL_DTYPE) * fac, (BLOCK_M, W, 2))
    # back to K order: [row, j, h, p] with p = 2 * (p >> 1) + (p & 1) -> element 8j + 4h + p
    v = tl.reshape(tl.join(tl.join(v0, v2), tl.join(v1, v3)), (BLOCK_M, BLOCK_K))
    if HW_FP8:  # the GPU's conversion (RNE), from bf16
        byte = v.to(tl.float8e4nv).to(tl.uint8, bitcast=True)
    else:  # fp32 values (the interpreter): the magnitude from the bits, then the sign
        vb = v.to(tl.int32, bitcast=True)
        mag_byte, _ = e4m3_convert(tl.abs(v), False)
        byte = (mag_byte | tl.where(vb < 0, 0x80, 0)).to(tl.uint8)

    offs_k = k0 + tl.arange(0, BLOCK_K)
    in_rows = offs_m < ROWS
    tl.store(
        fp8_ptr + rows[:, None] * stride_fm + offs_k[None, :],
        byte,
        mask=in_rows[:, None] & (offs_k[None, :] < KP),
    )
    _store_chunk_scales(mbs_ptr, scale_ptr, ref, rows, live_m, in_rows, NCH, stride_mm,
                        stride_sc, HAS_MBS, NC)  # fmt: skip


@triton.jit
def _weight_fp8_chunks_kernel(
    codes_ptr, scales_ptr, mbs_ptr, fp8_ptr, scale_ptr,
    N, K, KP, NCH, ROWS,
    stride_cm, stride_sm, stride_mm, stride_fm, stride_sc,
    HAS_MBS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr,
    HW_FP8: tl.constexpr,
):  # fmt: skip
    NC: tl.constexpr = BLOCK_K // CHUNK_K  # chunks per tile
    NB: tl.constexpr = BLOCK_K // 16  # 16-blocks per tile
    HALF: tl.constexpr = BLOCK_K // 2  # code bytes per tile row
    offs_m = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    k0 = tl.program_id(1) * BLOCK_K
    live_m = offs_m < N  # rows N..ROWS-1 are the padding: zeros, as pad_rows makes them
    rows = offs_m.to(tl.int64)  # row * stride overflows int32 for N * K >= 2^31

    # codes: two per byte, element 2i in the low nibble; zeros past K and past N
    kb = k0 // 2 + tl.arange(0, HALF)
    cb = tl.load(
        codes_ptr + rows[:, None] * stride_cm + kb[None, :],
        mask=live_m[:, None] & (kb[None, :] < (K + 1) // 2),
        other=0,
    ).to(tl.int32)
    c = tl.reshape(tl.join(cb & 15, cb >> 4), (BLOCK_M, BLOCK_K))
    offs_k = k0 + tl.arange(0, BLOCK_K)
    c = tl.where(offs_k[None, :] < K, c, 0)
    c3 = tl.reshape(c, (BLOCK_M, NB, 16))
    mag = c3 & 7
    neg = (c3 >> 3) & 1

    # E8M0 block scales (code 0 past K: the padding's), MBS bytes per chunk (0: F = 1)
    s = _load_block_scales(scales_ptr, rows, live_m, k0, K, stride_sm, NB)
    every = tl.full((BLOCK_M, NB), 1, tl.int32)
    byte, ref, _exact, _ok = encode_live(s, mag, neg, every, BLOCK_M, NC, NB, HW_FP8)

    in_rows = offs_m < ROWS
    tl.store(
        fp8_ptr + rows[:, None] * stride_fm + offs_k[None, :],
        tl.reshape(byte, (BLOCK_M, BLOCK_K)).to(tl.uint8),
        mask=in_rows[:, None] & (offs_k[None, :] < KP),
    )
    _store_chunk_scales(mbs_ptr, scale_ptr, ref, rows, live_m, in_rows, NCH, stride_mm,
                        stride_sc, HAS_MBS, NC)  # fmt: skip


def _tile_sizes(rows: int, kp: int, words: bool) -> tuple[int, int]:
    """(BLOCK_M, BLOCK_K): large tiles for the interpreter (it pays per program); on the GPU
    ~2K elements per program for the byte kernel, 8K for the word kernel (memory-bound)."""
    kp2 = triton.next_power_of_2(kp)
    if interpreting():
        return min(64, triton.next_power_of_2(rows)), min(kp2, 4096)
    block_m = WORDS_BLOCK_M if words else GPU_BLOCK_M
    return min(block_m, triton.next_power_of_2(rows)), min(kp2, GPU_BLOCK_K)


def weight_fp8_chunks(
    codes: torch.Tensor, scales: torch.Tensor, mbs: torch.Tensor | None, k: int, rows: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Packed weight (codes uint8 [N, ceil(K/2)], E8M0 scales [N, ceil(K/16)], MBS bytes
    [N, ceil(K/128)] or None) -> (FP8 E4M3 [rows, Kp], fp32 scales [Kp/128, rows]), rows >= N
    (the extra rows are zeros). New tensors, for one GEMM."""
    n = codes.shape[0]
    if rows < n:
        raise ValueError(f"weight_fp8_chunks: rows={rows} < the weight's {n} rows")
    if mbs is not None and mbs.shape[0] != n:
        raise ValueError(f"weight_fp8_chunks: mbs has {mbs.shape[0]} rows, codes {n}")
    check_available(codes)
    kp = ceil_to(k, CHUNK)
    nc = kp // CHUNK
    fp8 = torch.empty((rows, kp), dtype=torch.uint8, device=codes.device)
    scale = torch.empty((nc, rows), dtype=torch.float32, device=codes.device)
    words = codes_aligned(k, codes)
    block_m, block_k = _tile_sizes(rows, kp, words)
    mbs_arg = mbs if mbs is not None else codes  # not read without MBS
    extra = {"VAL_DTYPE": dot_dtype()} if words else {}
    hw_fp8 = not interpreting()  # the GPU's E4M3 conversion (`quant_blocks.e4m3_convert`)
    launch(
        _weight_fp8_words_kernel if words else _weight_fp8_chunks_kernel,
        (triton.cdiv(rows, block_m), triton.cdiv(kp, block_k)),
        codes,
        scales,
        mbs_arg,
        fp8,
        scale,
        n,
        k,
        kp,
        nc,
        rows,
        codes.stride(0),
        scales.stride(0),
        mbs_arg.stride(0),
        fp8.stride(0),
        scale.stride(0),
        HAS_MBS=mbs is not None,
        BLOCK_M=block_m,
        BLOCK_K=block_k,
        HW_FP8=hw_fp8,
        **extra,
    )
    return fp8.view(torch.float8_e4m3fn), scale


def scratch_bytes(n: int, k: int) -> int:
    """Bytes of the per-call temporary for an [n, k] weight (rows padded to 8)."""
    rows, kp = ceil_to(n, 8), ceil_to(k, CHUNK)
    return rows * kp + 4 * rows * ceil_div(kp, CHUNK)
