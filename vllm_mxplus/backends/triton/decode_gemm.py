"""Triton decode GEMM: y[M, N] = x_hat @ W_hat^T, built for few rows (M ~ 1..16), correct
for any M (row tiles of BLOCK_M on the grid's third axis, rows past M masked).

Both operands arrive quantized (packed E2M1 codes, E8M0 block scales, optional MBS bytes),
so decode and prefill compute the same x_hat. Each program streams a [BLOCK_N, BLOCK_K]
tile of packed weights, with one load per scale block and its MBS bytes, exactly once;
dequantizes in registers; and multiplies with tl.dot, accumulating in fp32.

Why the numbers are (nearly) those of the reference x_hat @ W_hat^T:
- value(code) * 2^e is exact in fp32 and in bf16 (two significant bits), so the tensor-core
  dot on bf16 operands forms exact products and accumulates them in fp32.
- MBS divides every element by F = 1 + m/256 (x_hat = value * X / F). F is constant over a
  macro block (MACRO = 128 by default, any power of two >= 16) of each row of x and of W, so
  instead of dividing elements the kernel scales the partial product of each macro block's
  K range by sigma_x[m] * sigma_w[n], sigma = fp32(1 / F) from an IEEE division (`div_rn`;
  the default `/` lowers to the approximate div.full.f32, up to 2 ulp) of one value per row:
  the paper's per-chunk sigma_A * sigma_B (section 4.3.2, Appendix E), two fp32 roundings
  per partial where dividing each partial would cost an IEEE division per output element
  (on the GPU the reciprocal is an approximate one refined by a Newton step, the same
  correctly rounded value: `gemm_blocks.mbs_sigma`).
  MACRO >= BLOCK_K: a K step lies inside one macro block, one scaling per step. MACRO <
  BLOCK_K (16 / 32 / 64 in the GPU's 128-element step): on the word path x's operand rows
  are one per (row, macro block of the step) (`sub_blocks`), each holding its row's columns
  of that macro block only, so the step's dots give every macro block's partial in its own
  accumulator row, scaled there by its own sigmas; the rows of each activation row are
  summed after the K loop. On the byte path (code rows that do not vectorize, 64-element
  steps) the step runs one dot per macro block on x with the other macro blocks' columns
  zeroed (x is the small operand), each partial scaled by its own sigmas, summed in the step.
The only differences left are fp32 rounding order; the tests bound them against float64
(docs/numerics.md, "Kernel numerics and error bounds").
Row offsets (row * stride) are 64-bit: N*K/2 or M*K/2 bytes reach 2^31 on large layers. Only
the tile's first row is offset in 64 bits; offsets inside a tile are 32-bit (the wrapper
checks that they fit), so no 64-bit pointer tile is kept live across the K loop.

Tile (`mxplus kernels --aot`, `benchmarks/gpu_static_model.py`, kernels/README.md): 4 warps,
a 16 x 128 output tile and 128 K elements per step (every macro block: the narrower ones
by operand rows per macro block, `sub_blocks`): the x tile (tl.dot's A operand, which
every warp dequantizes for itself) and the per-step costs are paid once per 16384 weights,
at up to ~250 registers (2 blocks per SM), where a 16 x 32 x 64 tile takes <= 96 (5
blocks) but issued ~2.6x the instructions per weight. The weight tile is loaded and
dequantized as stored, [BLOCK_N, bytes], and transposed for the dot, so it reaches shared
memory in 16-byte stores (as [bytes, BLOCK_N] it took one 2-byte store per element). The
K mask compares byte indices with the row's byte count KB, so on 16-divisible shapes it is
constant over a scale block and the weight loads vectorize (and pipeline as cp.async).

The packed layout puts element 2i in the low nibble and 2i+1 in the high nibble of byte i,
for x and W alike, so the kernel never interleaves: it computes
dot(x_lo, W_lo^T) + dot(x_hi, W_hi^T) over the even and the odd elements.

Word path (`word_path`: code rows that vectorize, K steps inside one macro block, the
default MBS configuration included): the codes are read as int32 words of 8 codes and
each K step runs four dots, dot p over the elements 8j + p and 8j + p + 4 of every word j,
whose values are built two at a time in the halves of a 32-bit register (`_word_step`,
`gemm_blocks.e2m1_word_values`): a shift and a mask per pair of values, then packed bf16
multiplies, where the byte path builds, scales and converts one fp32 value at a time. Same
values, same products, a permuted order of K inside each scale block: the bound above
holds unchanged. Counted on sm_90 (`benchmarks/gpu_static_model.py`), MBS-128: 1538 ->
960 warp-instructions per 16384 weights, 254 -> 179 registers.

Weight as the A operand (`weight_is_a`: E8M0 row tiles of <= 32 rows on sm_80 / sm_90): the
word path's dots compute the transposed product W x^T into an accumulator [BLOCK_N,
BLOCK_M], transposed once after the K loop. The 128 weight rows fill the MMA's M side, so
sm_90 issues wgmma with the decoded weight straight from registers and x_hat from shared
memory, where x as A (16 rows) meant mma.sync and register copies of x for every MMA. With
the cheaper pair decode (`gemm_blocks.e2m1_word_pair_bits`), the Newton-refined sigma and
loads the compiler may vectorize (K slices start on whole steps), sm_90 counts 671 -> 533
warp-instructions per 16384 weights at 16 rows (0.164 -> 0.130 per weight), 866 -> 626 at
32 rows, with 161 registers (3 programs per SM, as before).

Signs lifted (LIFT: the folded word path, but for the grouped experts, whose tile then spilled,
and MX+ with the weight as B, which counted more): each word's sign bits moved once by a
rotation and two selects (`gemm_blocks.e2m1_lifted_pair_bits`), then 2 instructions per pair
of values where 3 were spent: sm_90 counts 545 -> 505 per 16384 weights at 16 rows (0.1233
per weight), sm_100 562 -> 542 (kernels/README.md, "The signs lifted once per word").

The slim tile (`slim_tile`: the served decode's 16-row tiles on x_hat, E8M0 with folded scales
and NVFP4 on every GPU, MX+ and E8M0's 32-row tiles where four warps would run tcgen05): 64
weight rows by 2 warps with the weight as A, so every GPU issues mma.sync with the decoded
weight in registers (four warps made sm_90 issue wgmma and sm_100 tcgen05, whose A comes from
shared memory): MBS-128 sm_90 0.1172 -> 0.1086 warp-instructions per weight, sm_100 0.1279 ->
0.1045, NVFP4 0.1914 -> 0.1746; the split-K plan launches twice the programs per SM for it.

x's sigmas ready (X_SIGMA: `decode_gemm`'s x_sigma, the word path on x_hat): `act_quant_hat`
writes sigma_x = fp32(1 / F) per row and macro block beside x_hat (an IEEE division, the
value `mbs_sigma` gives), so no program computes it from the byte per step (each thread held
4 of the tile's x rows in wgmma's layout, each a byte load and 6 instructions): sm_90 505 ->
480 per 16384 weights at 16 rows (0.1172 per weight), 594 -> 537 at 32 rows.

NVFP4's scales folded (W_FOLD with NVFP4, `gemm_blocks.e4m3_fold_scales`): the E4M3 scale as
a packed bf16 pair of 2^126 * scale * 2^-8 built from its bits, one multiply per two weights
as E8M0's folded scales have, the sums times 2^8 after the K loop; and where the weight is
the A operand the word step's dots accumulate into the accumulator itself (no FADD per
accumulator and step; `_word_step`'s INTO_ACC): NVFP4 at 16 rows sm_90 0.1746 -> 0.1184
warp-instructions per weight, sm_100 0.1746 -> 0.1182. (E8M0 without MBS in place too
counted 0.0894 for MXFP4-16-OAS but spilled BS 32's slim tile on sm_100: left out.)

MX+ at one row (ONE_ROW: a launch with M = 1): the block maxima's rest (`_block_max_deltas`)
summed into a vector of the tile's weight rows across the K loop and added once after it,
where each step added it row by row into the accumulator (a loop inside the K loop, which
kept the loads out of the software pipeline, and a layout change per step): sm_100 0.1707 ->
0.1458, sm_90 (the slim tile then: `slim_tile`) 0.1604 -> 0.1462. The rest read from one
16-bit word per block built at load (`plus_words`: delta's bf16 bits over the position),
where each step gathered the block max's code byte and read the index and the scale: 0.1462
-> 0.1060 (sm_90 and sm_100).
MX+ at 2-16 rows (`_block_max_rows`): the rest summed apart across the K loop too, into
[BLOCK_N, BLOCK_M] sums, the rows unrolled so that a pass adds one sum per thread (29
instructions a pass on sm_90), where a loop over the rows selected the whole accumulator per
pass (62): at 16 live rows sm_90 0.354 -> 0.241 per weight, sm_100 0.382 -> 0.219.

Macro blocks narrower than the step (SUB: `sub_blocks`), where one dot per macro block on
zeroed x columns in 64-element steps counted 0.9619 / 0.6333 / 0.1880 warp-instructions per
weight at one row (macro blocks 16 / 32 / 64, sm_90): the operand rows per macro block
(macro-block-major, so an MMA thread's neighbouring accumulator columns share a macro
block), the weight's sigmas computed once per (weight row, macro block) as [BLOCK_N, SUB]
and broadcast over the rows in registers, the step's SUB MBS bytes of a row in one load:
0.1184 / 0.1138 / 0.1094 (sm_90), 0.1150 / 0.1096 / 0.1055 (sm_100; the weight's factors in
`mbs_factor`'s FMA form), no spill; at 16 rows (two 64-operand-row tiles at 16 and 32, each a
pass over the weight; one 32-row tile at 64) 2 x 0.1677, 2 x 0.1565, 0.1318 against 0.96 /
0.6519 / 0.1836 (sm_90).
"""

