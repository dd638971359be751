"""Triton FP4 GEMM for every weight format, tiled for any M: y = x_hat @ W_hat^T (+ bias).

One kernel, `_mx_gemm_kernel`, serves
- linears at M > 16 (prefill: 128 x 128 output tiles, 64 x 128 with MBS, 64 of K per step,
  where the code rows vectorize; 32 x 64 elsewhere: `gemm_tiles`), every format: E8M0 at
  block 16 / 32 with MBS bytes on either operand at any power-of-two macro block 16..2048,
  NVFP4 (E4M3 block scales, an fp32 global scale per activation row and per weight row) and
  MX+ (E8M0 block 32 plus each block's block-max index);
- linears at M <= 16 for NVFP4 and MX+ (the decode tile of `decode_gemm`, 16 x 32, with
  split-K), whose formats the E8M0 decode kernel does not read;
- MoE experts (`MOE`): rows are gathered through a list of (token, slot) pairs sorted into
  per-expert row tiles (`moe_gemm.moe_align`), and each row tile reads its own expert's
  packed weight rows.

Both operands arrive packed (codes, scales, extra bytes), as the fused activation quantizers
write them, so nothing is ever stored dequantized: each K step dequantizes the tile's codes
in registers into values that are exact in bf16, and tl.dot forms exact products accumulated
in fp32 (docs/numerics.md, "Kernel numerics and error bounds"):
- E8M0: value(code) * 2^e, two significant bits. MBS: each macro block's partial dot is
  scaled by sigma_x * sigma_w with sigma = fp32(1 / F) (an IEEE reciprocal, `div_rn`), the
  paper's per-chunk scaling (section 4.3.2) as the CUTLASS GEMMs apply it; macro blocks
  narrower than the K step (16 with the prefill tile's 32-element step; 16 / 32 with the
  decode tile's 64) get one dot each, on x with the other macro blocks' columns zeroed.
- MX+: the element at the block-max index decodes to +-(4 + j/2) (4, 4.5, ..., 7.5: four
  significant bits) times 2^e; every other element is plain E2M1.
- NVFP4: value(code) * s with s the E4M3 scale (at most 2 + 4 significant bits: exact); the
  fp32 global scales are factored out of the sum, y = (acc * g_x[m]) * g_w[n].
Error against the float64 product y64 of the spec's x_hat and W_hat, S = |x_hat| |W_hat|^T:
every product is exact, so the error is that of summing K terms in fp32 in some order
((K - 1) u S, u = 2^-24) plus a few relative roundings per term: MBS 4 (two sigma roundings,
two products) against the spec's 2 (x_hat = fp32(v X / F) per operand); NVFP4 2 (the two
products by g) against the spec's 2 (x_hat = fp32((v s) g)); bias and output 2. So
|y - y64| <= (K + 8) u S + the output dtype's rounding, <= 2^-16 S for K <= 248 (the tests'
shapes); for large K the bound grows as K u S (fp32 accumulation of any kernel). NVFP4 also
rounds terms below fp32's normal range (|g_x g_w p| < 2^-126) to zero or subnormals.

Offsets: the rows of a tile are addressed through int64 row offsets (row * stride), so no
row * stride product wraps when M*K/2 or N*K/2 bytes exceed 2^31 (MoE row ids are pair ids,
arbitrary); column offsets inside a row are 32-bit.
"""

from __future__ import annotations

from typing import Any

import torch

from vllm_mxplus.backends.triton.gemm_blocks import (
    e2m1_pair_values,
    e2m1_value,
    e4m3_value,
    e8m0_value,
    macro_block_dot,
    mbs_factors,
    mbs_sigma,
    pair_dot,
    store_out_tile,
    wait_prior_grid,
)
from vllm_mxplus.backends.triton.gemm_launch import (
    MAX_GRID_M_TILES,
    SplitK,
    by_row_chunks,
    check_gemm_args,
    codes_aligned,
    dot_dtype,
    finish_output,
    plan_split_k,
)
from vllm_mxplus.backends.triton.launch import (
    check_available,
    interpreting,
    launch,
    pdl_launch,
    tl,
    triton,
)
from vllm_mxplus.backends.triton.plus_words import DELTA_MASK, POS_MASK
from vllm_mxplus.backends.triton.row_list import list_rows
from vllm_mxplus.formats import get_format
from vllm_mxplus.formats.constants import ceil_div