from __future__ import annotations

from typing import overload

import torch

from vllm_mxplus import settings
from vllm_mxplus.backends.triton.gemm_blocks import (
    E4M3_FOLD_UNDO,
    bf16_values,
    block_scale_values,
    block_word_scales,
    dot_f32,
    e2m1_folded_word_values,
    e2m1_pair_values,
    e2m1_word_values,
    e4m3_fold_scales,
    e8m0_fold_scales,
    macro_block_dot,
    mbs_factors,
    mbs_sigma,
    pair_dot,
    reduce_split_tile,
    store_out_tile,
    wait_prior_grid,
)
from vllm_mxplus.backends.triton.gemm_launch import (
    MAX_GRID_M_TILES,
    SPLIT_PLANES,
    SplitK,
    by_row_chunks,
    check_gemm_args,
    codes_aligned,
    dot_dtype,
    plan_split_k,
    split_k_result,
)
from vllm_mxplus.backends.triton.launch import (
    check_available,
    interpreting,
    launch,
    pdl_launch,
    target_capability,
    tl,
    triton,
)
from vllm_mxplus.backends.triton.plus_words import DELTA_MASK, POS_MASK
from vllm_mxplus.backends.triton.x_hat import HAT_CHUNK, HAT_DTYPE, hat_cols
from vllm_mxplus.formats.constants import ceil_div

SUPPORTED_BLOCK_SIZES = (16, 32)
GPU_BLOCK_M = 16  # tl.dot's minimum; rows past M are masked
# batched decode on x_hat (`gpu_block_m`): 32 rows, or 64 (wgmma on sm_90), per row tile
WIDE_BLOCK_MS = (32, 64)
# Tiles that need sm_90 or later (`sm90_or_later`): the 64-row tile (linears and grouped
# experts alike), where Triton issues wgmma (sm_90: 229-233 registers, no spill) and sm_80's
# mma.sync form holds the accumulators in registers and spills (255 registers: the unfolded
# weight scales of NVFP4, the grouped experts), so sm_80 gets 32-row tiles at most; and MX+
# (its block maxima, `_block_max_rows`), whose split-K tile ptxas capped at 168 registers on
# sm_80 and spilled 36 B, so MX+ keeps `mx_gemm` there
WIDE_MIN_CAPABILITY = 9
GPU_BLOCK_N = 128
GPU_BLOCK_K = 128  # K elements per step on the GPU: 64 bytes per weight row
# code rows whose byte count or pitch is not a multiple of 16 cannot vectorize their loads:
# per-byte masks and loads spill the wide tile, so they get this one (<= 96 registers)
UNALIGNED_BLOCK_N = 32
UNALIGNED_BLOCK_K = 64
# the served decode's tile (`slim_tile`): 64 weight rows by 2 warps, the weight as A
SLIM_BLOCK_N = 64
SLIM_NUM_WARPS = 2
GPU_NUM_WARPS = 4  # see the module docstring: registers per configuration in kernels/README.md
# software-pipeline stages of row tiles above GPU_BLOCK_M (Triton's default, 3, below): each
# stage carries the x_hat tile beside the weight tile, so two hold as many bytes in flight as
# three of the 16-row tile; with three, ptxas capped the 32-row tile on sm_80 at 168 registers
# and spilled, and every target issued more instructions per weight (kernels/README.md)
WIDE_NUM_STAGES = 2
# row tiles of at most this many rows make the weight the dot's A operand (`weight_is_a`)
W_A_MAX_ROWS = 32
# row tiles of at most this many rows with the weight as A select the pair bits by one LOP3
# (`gemm_blocks.e2m1_word_pair_bits`)
LOP3_MAX_ROWS = tl.constexpr(16)
# GPUs whose tensor cores (tcgen05) take their A operand from shared or tensor memory only
TCGEN05_MAJORS = (10, 11)
MAX_TILE_OFFSET = 2**31  # in-tile offsets are 32-bit
HAT_STEP = tl.constexpr(HAT_CHUNK)  # x_hat's chunk, read inside the kernel
# the largest weight scale code whose 2^126 * 2^(code - 127) is a finite bf16 (`_word_step`)
FOLD_MAX_SCALE_CODE = 128


@triton.jit
def _decode_gemm_kernel(
    xc_ptr,
    xs_ptr,
    xmbs_ptr,
    wc_ptr,
    ws_ptr,
    wmbs_ptr,
    bias_ptr,
    out_ptr,
    y_ptr,
    cnt_ptr,
    xh_ptr,
    pairs_ptr,
    tile_expert_ptr,
    xg_ptr,
    wg_ptr,
    M,
    N,
    K,
    KB,
    K_PER_SPLIT,
    N_EXPERTS,
    TOPK,
    stride_xcm,
    stride_xsm,
    stride_xmm,
    stride_wcn,
    stride_wsn,
    stride_wmn,
    stride_os,
    stride_om,
    stride_ym,
    stride_xhm,
    BS: tl.constexpr,
    MACRO: tl.constexpr,
    X_MBS: tl.constexpr,
    W_MBS: tl.constexpr,
    X_SIGMA: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    DOT_DTYPE: tl.constexpr,
    WORDS: tl.constexpr,
    W_FOLD: tl.constexpr,
    EVEN: tl.constexpr,
    X_HAT: tl.constexpr,
    MOE: tl.constexpr,
    NVFP4: tl.constexpr,
    PLUS: tl.constexpr,
    W_A: tl.constexpr,
    REDUCE: tl.constexpr,
    PDL: tl.constexpr,
    ONE_ROW: tl.constexpr,
    SUB: tl.constexpr,
):
    if PDL:  # launched early (`pdl_launch`): nothing is read before the kernel before it ends
        wait_prior_grid()
    NB: tl.constexpr = BLOCK_K // BS  # scale blocks per K step
    # the scale byte of value 1 (masked-off blocks): E4M3 0x38, E8M0 127
    SCALE_ONE: tl.constexpr = 0x38 if NVFP4 else 127
    HB: tl.constexpr = BS // 2  # bytes per scale block
    # SUB > 1 (`sub_blocks`): the step holds SUB macro blocks; x's operand row i holds the
    # activation row i % RM restricted to the step's macro block i // RM, so the tile serves
    # RM activation rows and each macro block's partial lands in its own row
    RM: tl.constexpr = BLOCK_M // SUB
    pid_n = tl.program_id(0)
    pid_s = tl.program_id(1)  # split-K slice
    pid_m = tl.program_id(2)
    m0 = pid_m * RM
    n0 = pid_n * BLOCK_N
    i_m = tl.arange(0, BLOCK_M)
    if SUB > 1:
        tl.static_assert(WORDS and not MOE and not NVFP4 and not PLUS,
                         "rows per macro block: the E8M0 word path of the linears")  # fmt: skip
        # macro-block-major: neighbouring operand rows (an MMA thread's accumulator
        # columns) share a macro block, and so the weight's sigma
        x_r = i_m % RM  # the operand row's activation row in the tile
        t_m = i_m // RM  # its macro block in the step
    else:
        x_r = i_m
    i_n = tl.arange(0, BLOCK_N)
    i_b = tl.arange(0, NB)
    i_h = tl.arange(0, HB)
    if MOE:  # (`moe_decode`): x_hat rows gathered through the row tile's pairs
        tl.static_assert(X_HAT and WORDS, "MOE reads x_hat on the word path")
        tl.static_assert(not NVFP4 and not PLUS, "MOE reads E8M0 experts")
        expert = tl.load(tile_expert_ptr + pid_m)
        if expert >= N_EXPERTS:
            return  # a tile past the last expert's rows
        pair = tl.load(pairs_ptr + pid_m * BLOCK_M + i_m)
        mask_m = pair < M  # M: the number of pairs; pairs == M pad the tile
        pair = tl.where(mask_m, pair, 0)
        # w13: the pair's token; w2: the pair's own row. 32-bit offsets: the launcher checks
        # that every row of x_hat and of the MBS bytes is addressable so (`moe_decode`)
        x_row = pair // TOPK
        out_row = pair.to(tl.int64)
        w_row0 = (expert * N + n0).to(tl.int64)  # the expert's weight rows: a packed [E*N, .]
    else:
        mask_m = (m0 + x_r) < M
        out_row = (m0 + i_m).to(tl.int64)
        w_row0 = n0.to(tl.int64)
    if EVEN:  # whole tiles: no column past N (a constant mask, which the compiler drops)
        mask_n = tl.full((BLOCK_N,), 1, tl.int1)
    else:
        mask_n = (n0 + i_n) < N
    # 64-bit offsets of the tile's first row, 32-bit ones inside the tile (module docstring)
    xc_base = xc_ptr + m0.to(tl.int64) * stride_xcm
    xs_base = xs_ptr + m0.to(tl.int64) * stride_xsm
    wc_base = wc_ptr + w_row0 * stride_wcn
    ws_base = ws_ptr + w_row0 * stride_wsn
    wm_base = wmbs_ptr + w_row0 * stride_wmn
    # MBS bytes of macro block c of the tile's rows: x at xm_base + c + xm_off, W likewise
    if MOE:  # gathered rows: offsets from the base
        xm_base = xmbs_ptr
        xm_off = x_row * stride_xmm
    else:
        xm_base = xmbs_ptr + m0.to(tl.int64) * stride_xmm
        xm_off = x_r * stride_xmm
    wm_off = i_n * stride_wmn
    if SUB > 1:  # each operand row's own macro block: x's sigmas, and W's bytes per (n, t)
        xm_off += t_m
        i_sub = tl.arange(0, SUB)
        if W_A:
            wm_off = wm_off[:, None] + i_sub[None, :]
        else:
            wm_off = i_sub[:, None] + wm_off[None, :]
    # x tile [BLOCK_M, NB, HB] and its scales [BLOCK_M, NB, 1]
    jx = i_b[None, :, None] * HB + i_h[None, None, :]
    x_off = i_m[:, None, None] * stride_xcm + jx
    xs_off = i_m[:, None, None] * stride_xsm + i_b[None, :, None]
    # weight tile [BLOCK_N, NB, HB] (rows contiguous in K, as stored) and its scales
    # [BLOCK_N, NB, 1]; transposed for the dot after dequantization
    jw = i_b[None, :, None] * HB + i_h[None, None, :]
    w_off = i_n[:, None, None] * stride_wcn + jw
    ws_off = i_n[:, None, None] * stride_wsn + i_b[None, :, None]

    acc = tl.zeros((BLOCK_M, BLOCK_N), tl.float32)
    # the word path's accumulator: transposed where the weight is the dot's A operand (W_A)
    if W_A:
        acc_w = tl.zeros((BLOCK_N, BLOCK_M), tl.float32)
    else:
        acc_w = tl.zeros((BLOCK_M, BLOCK_N), tl.float32)
    k_start = pid_s * K_PER_SPLIT
    k_end = tl.minimum(k_start + K_PER_SPLIT, K)
    # WORDS: the codes as int32 words, 8 codes each (`_word_step`)
    WPS: tl.constexpr = BLOCK_K // 8  # words per row per step
    i_w = tl.arange(0, WPS)
    xw_base = xc_base.to(tl.pointer_type(tl.int32), bitcast=True)
    ww_base = wc_base.to(tl.pointer_type(tl.int32), bitcast=True)
    xw_off = x_r[:, None] * (stride_xcm // 4) + i_w[None, :]
    ww_off = i_n[:, None] * (stride_wcn // 4) + i_w[None, :]
    xs_off2 = x_r[:, None] * stride_xsm + i_b[None, :]
    ws_off2 = i_n[:, None] * stride_wsn + i_b[None, :]
    # X_HAT: dot p's x operand [BLOCK_M, BLOCK_K / 4] of the prepared activation, columns
    # 32p.. of each 128-element chunk of the step (`x_hat`'s word order)
    i_t = tl.arange(0, BLOCK_K // 4)
    xh_col = ((i_t // 32) * 128 + i_t % 32)[None, :]
    if MOE:
        xh_base = xh_ptr
        xh_off = x_row[:, None] * stride_xhm + xh_col
    else:
        xh_base = xh_ptr + m0.to(tl.int64) * stride_xhm
        xh_off = x_r[:, None] * stride_xhm + xh_col
    if SUB > 1:  # operand row i reads the words and x_hat columns of macro block i // RM only
        x_word_sel = (i_w // (MACRO // 8))[None, :] == t_m[:, None]
        # x_hat column 2j + h of each dot's 32 per chunk holds an element of word j of the
        # chunk (`x_hat`): macro block (32 c + 2j + h) // (MACRO / 4) of the step
        x_hat_sel = (i_t // (MACRO // 4))[None, :] == t_m[:, None]
    else:
        x_word_sel = tl.full((1, WPS), 1, tl.int1)
        x_hat_sel = tl.full((1, BLOCK_K // 4), 1, tl.int1)
    if PLUS:  # MX+ (`_word_step`): x_hat rows and the weight's block-max word columns
        tl.static_assert(X_HAT and WORDS and not MOE, "MX+ reads x_hat on the word path")
        wbm_off = i_n[:, None] * stride_wmn + i_b[None, :]
        bm1 = tl.zeros((BLOCK_N,), tl.float32)
        bmr = tl.zeros((BLOCK_N, BLOCK_M), tl.float32)
    for k0 in range(k_start, k_end, BLOCK_K):
        # slices start on whole steps (`plan_split_k`): said, the weight's codes and scales
        # load in 16- and 8-byte pieces (E8M0; NVFP4's E4M3 scales count fewer instructions
        # without)
        k0 = tl.multiple_of(k0, BLOCK_K)
        kb0 = k0 // 2
        if NVFP4:
            kw0 = k0 // 8
            sb0 = k0 // BS
        else:
            kw0 = tl.multiple_of(k0 // 8, BLOCK_K // 8)
            sb0 = tl.multiple_of(k0 // BS, BLOCK_K // BS)
        left = K - k0
        if WORDS:
            if EVEN:  # constant masks, dropped by the compiler
                word_ok = tl.full((WPS,), 1, tl.int1)
                block_ok = tl.full((1, NB), 1, tl.int1)
                hat_ok = tl.full((1, BLOCK_K // 4), 1, tl.int1)
            else:
                word_ok = i_w < (KB - kb0) // 4
                block_ok = i_b[None, :] * BS < left
                # x_hat's chunks inside its rows (whole chunks, `hat_cols`): the same per dot
                hat_ok = ((i_t // 32) * 128 < tl.cdiv(K, 128) * 128 - k0)[None, :]
            # the step's first macro block: SUB-aligned (the weight's SUB bytes load as one)
            mb0 = tl.multiple_of(k0 // MACRO, SUB)
            if SUB > 1 and not EVEN:  # a macro block past K has no MBS byte or sigma to read
                mask_mb = mask_m & (k0 + t_m * MACRO < K)
                if W_A:
                    wm_mask = mask_n[:, None] & (k0 + i_sub * MACRO < K)[None, :]
                else:
                    wm_mask = (k0 + i_sub * MACRO < K)[:, None] & mask_n[None, :]
            elif SUB > 1:  # whole steps: every macro block of the step lies inside K
                mask_mb = mask_m
                if W_A:
                    wm_mask = mask_n[:, None] & tl.full((1, SUB), 1, tl.int1)
                else:
                    wm_mask = tl.full((SUB, 1), 1, tl.int1) & mask_n[None, :]
            else:
                mask_mb = mask_m
                wm_mask = mask_n
            acc_w = _word_step(
                acc_w, xw_base + kw0 + xw_off, xs_base + sb0 + xs_off2,
                ww_base + kw0 + ww_off, ws_base + sb0 + ws_off2,
                xm_base + mb0 + xm_off, wm_base + mb0 + wm_off,
                xh_base + k0 + xh_off, mask_mb, mask_n, wm_mask,
                mask_m[:, None] & word_ok[None, :] & x_word_sel,
                mask_m[:, None] & hat_ok & x_hat_sel, word_ok, block_ok,
                BS, X_MBS, W_MBS, X_SIGMA, BLOCK_M, BLOCK_N, BLOCK_K, DOT_DTYPE, W_FOLD, EVEN,
                X_HAT, NVFP4, SCALE_ONE, W_A, not MOE and (W_A or not PLUS), (NVFP4 and W_A) or ONE_ROW,
            )  # fmt: skip
            if PLUS and ONE_ROW:
                delta, hp, has = _block_max_deltas(
                    wm_base + sb0 + wbm_off, mask_n, block_ok, BS, BLOCK_K
                )  # fmt: skip
                xg = tl.load(xh_base + k0 + hp, mask=has, other=0.0).to(tl.float32)
                bm1 += tl.sum(xg * delta, axis=1)
            elif PLUS:
                bmr = _block_max_rows(
                    bmr, xh_base + k0, wm_base + sb0 + wbm_off, tl.minimum(BLOCK_M, M - m0),
                    stride_xhm, mask_n, block_ok, BS, BLOCK_M, BLOCK_K,
                )  # fmt: skip
        else:
            # bytes past the row's KB; for odd K the last high nibble is code 0 (pack_fp4's padding)
            mx = mask_m[:, None, None] & (jx < KB - kb0)
            xb = tl.load(xc_base + kb0 + x_off, mask=mx, other=0).to(tl.int32)
            xs = tl.load(
                xs_base + sb0 + xs_off,
                mask=mask_m[:, None, None] & (i_b[None, :, None] * BS < left),
                other=SCALE_ONE,
            )
            xsv = block_scale_values(xs.to(tl.int32), NVFP4)
            xv_lo, xv_hi = e2m1_pair_values(xb)
            x_lo = tl.reshape((xv_lo * xsv).to(DOT_DTYPE), (BLOCK_M, BLOCK_K // 2))
            x_hi = tl.reshape((xv_hi * xsv).to(DOT_DTYPE), (BLOCK_M, BLOCK_K // 2))

            mw = (jw < KB - kb0) & mask_n[:, None, None]
            wb = tl.load(wc_base + kb0 + w_off, mask=mw, other=0).to(tl.int32)
            ws = tl.load(
                ws_base + sb0 + ws_off,
                mask=(i_b[None, :, None] * BS < left) & mask_n[:, None, None],
                other=SCALE_ONE,
            )
            wsv = block_scale_values(ws.to(tl.int32), NVFP4)
            wv_lo, wv_hi = e2m1_pair_values(wb)
            w_lo = tl.trans(tl.reshape((wv_lo * wsv).to(DOT_DTYPE), (BLOCK_N, BLOCK_K // 2)))
            w_hi = tl.trans(tl.reshape((wv_hi * wsv).to(DOT_DTYPE), (BLOCK_N, BLOCK_K // 2)))

            if (X_MBS or W_MBS) and MACRO < BLOCK_K:
                # Macro blocks narrower than the K step (docs/numerics.md, "Kernel numerics and
                # error bounds"): one dot per macro block (`macro_block_dot`), each partial
                # divided once by its own exact Fx * Fw (two 9-bit integers over 2^16), the
                # quotients summed in the step.
                part = tl.zeros((BLOCK_M, BLOCK_N), tl.float32)
                for j in tl.static_range(BLOCK_K // MACRO):
                    pj = macro_block_dot(x_lo, x_hi, w_lo, w_hi, j, MACRO, BLOCK_K, DOT_DTYPE)
                    c = k0 // MACRO + j
                    fx, fw = mbs_factors(
                        xm_base + c + xm_off, wm_base + c + wm_off,
                        k0 + j * MACRO < K,  # a macro block past K: no byte to read
                        mask_m, mask_n, X_MBS, W_MBS,
                    )  # fmt: skip
                    sx, sw = mbs_sigma(fx, X_MBS, False), mbs_sigma(fw, W_MBS, False)
                    part += pj * sx[:, None] * sw[None, :]
            else:
                zero = tl.zeros((BLOCK_M, BLOCK_N), tl.float32)
                part = pair_dot(x_lo, x_hi, w_lo, w_hi, zero, DOT_DTYPE)
                if X_MBS or W_MBS:
                    # BLOCK_K divides MACRO here: the tile lies inside one macro block of every row
                    c = k0 // MACRO
                    fx, fw = mbs_factors(
                        xm_base + c + xm_off,
                        wm_base + c + wm_off,
                        True,
                        mask_m,
                        mask_n,
                        X_MBS,
                        W_MBS,
                    )
                    sx, sw = mbs_sigma(fx, X_MBS, False), mbs_sigma(fw, W_MBS, False)
                    part = part * sx[:, None] * sw[None, :]
            acc += part
    if PLUS and not ONE_ROW:
        if W_A:
            acc_w += bmr
        else:
            acc_w += tl.trans(bmr)
    if PLUS and ONE_ROW:
        if W_A:
            acc_w = tl.where((i_m == 0)[None, :], acc_w + bm1[:, None], acc_w)
        else:
            acc_w = tl.where((i_m == 0)[:, None], acc_w + bm1[None, :], acc_w)
    if WORDS:
        if W_A:
            acc = tl.trans(acc_w)
        else:
            acc = acc_w
    if SUB > 1:  # the macro blocks' rows of each activation row summed: [RM, BLOCK_N]
        acc = tl.sum(tl.reshape(acc, (SUB, RM, BLOCK_N)), axis=0)
        i_o = tl.arange(0, RM)
        mask_m = (m0 + i_o) < M
        out_row = (m0 + i_o).to(tl.int64)

    if NVFP4:  # the global scales, factored out of the sum (as `mx_gemm` applies them)
        if W_FOLD:  # the folded weight values' 2^-8 (`e4m3_fold_scales`), exactly
            acc = acc * E4M3_FOLD_UNDO
        gx = tl.load(xg_ptr + m0 + i_m, mask=mask_m, other=0.0)
        gw = tl.load(wg_ptr + n0 + i_n, mask=mask_n, other=0.0)
        acc = (acc * gx[:, None]) * gw[None, :]
    if REDUCE:  # split K, summed by the last slice of the tile (`plan_split_k`)
        tl.static_assert(not MOE, "the grouped experts do not split K")
        reduce_split_tile(
            out_ptr, acc, bias_ptr, y_ptr, cnt_ptr, m0, n0, M, N, pid_s, stride_os, stride_om,
            stride_ym, HAS_BIAS, RM, BLOCK_N, SPLIT_PLANES,
        )  # fmt: skip
    else:
        store_out_tile(
            out_ptr, acc, bias_ptr, out_row, n0, mask_m, mask_n, pid_s, stride_os, stride_om,
            HAS_BIAS, BLOCK_N,
        )  # fmt: skip


@triton.jit
def _word_step(
    acc, xw_ptrs, xs_ptrs, ww_ptrs, ws_ptrs, xm_ptrs, wm_ptrs, xh_ptrs, mask_m, mask_n, wm_mask,
    xw_ok, xh_ok, word_ok, block_ok, BS: tl.constexpr, X_MBS: tl.constexpr, W_MBS: tl.constexpr,
    X_SIGMA: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    DOT_DTYPE: tl.constexpr, W_FOLD: tl.constexpr, EVEN: tl.constexpr, X_HAT: tl.constexpr,
    NVFP4: tl.constexpr, SCALE_ONE: tl.constexpr, W_A: tl.constexpr, LIFT: tl.constexpr,
    INTO_ACC: tl.constexpr,
):  # fmt: skip
    """One K step of BLOCK_K elements read as int32 words of 8 codes (x [BLOCK_M, BLOCK_K/8]
    at xw_ptrs, W [BLOCK_N, BLOCK_K/8] at ww_ptrs; their block scale codes [rows, BLOCK_K/BS]
    at xs_ptrs / ws_ptrs; the step inside one macro block, whose MBS bytes are at xm_ptrs /
    wm_ptrs): acc ([BLOCK_M, BLOCK_N], transposed where W_A) plus the step's partial product,
    scaled by sigma_x * sigma_w. Without MBS, where INTO_ACC (the caller's rule: NVFP4 with
    the weight as A, and MX+ at one row), the dots accumulate into acc itself (the same fp32
    additions in the dots' order, where the step's partial added to acc spent an FADD per
    accumulator: NVFP4 sm_90 499 -> 485 per 16384 weights); elsewhere they did not pay (MX+
    with its block-max terms added into acc per step counted more; NVFP4's 32-row tile on
    sm_90 and E8M0 block 32's slim tile on sm_100 spilled).

    A dot sums over K in any order, so the step runs four dots of BLOCK_K / 4, dot p over
    the elements 8j + p and 8j + p + 4 of every word j (`e2m1_word_values`), the same
    permutation of K on both operands and inside each scale block. Each value is built two
    at a time in the halves of a 32-bit register (shifts and masks of the word, then packed
    bf16 multiplies by 2^126 and by the block scale), where the byte path builds one fp32
    value at a time and converts it. The values are those of the byte path, exactly.

    W_FOLD (every weight scale code <= 128, `small_weight_scales`): the weight's two
    multiplies are one, by 2^126 * scale = 2^(code - 1) (`e2m1_folded_word_values`), exact
    since the product is the same representable value; NVFP4 weights fold always, their
    E4M3 scales as 2^126 * scale * 2^-E4M3_FOLD_LOG2 (`e4m3_fold_scales`: every E4M3 scale
    folds), the kernel's sums multiplied back by 2^E4M3_FOLD_LOG2 after the K loop (a power of
    two on fp32 sums far from fp32's subnormals: the same sums). EVEN (whole tiles: N and K multiples
    of BLOCK_N and BLOCK_K, no K slice ends inside a step): the weight's loads are unmasked.
    X_HAT: x's values come ready from `act_quant_hat` (`x_hat`: dot p's operand is one
    contiguous load at xh_ptrs + 32p), so no program dequantizes x. LIFT: the folded weight
    values from `gemm_blocks.e2m1_lifted_pair_bits` (the module docstring says where)."""
    WPB: tl.constexpr = BS // 8  # words per scale block
    if not X_HAT:
        xq = tl.load(xw_ptrs, mask=xw_ok, other=0)
        xs = tl.load(xs_ptrs, mask=mask_m[:, None] & block_ok, other=SCALE_ONE).to(tl.int32)
        xsv = block_word_scales(xs, WPB, DOT_DTYPE, NVFP4)
    if EVEN:
        wq = tl.load(ww_ptrs)
        ws = tl.load(ws_ptrs).to(tl.int32)
    else:
        wq = tl.load(ww_ptrs, mask=mask_n[:, None] & word_ok[None, :], other=0)
        ws = tl.load(ws_ptrs, mask=mask_n[:, None] & block_ok, other=SCALE_ONE).to(tl.int32)
    if not W_FOLD:
        wsv = block_word_scales(ws, WPB, DOT_DTYPE, NVFP4)
    elif NVFP4:  # the sums carry 2^-E4M3_FOLD_LOG2, taken out after the K loop
        wsc = e4m3_fold_scales(ws, WPB, DOT_DTYPE)
    else:
        wsc = e8m0_fold_scales(ws, WPB, DOT_DTYPE)
    if X_MBS or W_MBS or not INTO_ACC:  # the step's partial, apart from acc
        part = tl.zeros(acc.shape, tl.float32)
    else:
        part = acc
    for p in tl.static_range(4):
        if X_HAT:
            xh = tl.load(xh_ptrs + 32 * p, mask=xh_ok, other=0.0)
            xp = bf16_values(xh, DOT_DTYPE)
        else:
            xp = e2m1_word_values(xq, p, DOT_DTYPE) * xsv
        if W_FOLD:
            # the select as one LOP3 where it helps: whole 16-row tiles with the weight as A
            # (elsewhere ptxas then needed more registers, and spilled some tiles)
            wp = e2m1_folded_word_values(
                wq, wsc, p, DOT_DTYPE, W_A and EVEN and BLOCK_M <= LOP3_MAX_ROWS, LIFT
            )
        else:
            wp = e2m1_word_values(wq, p, DOT_DTYPE) * wsv
        if W_A:
            part = dot_f32(wp, tl.trans(xp), part, DOT_DTYPE)
        else:
            part = dot_f32(xp, tl.trans(wp), part, DOT_DTYPE)
    if X_MBS or W_MBS:
        # X_SIGMA: x's sigmas come ready (fp32, `act_quant_hat`) where its MBS bytes would be
        fx, fw = mbs_factors(xm_ptrs, wm_ptrs, True, mask_m, wm_mask, X_MBS and not X_SIGMA,
                             W_MBS, True)  # fmt: skip
        newton: tl.constexpr = tl.bfloat16 == DOT_DTYPE  # the GPU (`mbs_sigma`)
        sx, sw = mbs_sigma(fx, X_MBS and not X_SIGMA, newton), mbs_sigma(fw, W_MBS, newton)
        if X_SIGMA:
            sx = tl.load(xm_ptrs, mask=mask_m, other=1.0)
        if len(sw.shape) == 2:  # [BLOCK_N, SUB] (W_A) or [SUB, BLOCK_N]: the caller's SUB
            sw2 = _over_operand_rows(sw, part, W_A)
        elif W_A:
            sw2 = sw[:, None]
        else:
            sw2 = sw[None, :]
        if W_A:
            part = acc + part * sx[None, :] * sw2
        else:
            part = acc + part * sx[:, None] * sw2
    elif not INTO_ACC:
        part = acc + part
    return part


@triton.jit
def _over_operand_rows(sw, part, W_A: tl.constexpr):
    """The weight's sigmas per (weight row, macro block of the step), sw [BLOCK_N, SUB] (or
    [SUB, BLOCK_N] where the weight is B), over the accumulator `part` [BLOCK_N, BLOCK_M] (or
    transposed) whose operand row i is macro block i // (BLOCK_M // SUB) (`sub_blocks`,
    macro-block-major): each sigma repeated over its macro block's BLOCK_M // SUB rows, in
    registers (computed once per (weight row, macro block), not once per accumulator)."""
    if W_A:
        rows = tl.broadcast_to(
            sw[:, :, None], (sw.shape[0], sw.shape[1], part.shape[1] // sw.shape[1])
        )  # fmt: skip
    else:
        rows = tl.broadcast_to(
            sw[:, None, :], (sw.shape[0], part.shape[0] // sw.shape[0], sw.shape[1])
        )  # fmt: skip
    return tl.reshape(rows, part.shape)


def sm90_or_later(device: torch.device) -> bool:
    """Whether `device` runs the tiles that need WIDE_MIN_CAPABILITY (the 64-row tile, MX+)
    (`launch.target_capability`; under the interpreter or on other devices, always: their
    tiles are not the GPU's)."""
    cap = target_capability(device)
    return cap is None or cap // 10 >= WIDE_MIN_CAPABILITY


def weight_is_a(device: torch.device, nvfp4: bool, block_m: int) -> bool:
    """Whether the word path's dots take the weight tile as their A operand (W_A: the
    accumulator [BLOCK_N, BLOCK_M], transposed once after the K loop): E8M0 row tiles of at
    most W_A_MAX_ROWS rows on GPUs whose tensor cores read A from registers (sm_80's and
    sm_90's; sm_90 then issues wgmma with the decoded weight in registers and x_hat from
    shared memory). Counted on sm_90 (`benchmarks/gpu_static_model.py`): 606 -> 533
    warp-instructions per 16384 weights at 16 rows, 781 -> 626 at 32 (the mma.sync form
    copied the x operand's registers for every MMA). Not on sm_100 (tcgen05 takes A from
    shared memory: 585 -> 768), nor for NVFP4 (E4M3 scales: 784 -> 869 on sm_90)."""
    if nvfp4 or block_m > W_A_MAX_ROWS:
        return False
    cap = target_capability(device)
    return cap is None or cap // 10 not in TCGEN05_MAJORS


@triton.jit
def _block_max_deltas(wbm_ptrs, mask_n, block_ok, BS: tl.constexpr, BLOCK_K: tl.constexpr):
    """The MX+ weights' block-max rest of one K step: (delta [BLOCK_N, NB], the position of
    each block max element in the step's x_hat chunks [BLOCK_N, NB], whether the block has
    one), from the weight's block-max words at wbm_ptrs (`plus_words`: delta's bf16 bits
    above the block max's position, 0 for none). The step's dots decoded every weight code
    as plain E2M1, so the block-max element of each block entered as +-E2M1(j) * X where
    the spec's value is +-(8 + j) / 2 * X (docs/numerics.md, "MX+"); the rest is
    x_hat[m, k] * delta[n, b] with delta = +-((8 + j) / 2 - E2M1(j)) * X. delta has the
    plain value's sign (both magnitudes are positive), so |x w| splits into |x plain| +
    |x delta| and the products stay exact: the bound's S is unchanged."""
    NB: tl.constexpr = BLOCK_K // BS
    i_b = tl.arange(0, NB)
    live = mask_n[:, None] & block_ok
    word = tl.load(wbm_ptrs, mask=live, other=0).to(tl.int32)
    bits = word & DELTA_MASK
    has = bits != 0
    delta = (bits << 16).to(tl.float32, bitcast=True)
    pos = i_b[None, :] * BS + (word & POS_MASK)  # the element within the step
    # x_hat's position of element pos: chunk pos // 128, then 32p + 2j + h (`x_hat`)
    e = pos % HAT_STEP
    hp = (pos // HAT_STEP) * HAT_STEP + (e % 4) * 32 + (e // 8) * 2 + (e // 4) % 2
    return delta, hp, has


@triton.jit
def _block_max_rows(bmr, xh_base, wbm_ptrs, rows, stride_xhm, mask_n, block_ok,
                    BS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr):  # fmt: skip
    """bmr [BLOCK_N, BLOCK_M] plus the block-max rest of one K step (`_block_max_deltas`) for
    each of the tile's `rows` live rows, the activation's values gathered from x_hat (the
    step's chunks in word order at xh_base, row pitch stride_xhm). Summed apart from the
    dots across the K loop and added to the accumulator once after it, as one row (the
    kernel's ONE_ROW) does. The rows unroll (BLOCK_M passes, each skipped past `rows`), so
    each pass's row is a constant: a thread holds its weight row's BLOCK_M sums and a pass
    adds one of them (29 instructions per pass on sm_90: 4 gathers, 4 products, one
    addition), where a loop over the rows selected every element of the accumulator per
    pass (62 instructions)."""
    i_m = tl.arange(0, BLOCK_M)
    delta, hp, has = _block_max_deltas(wbm_ptrs, mask_n, block_ok, BS, BLOCK_K)
    for r in tl.static_range(BLOCK_M):
        if r < rows:
            xg = tl.load(xh_base + r * stride_xhm + hp, mask=has, other=0.0).to(tl.float32)
            term = tl.sum(xg * delta, axis=1)  # [BLOCK_N]
            bmr = tl.where((i_m == r)[None, :], bmr + term[:, None], bmr)
    return bmr


def gpu_block_m(m: int, hat: bool, widest_ok: bool = True) -> int:
    """Rows per GPU row tile: GPU_BLOCK_M, or on the x_hat word path for more rows the
    smallest of WIDE_BLOCK_MS that holds them (64 above 32; 32 at most unless widest_ok,
    `sm90_or_later`). A wider row tile dequantizes each weight tile once for more rows (no x
    to dequantize there): sm_90 counts 533 / 626 / 667 instructions per warp per 16384
    weights at 16 / 32 / 64 rows (wgmma at all three), no spill."""
    if not hat or m <= GPU_BLOCK_M:
        return GPU_BLOCK_M
    sizes = WIDE_BLOCK_MS if widest_ok else WIDE_BLOCK_MS[:-1]
    return next((b for b in sizes if m <= b), sizes[-1])


def gpu_launch_options(block_m: int) -> dict[str, int]:
    """Triton launch options of a GPU row tile of block_m rows: GPU_NUM_WARPS warps, and
    WIDE_NUM_STAGES pipeline stages above GPU_BLOCK_M rows."""
    wide = {"num_stages": WIDE_NUM_STAGES} if block_m > GPU_BLOCK_M else {}
    return {"num_warps": GPU_NUM_WARPS, **wide}


def weight_kind(nvfp4: bool, plus: bool, small_scales: bool) -> str:
    """The decode weight as the tile choices tell it apart: "nvfp4", "mx+", "e8m0-folded" (E8M0
    scales that fold into the word path's exponent bits: `small_weight_scales`) or "e8m0"."""
    if nvfp4:
        return "nvfp4"
    if plus:
        return "mx+"
    return "e8m0-folded" if small_scales else "e8m0"


def slim_tile(block_m: int, hat: bool, kind: str, device: torch.device,
              one_row: bool = False) -> bool:  # fmt: skip
    """Whether a GPU launch takes the slim tile: SLIM_BLOCK_N weight rows by SLIM_NUM_WARPS
    warps, the weight the dots' A operand, on the x_hat word path (`hat`) where two warps
    count fewer instructions than four (`kind`: `weight_kind`'s). Two warps issue mma.sync on
    every GPU (the weight
    straight from registers), where four made sm_90 issue wgmma and sm_100 tcgen05 (its A from
    shared memory, so the weight stayed B there, its x operand rebuilt around every MMA): per
    8192 weights the same code as sm_80's four warps of 128 rows. Counted
    (`benchmarks/gpu_static_model.py`, warp-instructions per weight): 16 rows, E8M0 with
    folded scales (MBS-128) sm_90 0.1172 -> 0.1086, sm_100 0.1279 -> 0.1045, sm_80 0.1079 ->
    0.1082; NVFP4 0.1914 -> 0.1746 on both; MX+ on sm_100 0.1858 -> 0.1709 (sm_90's wgmma
    keeps it: 0.1604 against 0.1702); 32 rows on sm_100 0.1616 -> 0.1260 (sm_90's wgmma keeps
    them: 0.1311 against 0.1338); MX+ at one row (`one_row`: its block maxima summed apart
    from the dots across the K loop, the kernel's ONE_ROW) on every GPU, sm_90 0.1650 ->
    0.1462. E8M0 weights with unfolded scales (codes above 128) keep the four-warp tile. The split-K plan launches twice the programs per SM, so as many warps
    as before run on each."""
    if not hat or kind == "e8m0":
        return False
    cap = target_capability(device)
    tcgen05 = cap is not None and cap // 10 in TCGEN05_MAJORS
    if block_m == GPU_BLOCK_M:
        return tcgen05 or kind != "mx+" or one_row
    return block_m == WIDE_BLOCK_MS[0] and tcgen05 and kind == "e8m0-folded"


def gpu_tile(k: int, x_codes: torch.Tensor, w_codes: torch.Tensor) -> tuple[int, int]:
    """(BLOCK_N, BLOCK_K) on the GPU: the wide tile where the code rows vectorize
    (`gemm_launch.codes_aligned`; `mxplus kernels --aot` compiles both classes without a
    spill), else UNALIGNED_BLOCK_N x UNALIGNED_BLOCK_K."""
    if codes_aligned(k, x_codes, w_codes):
        return GPU_BLOCK_N, GPU_BLOCK_K
    return UNALIGNED_BLOCK_N, UNALIGNED_BLOCK_K


def sub_blocks(macro_block: int, has_mbs: bool, block_k: int) -> int:
    """Macro blocks per K step of the word path: block_k // macro_block where MBS macro blocks
    are narrower than the step (16 / 32 / 64 in the GPU's 128-element step), else 1. The
    kernel's SUB: x's operand row i holds activation row i % (BLOCK_M // SUB) restricted to
    the step's macro block i // (BLOCK_M // SUB) (its other columns zero), so one set of dots
    gives every macro block's partial in its own accumulator row, each scaled by its own
    sigma_x * sigma_w and the rows of an activation row summed after the K loop. A row tile of BLOCK_M operand rows
    serves BLOCK_M // SUB activation rows; the weight tile is loaded and dequantized once per
    step as at macro block 128 (the byte path instead ran one dot per macro block on x with
    the other macro blocks' columns zeroed: 0.9619 / 0.6333 / 0.1880 warp-instructions per
    weight at 16 / 32 / 64 on sm_90, kernels/README.md)."""
    return block_k // macro_block if has_mbs and macro_block < block_k else 1


def word_path(k: int, x_codes: torch.Tensor, w_codes: torch.Tensor) -> bool:
    """Whether the kernel reads the codes as int32 words (`_word_step`): code rows that
    vectorize (`gemm_launch.codes_aligned`: whole words, 4-byte pitches and bases). Steps
    holding several macro blocks take `sub_blocks`' operand rows per macro block."""
    return codes_aligned(k, x_codes, w_codes)


def reads_x_hat(k: int, x_codes: torch.Tensor, w_codes: torch.Tensor, block_k: int) -> bool:
    """Whether a launch with K steps of block_k reads an `act_quant_hat` activation: the word
    path (`word_path`) in steps of whole HAT_CHUNKs."""
    return word_path(k, x_codes, w_codes) and block_k % HAT_CHUNK == 0


def check_block_size(who: str, bs: int) -> None:
    """Raise ValueError naming `who` unless bs is one of SUPPORTED_BLOCK_SIZES."""
    if bs not in SUPPORTED_BLOCK_SIZES:
        raise ValueError(f"{who}: block_size must be one of {SUPPORTED_BLOCK_SIZES}, got {bs}")


def takes_x_hat(k: int) -> bool:
    """Whether the GPU kernel reads an `act_quant_hat` activation of a K-wide layer (the word
    path in steps of whole HAT_CHUNKs, every macro block) where the code rows vectorize
    (`codes_aligned`: rows of a multiple of 16 bytes, contiguous as the quantizers write
    them, and aligned weight rows): the caller asks for x_hat only then."""
    return ceil_div(k, 2) % 16 == 0 and GPU_BLOCK_K % HAT_CHUNK == 0


def small_weight_scales(w_scales: torch.Tensor) -> bool:
    """Whether every E8M0 weight scale code is <= FOLD_MAX_SCALE_CODE (block scales <= 2),
    so `decode_gemm(w_small_scales=True)` may fold 2^126 into them. A reduction and one host
    sync: call it once when the weight is loaded, never per forward."""
    return w_scales.numel() == 0 or int(w_scales.max()) <= FOLD_MAX_SCALE_CODE


def _infer_block_size(k: int, n_scales: int) -> int:
    for bs in SUPPORTED_BLOCK_SIZES:
        if ceil_div(k, bs) == n_scales:
            return bs
    raise ValueError(
        f"decode_gemm: {n_scales} scales per row fit no block size in "
        f"{SUPPORTED_BLOCK_SIZES} for K={k}"
    )


def _check_operand(
    name: str,
    codes: torch.Tensor,
    scales: torch.Tensor,
    mbs: torch.Tensor | None,
    k: int,
    bs: int,
    macro: int,
    nvfp4: bool,
) -> None:
    rows = codes.shape[0]
    if codes.dim() != 2 or codes.dtype != torch.uint8 or codes.shape[1] != ceil_div(k, 2):
        raise ValueError(
            f"decode_gemm: {name}_codes must be uint8 [rows, ceil(K/2)="
            f"{ceil_div(k, 2)}], got {codes.dtype} {tuple(codes.shape)}"
        )
    want = torch.float8_e4m3fn if nvfp4 else torch.uint8
    if scales.dtype != want or tuple(scales.shape) != (rows, ceil_div(k, bs)):
        kind = "float8_e4m3fn (NVFP4)" if nvfp4 else "uint8 E8M0"
        raise ValueError(
            f"decode_gemm: {name}_scales must be {kind} [{rows}, {ceil_div(k, bs)}],"
            f" got {scales.dtype} {tuple(scales.shape)}"
        )
    if mbs is not None and (
        mbs.dtype != torch.uint8 or tuple(mbs.shape) != (rows, ceil_div(k, macro))
    ):
        raise ValueError(
            f"decode_gemm: {name}_mbs must be uint8 [{rows}, {ceil_div(k, macro)}],"
            f" got {mbs.dtype} {tuple(mbs.shape)}"
        )


def _check_globals(
    nvfp4: bool,
    bs: int,
    has_mbs: bool,
    x_global: torch.Tensor | None,
    w_global: torch.Tensor | None,
    m: int,
    n: int,
) -> tuple[torch.Tensor, torch.Tensor] | None:
    """NVFP4's global scales as contiguous fp32 [M] and [N] (None for E8M0), or a ValueError
    naming the argument at fault."""
    if not nvfp4:
        if x_global is not None or w_global is not None:
            raise ValueError(
                "decode_gemm: x_global / w_global are NVFP4's (weight scales float8_e4m3fn)"
            )
        return None
    if bs != 16 or has_mbs:
        raise ValueError(f"decode_gemm: NVFP4 is block 16 without MBS bytes, got block {bs}")
    out = []
    for name, g, rows in (("x_global", x_global, m), ("w_global", w_global, n)):
        if g is None or g.dtype != torch.float32 or g.numel() != rows:
            got = "None" if g is None else f"{g.dtype} {tuple(g.shape)}"
            raise ValueError(
                f"decode_gemm: NVFP4 needs {name}, fp32 with one value per row ({rows}), got {got}"
            )
        out.append(g.reshape(rows).contiguous())
    return out[0], out[1]


def _check_x_sigma(x_sigma: torch.Tensor, x_mbs: torch.Tensor | None,
                   x_hat: torch.Tensor | None, m: int, k: int, macro_block: int) -> None:  # fmt: skip
    """`decode_gemm`'s x_sigma: fp32 [M, ceil(K/macro_block)] beside x's MBS bytes and x_hat
    (`act_quant_hat` writes all three), else a ValueError naming it."""
    shape = (m, ceil_div(k, macro_block))
    if x_mbs is None or x_hat is None:
        raise ValueError(
            "decode_gemm: x_sigma comes with x's MBS bytes and x_hat (`act_quant_hat`)"
        )
    if x_sigma.dtype != torch.float32 or tuple(x_sigma.shape) != shape:
        raise ValueError(
            f"decode_gemm: x_sigma must be float32 {list(shape)} (fp32(1 / F) per row and macro "
            f"block, `act_quant_hat`), got {x_sigma.dtype} {list(x_sigma.shape)}"
        )


def _check_block_max(
    bm: torch.Tensor, bs: int, has_mbs: bool, x_hat: torch.Tensor | None, n: int, k: int
) -> None:
    """A ValueError naming what MX+ on the decode GEMM lacks: block 32, no MBS bytes, the
    activation's x_hat, block-max words int16 [N, ceil(K/32)] (`plus_words`)."""
    if bs != 32 or has_mbs:
        raise ValueError(f"decode_gemm: MX+ is block 32 without MBS bytes, got block {bs}")
    if x_hat is None:
        raise ValueError("decode_gemm: MX+ needs x_hat (`act_quant_mxplus_hat`)")
    if bm.dtype != torch.int16 or tuple(bm.shape) != (n, ceil_div(k, 32)):
        raise ValueError(
            f"decode_gemm: w_block_max must be the block-max words int16 [{n}, "
            f"{ceil_div(k, 32)}] (`plus_words.block_max_words`), got "
            f"{bm.dtype} {tuple(bm.shape)}"
        )


@overload
def _row_major(t: torch.Tensor) -> torch.Tensor: ...
@overload
def _row_major(t: None) -> None: ...
def _row_major(t: torch.Tensor | None) -> torch.Tensor | None:
    return t if t is None or t.stride(-1) == 1 else t.contiguous()


@overload
def _tile_addressable(t: torch.Tensor, rows: int) -> torch.Tensor: ...
@overload
def _tile_addressable(t: None, rows: int) -> None: ...
def _tile_addressable(t: torch.Tensor | None, rows: int) -> torch.Tensor | None:
    """t, or a compact copy, such that offsets inside a tile of `rows` rows fit in 32 bits
    (the kernel offsets only a tile's first row in 64 bits)."""
    if t is None or t.shape[0] == 0:
        return t
    last = (min(rows, t.shape[0]) - 1) * t.stride(0) + t.shape[1]
    if last < MAX_TILE_OFFSET:
        return t
    t = t.contiguous()
    if (min(rows, t.shape[0]) - 1) * t.stride(0) + t.shape[1] >= MAX_TILE_OFFSET:
        raise ValueError(f"decode_gemm: rows of {t.shape[1]} bytes are too long for one tile")
    return t


def decode_gemm(
    x_codes: torch.Tensor,
    x_scales: torch.Tensor,
    x_mbs: torch.Tensor | None,
    w_codes: torch.Tensor,
    w_scales: torch.Tensor,
    w_mbs: torch.Tensor | None,
    K: int,
    bias: torch.Tensor | None = None,
    out_dtype: torch.dtype = torch.bfloat16,
    block_size: int | None = None,
    x_hat: torch.Tensor | None = None,
    x_global: torch.Tensor | None = None,  # (a custom op's tensors cannot be keyword-only)
    w_global: torch.Tensor | None = None,
    w_block_max: torch.Tensor | None = None,
    x_sigma: torch.Tensor | None = None,
    *,
    macro_block: int,
    block_n: int | None = None,
    split_k: int | None = None,
    w_small_scales: bool = False,
    num_warps: int | None = None,
    num_stages: int | None = None,
    weight_a: bool | None = None,
) -> torch.Tensor:
    """y [M, N] = x_hat @ W_hat^T (+ bias) from quantized activations and weights.

    x_codes uint8 [M, ceil(K/2)], x_scales uint8 E8M0 [M, ceil(K/bs)], x_mbs uint8
    [M, ceil(K/macro_block)] or None; w_* the same with N rows (the `formats.quantize` layout
    of a weight [N, K]). Formats: block 16 or 32 E8M0 (`mxfp4-16-oas`, `mxfp4-ocp`, ...) with
    or without MBS on either operand (`mxfp4-mbs-d` weights with `mxfp4-mbs-s` activations);
    macro_block: a power of two >= 16 (`gemm_launch.supports_macro_block`). Any M: rows are
    tiled (more than MAX_GRID_M_TILES row tiles run as consecutive launches).
    block_size is inferred from the scale count when not given (None or 0). fp32
    accumulation; the output dtype is bf16, fp16 or fp32. block_n / split_k / num_warps /
    num_stages / weight_a (`weight_is_a`) override the launch heuristics (the GPU's:
    `gpu_check`'s decode sweep).
    w_small_scales: the caller has checked that every weight scale code is <= 128
    (`small_weight_scales`, once at load: trained weights' blocks are far below 2^1), so the
    kernel folds 2^126 into the weight's scale (one multiply per two weights
    instead of two; the same values). x_hat: the same activation's `act_quant_hat` output
    [M, hat_cols(K)] bf16, which the kernel reads instead of dequantizing x's codes where it
    takes the word path (`word_path`; ignored elsewhere). `ops.decode_gemm_op` is this
    function as a custom op. x_sigma: with x_hat and x_mbs, the same call's fp32 sigma =
    fp32(1 / F) of x's MBS bytes [M, ceil(K/macro_block)] (`act_quant_hat`), which the word
    path reads instead of computing each from its byte per program and step (the bytes
    serve elsewhere).

    NVFP4 (weight scales float8_e4m3fn): block 16, both operands' scales E4M3, no MBS bytes,
    and the fp32 global scales of the activation rows x_global [M] (or [M, 1]) and of the
    weight rows w_global [N]; x_hat then holds value * s without the global scale
    (`act_quant_hat` of nvfp4). The kernel multiplies its sums by g_x[m] * g_w[n] as
    `mx_gemm` does, and the bound of its docstring holds.

    MX+ (w_block_max given: the weight's block-max words int16 [N, ceil(K/32)],
    `plus_words.block_max_words`): block 32 E8M0 scales, no MBS bytes, and the activation only as x_hat
    (`act_quant_mxplus_hat`: the block maxima's values included), on the word path (`reads_x_hat`);
    the weight's block maxima are added per block (`_block_max_rows`). The bound holds with
    K/32 more additions. An x_hat of +-Inf against a weight block max of 4 * X would give NaN,
    not the spec's +-Inf; the MX+ quantizer never writes the activation scale code (254) that
    needs (docs/numerics.md, "Kernel numerics and error bounds").
    """
    nvfp4 = w_scales.dtype == torch.float8_e4m3fn
    bs = block_size or _infer_block_size(K, x_scales.shape[-1])
    check_block_size("decode_gemm", bs)
    has_mbs = x_mbs is not None or w_mbs is not None
    check_gemm_args("decode_gemm", out_dtype, macro_block, has_mbs)
    _check_operand("x", x_codes, x_scales, x_mbs, K, bs, macro_block, nvfp4)
    _check_operand("w", w_codes, w_scales, w_mbs, K, bs, macro_block, nvfp4)
    m, n = x_codes.shape[0], w_codes.shape[0]
    globals_ = _check_globals(nvfp4, bs, has_mbs, x_global, w_global, m, n)
    plus = w_block_max is not None
    if w_block_max is not None:
        _check_block_max(w_block_max, bs, has_mbs, x_hat, n, K)
        w_block_max = _row_major(w_block_max)
    if nvfp4:
        x_scales, w_scales = x_scales.view(torch.uint8), w_scales.view(torch.uint8)
    if x_hat is not None and (
        x_hat.dtype != HAT_DTYPE or tuple(x_hat.shape) != (m, hat_cols(K)) or x_hat.stride(-1) != 1
    ):
        raise ValueError(
            f"decode_gemm: x_hat must be {HAT_DTYPE} [{m}, {hat_cols(K)}] with unit column "
            f"stride (`act_quant_hat`), got {x_hat.dtype} {tuple(x_hat.shape)}"
        )
    if bias is not None and tuple(bias.shape) != (n,):
        raise ValueError(f"decode_gemm: bias must have shape ({n},), got {tuple(bias.shape)}")
    if x_sigma is not None:
        _check_x_sigma(x_sigma, x_mbs, x_hat, m, K, macro_block)
    options = _launch_overrides(num_warps, num_stages)
    check_available(w_codes)
    x_codes, x_scales, w_codes, w_scales = (
        _row_major(x_codes),
        _row_major(x_scales),
        _row_major(w_codes),
        _row_major(w_scales),
    )
    x_mbs, w_mbs, x_sigma = (None if t is None else _row_major(t) for t in (x_mbs, w_mbs, x_sigma))
    bias = None if bias is None else _row_major(bias)

    interp = interpreting()
    auto_n, block_k = step_tile(K, x_codes, w_codes, macro_block, has_mbs)
    words = word_path(K, x_codes, w_codes)
    sub = sub_blocks(macro_block, has_mbs, block_k) if words else 1
    if interp:  # (`step_tile`)
        block_m = max(16, min(128, triton.next_power_of_2(m * sub)))
    else:
        # MX+ keeps 16-row tiles: its block-max gather [rows, BLOCK_N, NB] spills wider ones
        hat = not plus and x_hat is not None and reads_x_hat(K, x_codes, w_codes, block_k)
        # (the device is asked only where a wide tile is possible)
        block_m = gpu_block_m(
            m * sub, hat, m * sub <= WIDE_BLOCK_MS[0] or sm90_or_later(w_codes.device)
        )
        # the slim tile where neither its width nor its warps were asked for
        kind = weight_kind(nvfp4, plus, w_small_scales)
        if (block_n is None and num_warps is None
                and slim_tile(block_m, hat or (plus and x_hat is not None), kind,
                              w_codes.device, plus and m == 1)):  # fmt: skip
            auto_n = SLIM_BLOCK_N
            options = {"num_warps": SLIM_NUM_WARPS, **options}
            weight_a = True if weight_a is None else weight_a
    rows_per_tile = block_m // sub  # activation rows per row tile (`sub_blocks`)
    asked_n, block_n = block_n, block_n or auto_n
    # programs of fewer warps (the slim tile's, or asked for): more per SM, as many warps
    warps = options.get("num_warps", GPU_NUM_WARPS)
    per_sm = (
        settings.gpu_programs_per_sm() * GPU_NUM_WARPS // warps if warps < GPU_NUM_WARPS else None
    )
    x_codes, x_scales = _tile_addressable(x_codes, block_m), _tile_addressable(x_scales, block_m)
    w_codes, w_scales = _tile_addressable(w_codes, block_n), _tile_addressable(w_scales, block_n)
    x_mbs = None if x_mbs is None else _tile_addressable(x_mbs, block_m)
    x_sigma = None if x_sigma is None else _tile_addressable(x_sigma, block_m)
    w_mbs = None if w_mbs is None else _tile_addressable(w_mbs, block_n)
    if w_block_max is not None:
        w_block_max = _tile_addressable(w_block_max, block_n)
    if triton.cdiv(m, rows_per_tile) > MAX_GRID_M_TILES:  # > 1M rows: consecutive launches
        w_sc = w_scales.view(torch.float8_e4m3fn) if nvfp4 else w_scales
        x_sc = x_scales.view(torch.float8_e4m3fn) if nvfp4 else x_scales
        w = (w_codes, w_sc, w_mbs, K, bias, out_dtype, bs)
        return by_row_chunks(
            (
                x_codes,
                x_sc,
                x_mbs,
                None if globals_ is None else globals_[0],
                x_hat if plus else None,
            ),  # fmt: skip
            MAX_GRID_M_TILES * rows_per_tile,
            lambda xr: decode_gemm(
                xr[0],
                xr[1],
                xr[2],
                *w,
                macro_block=macro_block,
                block_n=asked_n,  # each chunk picks its tile (and warps) as this call did
                split_k=split_k,
                w_small_scales=w_small_scales,
                num_warps=num_warps,
                num_stages=num_stages,
                weight_a=weight_a,
                x_hat=xr[4],  # chunks of rows: the codes path (MX+: x_hat's rows)
                x_global=xr[3],
                w_global=None if globals_ is None else globals_[1],
                w_block_max=w_block_max,
            ),  # fmt: skip
        )
    if m == 0 or n == 0:
        return torch.zeros((m, n), dtype=out_dtype, device=w_codes.device)
    n_tiles = triton.cdiv(n, block_n)
    out_tiles = n_tiles * triton.cdiv(m, rows_per_tile)
    sk = plan_split_k(m, n, K, block_k, out_tiles, split_k, bias, out_dtype, w_codes.device,
                      in_launch=True, per_sm=per_sm)  # fmt: skip

    use_hat = x_hat is not None and reads_x_hat(K, x_codes, w_codes, block_k)
    if plus and not use_hat:
        raise ValueError(
            f"decode_gemm: MX+ reads x_hat on the word path, which K = {K} with these rows "
            "does not take (`reads_x_hat`: whole words, 4-byte pitches); use mx_gemm"
        )
    grid = (n_tiles, sk.split, triton.cdiv(m, rows_per_tile))
    # x's sigmas stand in for its MBS bytes where the word path reads x_hat (`_word_step`)
    sigma = use_hat and words and x_sigma is not None
    launch_decode(
        grid, (x_codes, x_scales, x_sigma if sigma else x_mbs),
        (w_codes, w_scales, w_block_max if plus else w_mbs),
        sk, x_hat if use_hat else None, None, K=K, bs=bs, macro_block=macro_block, x_sigma=sigma,
        tile=(block_m, block_n, block_k), words=words,
        w_fold=words and (nvfp4 or w_small_scales),
        even=words and n % block_n == 0 and K % block_k == 0, globals_=globals_, plus=plus,
        options=options, weight_a=weight_a, sub=sub,
    )  # fmt: skip
    return split_k_result(sk, bias, out_dtype)


def _launch_overrides(num_warps: int | None, num_stages: int | None) -> dict[str, int]:
    """`decode_gemm`'s num_warps / num_stages overrides as Triton launch options; a value
    Triton cannot launch is a ValueError naming the option."""
    out = {}
    if num_warps is not None:
        if num_warps not in (1, 2, 4, 8, 16):
            raise ValueError(f"decode_gemm: num_warps must be 1, 2, 4, 8 or 16, got {num_warps}")
        out["num_warps"] = num_warps
    if num_stages is not None:
        if not 1 <= num_stages <= 8:
            raise ValueError(f"decode_gemm: num_stages must be 1..8, got {num_stages}")
        out["num_stages"] = num_stages
    return out


def step_tile(k: int, x_codes: torch.Tensor, w_codes: torch.Tensor, macro_block: int,
              has_mbs: bool) -> tuple[int, int]:  # fmt: skip
    """(BLOCK_N, BLOCK_K) of a launch: on the GPU `gpu_tile`'s (a K step inside one macro
    block, or whole macro blocks of 16 / 32 / 64: `sub_blocks`). The interpreter pays per
    program and per step, not per element, so it gets the largest tiles that keep numpy's
    temporaries small; macro blocks under GPU_BLOCK_K get the GPU's K step (its code rows'
    step, as the GPU's: UNALIGNED_BLOCK_K on the byte path), so the tests run the GPU's
    operand rows per macro block and per-macro-block dots."""
    if not interpreting():
        return gpu_tile(k, x_codes, w_codes)
    if has_mbs and macro_block < GPU_BLOCK_K:
        return 256, gpu_tile(k, x_codes, w_codes)[1]
    if has_mbs:
        return 256, min(macro_block, 512)
    return 256, 512


def launch_decode(
    grid: tuple[int, int, int],
    x: tuple,
    w: tuple,
    sk: SplitK,
    x_hat: torch.Tensor | None,
    moe: tuple | None,
    *,
    K: int,
    bs: int,
    macro_block: int,
    tile: tuple[int, int, int],
    words: bool,
    w_fold: bool,
    even: bool,
    globals_: tuple[torch.Tensor, torch.Tensor] | None = None,
    plus: bool = False,
    options: dict[str, int] | None = None,
    weight_a: bool | None = None,
    x_sigma: bool = False,
    sub: int = 1,
) -> None:
    """One launch of _decode_gemm_kernel (shared by `decode_gemm` and
    `moe_decode.moe_decode_gemm`) writing sk.out [m, n] (or partials [split, m, n], and sk.y
    summed from them where sk.counters is set: `gemm_blocks.reduce_split_tile`).

    x, w: (codes, scales, MBS bytes or None), uint8 row-major, tile-addressable; x_hat: the
    activation's `act_quant_hat` output where the launch reads it (None: x's codes). moe:
    (sorted pairs, expert per row tile, local experts, top_k) or None; with it, sk.out has a
    row per pair and x_hat a row per token (top_k > 1) or per pair. globals_: NVFP4's fp32
    global scales (of x's rows [m], of w's rows [n]), the scales then E4M3 bytes; None for
    E8M0. plus: MX+, w's third tensor its block-max indices (not MBS bytes). options: Triton
    launch options over `gpu_launch_options`' (the GPU only). weight_a: `weight_is_a`'s
    choice overridden (the word path only). x_sigma: x's third tensor holds its fp32 sigmas
    (`decode_gemm`'s x_sigma; the word path with x_hat only), not MBS bytes. sub: the word
    path's operand rows per activation row (`sub_blocks`; the grid's row tiles then hold
    BLOCK_M // sub activation rows). On sm_90 and
    later the launch is a programmatic dependent one (`launch.pdl_launch`): the programs start
    while the kernel before it (the activation quantizer) runs and wait for it before any
    read (`gemm_blocks.wait_prior_grid`), so the gap between the two launches is hidden."""
    block_m, block_n, block_k = tile
    x_codes, x_scales, x_mbs = x
    w_codes, w_scales, w_mbs = w
    m, n = sk.out.shape[-2:]
    dummy = w_scales  # stands in for absent optional pointers; never dereferenced
    pdl = pdl_launch(w_codes.device)
    pairs, tile_expert, n_experts, topk = moe if moe is not None else (dummy, dummy, 0, 1)
    launch(
        _decode_gemm_kernel,
        grid,
        x_codes,
        x_scales,
        x_mbs if x_mbs is not None else dummy,
        w_codes,
        w_scales,
        w_mbs if w_mbs is not None else dummy,
        sk.bias if sk.bias is not None else dummy,
        sk.out,
        sk.y if sk.y is not None else dummy,
        sk.counters if sk.counters is not None else dummy,
        x_hat if x_hat is not None else dummy,
        pairs,
        tile_expert,
        *(globals_ if globals_ is not None else (dummy, dummy)),
        m,
        n,
        K,
        ceil_div(K, 2),
        sk.k_per_split,
        n_experts,
        topk,
        x_codes.stride(0),
        x_scales.stride(0),
        x_mbs.stride(0) if x_mbs is not None else 0,
        w_codes.stride(0),
        w_scales.stride(0),
        w_mbs.stride(0) if w_mbs is not None else 0,
        sk.out.stride(0) if sk.split > 1 else 0,
        sk.out.stride(-2),
        sk.y.stride(0) if sk.y is not None else 0,
        x_hat.stride(0) if x_hat is not None else 0,
        BS=bs,
        MACRO=macro_block,
        X_MBS=x_mbs is not None,
        W_MBS=w_mbs is not None and not plus,
        X_SIGMA=x_sigma,
        HAS_BIAS=sk.bias is not None,
        BLOCK_M=block_m,
        BLOCK_N=block_n,
        BLOCK_K=block_k,
        DOT_DTYPE=dot_dtype(),
        WORDS=words,
        W_FOLD=w_fold,
        EVEN=even,
        X_HAT=x_hat is not None,
        MOE=moe is not None,
        NVFP4=globals_ is not None,
        PLUS=plus,
        W_A=words
        and (
            # operand rows per macro block built from x's codes keep x as A (with the weight
            # as A sm_80 spilled one configuration: 12 B at 128 registers)
            (
                weight_is_a(w_codes.device, globals_ is not None, block_m)
                and (sub == 1 or x_hat is not None)
            )
            if weight_a is None
            else weight_a
        ),  # fmt: skip
        REDUCE=sk.counters is not None,
        PDL=pdl,
        ONE_ROW=plus and m == 1,
        SUB=sub,
        **(
            {}
            if interpreting()
            else {
                **gpu_launch_options(block_m),
                **(options or {}),
                **({"launch_pdl": True} if pdl else {}),
            }
        ),
    )