# operand formats (constexpr FMT): what the scales and the extra bytes mean
FMT_E8M0, FMT_NVFP4, FMT_MXPLUS = 0, 1, 2
# operand kinds (the kernel's, not format names): plain E8M0 scales (+ MBS bytes), E4M3
# scales under fp32 global scales, E8M0 block 32 + block-max indices
FMT_CODES = {"e8m0": FMT_E8M0, "nvfp4": FMT_NVFP4, "mxplus": FMT_MXPLUS}
KIND_OF_CODE = {code: kind for kind, code in FMT_CODES.items()}
MXPLUS_BLOCK = 32
BLOCK_SIZES = {FMT_E8M0: (16, 32), FMT_NVFP4: (16,), FMT_MXPLUS: (MXPLUS_BLOCK,)}
NO_BLOCK_MAX = tl.constexpr(255)

# The prefill tiles (linears at M > 16; counts and spills per target: kernels/README.md,
# "The prefill tiles"). Without MBS 128 x 128 x 64 on 8 warps, which Triton issues as wgmma
# on sm_90 and tcgen05 MMA on sm_100 (mma.sync on sm_80).
PREFILL_BLOCK_M = 128
PREFILL_BLOCK_N = 128
PREFILL_NUM_WARPS = 8
# MBS keeps a second fp32 tile (each step's partial, before its sigma scaling) live beside
# the accumulator: 64 x 128 on 4 warps, for block size 16 (every MBS scheme's; at 32 it
# spills on sm_80)
PREFILL_MBS_BLOCK_M = 64
PREFILL_MBS_BLOCK_N = 128
PREFILL_MBS_BS = 16
PREFILL_NUM_WARPS_MBS = 4
# MBS macro blocks under 64 (16, 32), and rows gathered through a row list (MoE experts,
# `mx_gemm_rows`): the 32 x 64 tile, stepping 32 of K under a narrow macro block (one macro
# block of 32, or two of 16, per step) instead of masking x four times per 64-element step
GATHER_BLOCK_M = 32
GATHER_BLOCK_N = 64
GATHER_NUM_WARPS = 4
GATHER_NUM_WARPS_MBS = 8  # MBS on rows that do not vectorize (not gathered): 4 warps spill
PREFILL_MBS_BLOCK_K = 32
DECODE_BLOCK_M = 16  # tl.dot's minimum; rows past M are masked
DECODE_BLOCK_N = 32  # the decode tile where the wide one does not apply (K step GPU_BLOCK_K)
DECODE_NUM_WARPS = 4
# the wide decode tile (linears whose code rows vectorize, `gemm_launch.codes_aligned`): the
# dequantization's per-step costs spread over 16384 weights; unaligned rows spill it
WIDE_DECODE_BLOCK_N = 128
WIDE_DECODE_BLOCK_K = 128  # 64 bytes per weight row
GPU_BLOCK_K = 64  # one 32-byte sector per row and step
DECODE_MAX_M = 16


@triton.jit
def mxplus_max_value(c):
    """fp32 value of an MX+ block-max code sign | j: +-(4 + j/2) (docs/numerics.md, MX+)."""
    mag = 4.0 + 0.5 * (c & 7).to(tl.float32)
    return tl.where((c & 8) != 0, -mag, mag)


@triton.jit
def dequant_rows(
    c_ptr,
    s_ptr,
    e_ptr,
    rows_c,
    rows_s,
    rows_e,
    mask_r,
    k0,
    K,
    KB,
    FMT: tl.constexpr,
    BS: tl.constexpr,
    R: tl.constexpr,
    BLOCK_K: tl.constexpr,
    DOT_DTYPE: tl.constexpr,
    BY_NIBBLE: tl.constexpr,
):
    """The K step [k0, k0 + BLOCK_K) of R packed rows as (even, odd) element values
    [R, BLOCK_K // 2] in DOT_DTYPE (exact). rows_*: int64 row offsets [R]; masked rows, bytes
    past KB and blocks past K read as 0. BY_NIBBLE: extract each nibble, then decode it
    (`e2m1_value`; fewer live registers, which the gathered MoE tiles need), else decode
    both nibbles straight from the byte (`e2m1_pair_values`; fewer instructions)."""
    NB: tl.constexpr = BLOCK_K // BS
    HB: tl.constexpr = BS // 2
    i_b = tl.arange(0, NB)
    i_h = tl.arange(0, HB)
    kb0 = k0 // 2
    jx = i_b[None, :, None] * HB + i_h[None, None, :]
    cm = mask_r[:, None, None] & (jx < KB - kb0)
    cb = tl.load(c_ptr + rows_c[:, None, None] + (kb0 + jx), mask=cm, other=0).to(tl.int32)
    sm = mask_r[:, None, None] & (i_b[None, :, None] * BS < K - k0)
    s_off = rows_s[:, None, None] + (k0 // BS + i_b[None, :, None])
    if FMT == 1:  # NVFP4: E4M3 block scales
        sv = e4m3_value(tl.load(s_ptr + s_off, mask=sm, other=0).to(tl.int32))
    else:
        sv = e8m0_value(tl.load(s_ptr + s_off, mask=sm, other=127).to(tl.int32))
    if FMT == 2 or BY_NIBBLE:
        lo_c = cb & 15
        hi_c = cb >> 4
        lo = e2m1_value(lo_c)
        hi = e2m1_value(hi_c)
    else:
        lo, hi = e2m1_pair_values(cb)
    if FMT == 2:  # MX+: the block-max element (index within the block of 32 = BS)
        e_at = e_ptr + rows_e[:, None, None] + (k0 // BS + i_b[None, :, None])
        if e_ptr.dtype.element_ty == tl.int16:  # a weight's words (`plus_words`): 0 for none
            word = tl.load(e_at, mask=sm, other=0).to(tl.int32)
            bm = tl.where((word & DELTA_MASK) != 0, word & POS_MASK, NO_BLOCK_MAX)
        else:
            bm = tl.load(e_at, mask=sm, other=NO_BLOCK_MAX).to(tl.int32)
        el = 2 * i_h[None, None, :]
        lo = tl.where(bm == el, mxplus_max_value(lo_c), lo)
        hi = tl.where(bm == el + 1, mxplus_max_value(hi_c), hi)
    lo = tl.reshape((lo * sv).to(DOT_DTYPE), (R, BLOCK_K // 2))
    hi = tl.reshape((hi * sv).to(DOT_DTYPE), (R, BLOCK_K // 2))
    return lo, hi


@triton.jit
def _mx_gemm_kernel(
    xc_ptr,
    xs_ptr,
    xe_ptr,
    xg_ptr,
    wc_ptr,
    ws_ptr,
    we_ptr,
    wg_ptr,
    bias_ptr,
    out_ptr,
    pairs_ptr,
    tile_expert_ptr,
    M,
    N,
    K,
    KB,
    K_PER_SPLIT,
    N_EXPERTS,
    TOPK,
    stride_xcm,
    stride_xsm,
    stride_xem,
    stride_wcn,
    stride_wsn,
    stride_wen,
    stride_os,
    stride_om,
    FMT: tl.constexpr,
    BS: tl.constexpr,
    MACRO: tl.constexpr,
    X_MBS: tl.constexpr,
    W_MBS: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    MOE: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    DOT_DTYPE: tl.constexpr,
    PDL: tl.constexpr,
):
    if PDL:  # launched early (`launch.pdl_launch`): nothing is read before the prior kernel ends
        wait_prior_grid()
    pid_n = tl.program_id(0)
    pid_s = tl.program_id(1)  # split-K slice
    pid_m = tl.program_id(2)
    i_m = tl.arange(0, BLOCK_M)
    i_n = tl.arange(0, BLOCK_N)
    n0 = pid_n * BLOCK_N
    mask_n = (n0 + i_n) < N
    if MOE:
        # row tile pid_m holds pairs of one expert (moe_align); pairs == M pad the tile
        expert = tl.load(tile_expert_ptr + pid_m)
        if expert >= N_EXPERTS:
            return  # a tile past the last expert's rows
        pair = tl.load(pairs_ptr + pid_m * BLOCK_M + i_m)
        mask_m = pair < M
        pair = tl.where(mask_m, pair, 0)
        x_row = (pair // TOPK).to(tl.int64)  # w13: the pair's token; w2: the pair's own row
        out_row = pair.to(tl.int64)
        w_row = (expert * N + n0 + i_n).to(tl.int64)
    else:
        x_row = (pid_m * BLOCK_M + i_m).to(tl.int64)
        mask_m = x_row < M
        out_row = x_row
        w_row = (n0 + i_n).to(tl.int64)
    rows_xc = x_row * stride_xcm
    rows_xs = x_row * stride_xsm
    rows_xe = x_row * stride_xem
    rows_wc = w_row * stride_wcn
    rows_ws = w_row * stride_wsn
    rows_we = w_row * stride_wen

    acc = tl.zeros((BLOCK_M, BLOCK_N), tl.float32)
    k_start = pid_s * K_PER_SPLIT
    k_end = tl.minimum(k_start + K_PER_SPLIT, K)
    newton: tl.constexpr = tl.bfloat16 == DOT_DTYPE  # the GPU (`mbs_sigma`)
    for k0 in range(k_start, k_end, BLOCK_K):
        x_lo, x_hi = dequant_rows(
            xc_ptr, xs_ptr, xe_ptr, rows_xc, rows_xs, rows_xe, mask_m, k0, K, KB,
            FMT, BS, BLOCK_M, BLOCK_K, DOT_DTYPE, MOE,
        )  # fmt: skip
        w_lo, w_hi = dequant_rows(
            wc_ptr, ws_ptr, we_ptr, rows_wc, rows_ws, rows_we, mask_n, k0, K, KB,
            FMT, BS, BLOCK_N, BLOCK_K, DOT_DTYPE, MOE,
        )  # fmt: skip
        w_lo = tl.trans(w_lo)
        w_hi = tl.trans(w_hi)
        if (X_MBS or W_MBS) and MACRO < BLOCK_K:
            # one dot per macro block (`macro_block_dot`), each partial scaled by its own
            # sigma_x * sigma_w (docs/numerics.md, "Kernel numerics and error bounds")
            for j in tl.static_range(BLOCK_K // MACRO):
                pj = macro_block_dot(x_lo, x_hi, w_lo, w_hi, j, MACRO, BLOCK_K, DOT_DTYPE)
                c = k0 // MACRO + j
                fx, fw = mbs_factors(
                    xe_ptr + rows_xe + c, we_ptr + rows_we + c, k0 + j * MACRO < K,
                    mask_m, mask_n, X_MBS, W_MBS,
                )  # fmt: skip
                sx, sw = mbs_sigma(fx, X_MBS, newton), mbs_sigma(fw, W_MBS, newton)
                acc += (pj * sx[:, None]) * sw[None, :]
        elif X_MBS or W_MBS:  # the step lies inside one macro block
            zero = tl.zeros((BLOCK_M, BLOCK_N), tl.float32)
            part = pair_dot(x_lo, x_hi, w_lo, w_hi, zero, DOT_DTYPE)
            c = k0 // MACRO
            fx, fw = mbs_factors(
                xe_ptr + rows_xe + c, we_ptr + rows_we + c, True, mask_m, mask_n, X_MBS, W_MBS
            )
            sx, sw = mbs_sigma(fx, X_MBS, newton), mbs_sigma(fw, W_MBS, newton)
            acc += (part * sx[:, None]) * sw[None, :]
        else:
            acc = pair_dot(x_lo, x_hi, w_lo, w_hi, acc, DOT_DTYPE)

    if FMT == 1:  # NVFP4: the global scales, factored out of the sum
        gx = tl.load(xg_ptr + x_row, mask=mask_m, other=0.0)
        gw = tl.load(wg_ptr + w_row, mask=mask_n, other=0.0)
        acc = (acc * gx[:, None]) * gw[None, :]
    store_out_tile(
        out_ptr, acc, bias_ptr, out_row, n0, mask_m, mask_n, pid_s, stride_os, stride_om,
        HAS_BIAS, BLOCK_N,
    )  # fmt: skip


# ----------------------------------------------------------------------------- launcher
def narrow_macro_block(has_mbs: bool, macro_block: int) -> bool:
    """Whether MBS operands have macro blocks narrower than the K step (16, 32): the tiles
    then step 32 of K on the 32 x 64 tile (`gemm_tiles`), never a large one."""
    return has_mbs and macro_block < GPU_BLOCK_K


def gemm_tiles(
    m: int, macro_block: int, has_mbs: bool, bs: int, wide: bool = False, gather: bool = False
) -> tuple[int, int, int, int]:
    """(BLOCK_M, BLOCK_N, BLOCK_K, num_warps) for m rows. Up to DECODE_MAX_M rows the decode
    tile: the wide one where `wide` (code rows that vectorize, `gemm_launch.codes_aligned`)
    and no macro block is narrower than its K step. Above, a prefill tile: the gathered-rows
    tile for `gather` (MoE experts, `mx_gemm_rows`), under a macro block narrower than the K
    step, for rows that do not vectorize and for MBS at block 32 (the large tiles spill
    there: kernels/README.md, "The prefill tiles"); else the MBS tile or the plain one. The
    interpreter pays per program and per step, so without a narrow macro block it takes
    longer K steps."""
    narrow = narrow_macro_block(has_mbs, macro_block)
    if m <= DECODE_MAX_M:
        bm, bn, warps = DECODE_BLOCK_M, DECODE_BLOCK_N, DECODE_NUM_WARPS
    elif gather or narrow:
        bm, bn, warps = GATHER_BLOCK_M, GATHER_BLOCK_N, GATHER_NUM_WARPS
    elif not wide or (has_mbs and bs != PREFILL_MBS_BS):
        bm, bn = GATHER_BLOCK_M, GATHER_BLOCK_N
        warps = GATHER_NUM_WARPS_MBS if has_mbs else GATHER_NUM_WARPS
    elif has_mbs:
        bm, bn, warps = PREFILL_MBS_BLOCK_M, PREFILL_MBS_BLOCK_N, PREFILL_NUM_WARPS_MBS
    else:
        bm, bn, warps = PREFILL_BLOCK_M, PREFILL_BLOCK_N, PREFILL_NUM_WARPS
    bk = GPU_BLOCK_K
    if wide and m <= DECODE_MAX_M and not (has_mbs and macro_block < WIDE_DECODE_BLOCK_K):
        bn, bk = WIDE_DECODE_BLOCK_N, WIDE_DECODE_BLOCK_K
    if narrow and m > DECODE_MAX_M:
        bk = PREFILL_MBS_BLOCK_K
    if interpreting():
        bk = min(macro_block, 256) if has_mbs and macro_block >= GPU_BLOCK_K else bk
        bk = 256 if not has_mbs else bk
    return bm, bn, max(bk, bs), warps


def _check_operand(name: str, t: tuple, k: int, fmt: str, bs: int, macro: int) -> None:
    codes, scales, extra, g = t
    rows = codes.shape[0]
    want = {
        "codes": (codes, torch.uint8, ceil_div(k, 2)),
        "scales": (scales, torch.uint8, ceil_div(k, bs)),
    }
    if FMT_CODES[fmt] == FMT_MXPLUS:  # indices, or a weight's words (`plus_words`)
        words = extra is not None and extra.dtype == torch.int16
        want["block_max_index"] = (extra, torch.int16 if words else torch.uint8,
                                   ceil_div(k, MXPLUS_BLOCK))  # fmt: skip
    elif extra is not None:
        want["mbs"] = (extra, torch.uint8, ceil_div(k, macro))
    for field, (tt, dtype, cols) in want.items():
        if tt is None or tt.dtype != dtype or tuple(tt.shape) != (rows, cols):
            got = None if tt is None else f"{tt.dtype} {tuple(tt.shape)}"
            raise ValueError(f"mx_gemm: {name} {field} must be {dtype} [{rows}, {cols}], got {got}")
    if FMT_CODES[fmt] == FMT_NVFP4 and (
        g is None or g.dtype != torch.float32 or g.numel() not in (1, rows)
    ):
        raise ValueError(f"mx_gemm: {name} global scales must be fp32, one or {rows} values")


def _u8(t: torch.Tensor | None) -> torch.Tensor | None:
    """Row-major uint8 view (E4M3 scales are read as bytes)."""
    if t is None:
        return None
    t = t if t.stride(-1) == 1 else t.contiguous()
    return t.view(torch.uint8) if t.dtype == torch.float8_e4m3fn else t


def launch_mx_gemm(
    x: tuple,
    w: tuple,
    sk: SplitK,
    k: int,
    fmt: str,
    bs: int,
    macro_block: int,
    tiles: tuple[int, int, int, int],
    grid_m: int,
    moe: tuple | None = None,
    pdl: bool = False,
) -> None:
    """One launch of _mx_gemm_kernel (shared by `mx_gemm` and `moe_gemm.moe_gemm`) writing
    sk.out [m, n] (or partials [split, m, n]) for operands of kind fmt at block size bs.

    x, w: (codes, scales, extra, global scales) as uint8 row-major views (extra: MBS bytes or
    MX+ block-max indices; global: fp32 per row, NVFP4 only). moe: (sorted pairs, expert per
    row tile, local experts, top_k) or None. pdl: a programmatic dependent launch (its
    programs wait for the kernel before it; `launch.pdl_launch` says where it may be one)."""
    bm, bn, bk, warps = tiles
    out, bias = sk.out, sk.bias
    m, n = out.shape[-2:]
    interp = interpreting()
    dummy = w[1]  # stands in for absent pointers; never dereferenced
    pairs, tile_expert, n_experts, topk = moe if moe is not None else (dummy, dummy, 0, 1)
    xf, wf = FMT_CODES[fmt], FMT_CODES[fmt]
    assert xf == wf
    x_mbs = xf == FMT_E8M0 and x[2] is not None
    w_mbs = wf == FMT_E8M0 and w[2] is not None
    launch(
        _mx_gemm_kernel,
        (triton.cdiv(n, bn), sk.split, grid_m),
        x[0],
        x[1],
        x[2] if x[2] is not None else dummy,
        x[3] if x[3] is not None else dummy,
        w[0],
        w[1],
        w[2] if w[2] is not None else dummy,
        w[3] if w[3] is not None else dummy,
        bias if bias is not None else dummy,
        out,
        pairs,
        tile_expert,
        m,
        n,
        k,
        ceil_div(k, 2),
        sk.k_per_split,
        n_experts,
        topk,
        x[0].stride(0),
        x[1].stride(0),
        x[2].stride(0) if x[2] is not None else 0,
        w[0].stride(0),
        w[1].stride(0),
        w[2].stride(0) if w[2] is not None else 0,
        out.stride(0) if out.dim() == 3 else 0,
        out.stride(-2),
        FMT=xf,
        BS=bs,
        MACRO=macro_block,
        X_MBS=x_mbs,
        W_MBS=w_mbs,
        HAS_BIAS=bias is not None,
        MOE=moe is not None,
        BLOCK_M=bm,
        BLOCK_N=bn,
        BLOCK_K=bk,
        DOT_DTYPE=dot_dtype(),
        PDL=pdl,
        **({} if interp else {"num_warps": warps, **({"launch_pdl": True} if pdl else {})}),
    )


def operand_format(fmt_name: str) -> tuple[str, int]:
    """(operand kind, block size) of a `formats` format, from its flags: the kind (a key of
    FMT_CODES) is E4M3 scales under global scales, E8M0 scales plus block-max indices (MX+),
    or plain E8M0 scales (with MBS bytes when the format has MBS)."""
    spec = get_format(fmt_name)
    kind = FMT_E8M0
    if spec.has_global_scale:
        kind = FMT_NVFP4
    elif spec.block_max_mantissa:
        kind = FMT_MXPLUS
    return KIND_OF_CODE[kind], spec.block_size


def mx_gemm(
    x: tuple,
    w: tuple,
    K: int,
    bias: torch.Tensor | None = None,
    out_dtype: torch.dtype = torch.bfloat16,
    *,
    fmt: str = "e8m0",
    block_size: int = 16,
    macro_block: int,
    split_k: int | None = None,
) -> torch.Tensor:
    """y [M, N] = x_hat @ W_hat^T (+ bias) from packed operands, any M.

    x, w: (codes uint8 [rows, ceil(K/2)], scales [rows, ceil(K/bs)] (uint8 E8M0, or
    float8_e4m3fn / uint8 for nvfp4), extra (MBS bytes [rows, ceil(K/macro_block)] or None;
    mxplus: block-max indices [rows, ceil(K/32)]), global scales fp32 [rows] / [rows, 1]
    (nvfp4) or None). fmt: 'e8m0', 'nvfp4' or 'mxplus' (both operands). fp32 accumulation,
    output bf16, fp16 or fp32."""
    if fmt not in FMT_CODES:
        raise ValueError(f"mx_gemm: fmt must be one of {tuple(FMT_CODES)}, got {fmt!r}")
    sizes = BLOCK_SIZES[FMT_CODES[fmt]]
    if block_size not in sizes:
        raise ValueError(f"mx_gemm: {fmt} takes block sizes {sizes}, not {block_size}")
    has_mbs = FMT_CODES[fmt] == FMT_E8M0 and (x[2] is not None or w[2] is not None)
    check_gemm_args("mx_gemm", out_dtype, macro_block, has_mbs)
    x = tuple(_u8(t) if i < 3 else t for i, t in enumerate(x))
    w = tuple(_u8(t) if i < 3 else t for i, t in enumerate(w))
    _check_operand("x", x, K, fmt, block_size, macro_block)
    _check_operand("w", w, K, fmt, block_size, macro_block)
    m, n = x[0].shape[0], w[0].shape[0]
    x, w = (
        (*t[:3], None if t[3] is None else t[3].reshape(-1).expand(rows).contiguous())
        for t, rows in ((x, m), (w, n))
    )
    if bias is not None and tuple(bias.shape) != (n,):
        raise ValueError(f"mx_gemm: bias must have shape ({n},), got {tuple(bias.shape)}")
    check_available(w[0])
    device = w[0].device
    if m == 0 or n == 0:
        return torch.zeros((m, n), dtype=out_dtype, device=device)
    tiles = gemm_tiles(m, macro_block, has_mbs, block_size, codes_aligned(K, x[0], w[0]))
    bm, bn, bk, _ = tiles
    if triton.cdiv(m, bm) > MAX_GRID_M_TILES:  # more rows than one grid holds
        kw: dict[str, Any] = {
            "fmt": fmt,
            "block_size": block_size,
            "macro_block": macro_block,
            "split_k": split_k,
        }
        return by_row_chunks(
            x, MAX_GRID_M_TILES * bm, lambda xr: mx_gemm(xr, w, K, bias, out_dtype, **kw)
        )
    grid_m = triton.cdiv(m, bm)
    split_k = 1 if m > DECODE_MAX_M else split_k  # prefill: the row tiles fill the GPU
    sk = plan_split_k(m, n, K, bk, triton.cdiv(n, bn) * grid_m, split_k, bias, out_dtype, device)
    launch_mx_gemm(x, w, sk, K, fmt, block_size, macro_block, tiles, grid_m)
    return finish_output(sk.out, bias, out_dtype)


def mx_gemm_rows(
    y: torch.Tensor,
    rows: torch.Tensor,
    x: tuple,
    w: tuple,
    K: int,
    bias: torch.Tensor | None = None,
    *,
    fmt: str,
    block_size: int,
    macro_block: int,
    when: bool = True,
) -> torch.Tensor:
    """y with the rows where `rows` (bool, int8 or uint8 [M], on the device) is `when`
    replaced by x_hat @ W_hat^T (+ bias) of those rows, in y's dtype; the other rows are
    untouched.

    Any number of rows, listed on the device (`row_list.list_rows`, one launch at capacity M:
    no host sync, fixed shapes, capturable): the listed rows are gathered in row tiles through
    the kernel's MOE row list (one expert: the whole weight), a row tile past the last listed
    row returns at once, so the work follows the number of listed rows. On sm_90 and later
    the list and the GEMM are programmatic dependent launches (`launch.pdl_launch`). On the GPU the
    kernel writes the rows into y in place (fp32 accumulation, bias, one rounding to y's
    dtype, as `mx_gemm`); under the interpreter, whose fp32 -> bf16 cast is not RNE, the
    rows are computed in fp32 and cast by torch. x, w: as `mx_gemm`'s (x [M, ...] rows)."""
    flag_dtypes = (torch.bool, torch.int8, torch.uint8)
    if y.dim() != 2 or rows.shape != (y.shape[0],) or rows.dtype not in flag_dtypes:
        raise ValueError(
            f"mx_gemm_rows: rows must be bool, int8 or uint8 [{y.shape[0]}] for y "
            f"{tuple(y.shape)}, got "
            f"{rows.dtype} {tuple(rows.shape)}"
        )
    if not y.is_contiguous():
        raise ValueError("mx_gemm_rows: y must be contiguous (its rows are written in place)")
    has_mbs = FMT_CODES[fmt] == FMT_E8M0 and (x[2] is not None or w[2] is not None)
    check_gemm_args("mx_gemm_rows", y.dtype, macro_block, has_mbs)
    x = tuple(_u8(t) if i < 3 else t for i, t in enumerate(x))
    w = tuple(_u8(t) if i < 3 else t for i, t in enumerate(w))
    _check_operand("x", x, K, fmt, block_size, macro_block)
    _check_operand("w", w, K, fmt, block_size, macro_block)
    m, n = y.shape
    if x[0].shape[0] != m:
        raise ValueError(f"mx_gemm_rows: x has {x[0].shape[0]} rows, y {m}")
    check_available(w[0])
    if m == 0 or n == 0:
        return y
    tiles = gemm_tiles(DECODE_MAX_M + 1, macro_block, has_mbs, block_size, gather=True)
    bm, _, bk, _ = tiles
    grid_m = triton.cdiv(m, bm)
    if grid_m > MAX_GRID_M_TILES:
        raise ValueError(f"mx_gemm_rows: {m} rows exceed one grid ({MAX_GRID_M_TILES * bm})")
    # the listed rows, padded with m; per row tile expert 0 (the whole weight) or 1 (padding
    # only: past the last expert, the program returns)
    listed, tile_expert = list_rows(rows, grid_m, bm, when)
    interp = interpreting()
    out = torch.empty((m, n), dtype=torch.float32, device=y.device) if interp else y
    b = bias.to(torch.float32) if interp and bias is not None else bias
    sk = SplitK(1, triton.cdiv(K, bk) * bk, out, b)
    moe = (listed, tile_expert, 1, 1)
    pdl = pdl_launch(y.device)
    launch_mx_gemm(x, w, sk, K, fmt, block_size, macro_block, tiles, grid_m, moe, pdl)
    if interp:
        return torch.where(((rows != 0) == when)[:, None], out.to(y.dtype), y)
    return y
