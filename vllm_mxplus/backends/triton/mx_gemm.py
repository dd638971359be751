"""Triton FP4 GEMM for every weight format, tiled for any M: y = x_hat @ W_hat^T (+ bias).

One kernel, `_mx_gemm_kernel`, serves
- linears at M > 16 (prefill: 32 x 64 output tiles, 64 of K per step), every format: E8M0
  at block 16 / 32 with MBS bytes on either operand at any power-of-two macro block
  16..2048, NVFP4 (E4M3 block scales, an fp32 global scale per activation row and per
  weight row) and MX+ (E8M0 block 32 plus each block's block-max index);
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

import torch

from vllm_mxplus.backends.triton.decode_gemm import e2m1_value, e8m0_value, mbs_factor
from vllm_mxplus.backends.triton.launch import (
    capturing,
    ceil_div,
    check_available,
    interpreting,
    launch,
    tl,
    triton,
)
from vllm_mxplus.formats import MACRO_BLOCK

# operand formats (constexpr FMT): what the scales and the extra bytes mean
FMT_E8M0, FMT_NVFP4, FMT_MXPLUS = 0, 1, 2
FMT_CODES = {"e8m0": FMT_E8M0, "nvfp4": FMT_NVFP4, "mxplus": FMT_MXPLUS}
MXPLUS_BLOCK = 32
BLOCK_SIZES = {"e8m0": (16, 32), "nvfp4": (16,), "mxplus": (MXPLUS_BLOCK,)}
NO_BLOCK_MAX = tl.constexpr(255)
E4M3_SUB_STEP = tl.constexpr(2.0**-9)  # the E4M3 subnormal step

PREFILL_BLOCK_M = 32
PREFILL_BLOCK_N = 64
PREFILL_NUM_WARPS = 4
# MBS keeps a second fp32 tile (each step's partial, before its sigma scaling) live beside
# the accumulator (registers per configuration: kernels/README.md)
PREFILL_NUM_WARPS_MBS = 4
# MBS macro blocks under 64 (16, 32): the prefill tile steps 32 of K (one macro block of 32,
# or two of 16, per step) instead of masking x four times per 64-element step
PREFILL_MBS_BLOCK_K = 32
DECODE_BLOCK_M = 16  # tl.dot's minimum; rows past M are masked
DECODE_BLOCK_N = 32
DECODE_NUM_WARPS = 4
GPU_BLOCK_K = 64  # one 32-byte sector per row and step
DECODE_MAX_M = 16
MAX_SPLIT_K = 16
MAX_GRID_M_TILES = 65535  # the grid's third axis is at most 2^16 - 1 on CUDA
NOMINAL_SMS = 132  # SM count used while capturing launches (H100/H200 class)


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
):
    """The K step [k0, k0 + BLOCK_K) of R packed rows as (even, odd) element values
    [R, BLOCK_K // 2] in DOT_DTYPE (exact). rows_*: int64 row offsets [R]; masked rows, bytes
    past KB and blocks past K read as 0."""
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
    lo_c = cb & 15
    hi_c = cb >> 4
    lo = e2m1_value(lo_c)
    hi = e2m1_value(hi_c)
    if FMT == 2:  # MX+: the block-max element (index within the block of 32 = BS)
        bm = tl.load(
            e_ptr + rows_e[:, None, None] + (k0 // BS + i_b[None, :, None]),
            mask=sm,
            other=255,
        ).to(tl.int32)
        el = 2 * i_h[None, None, :]
        lo = tl.where(bm == el, mxplus_max_value(lo_c), lo)
        hi = tl.where(bm == el + 1, mxplus_max_value(hi_c), hi)
    lo = tl.reshape((lo * sv).to(DOT_DTYPE), (R, BLOCK_K // 2))
    hi = tl.reshape((hi * sv).to(DOT_DTYPE), (R, BLOCK_K // 2))
    return lo, hi


@triton.jit
def mbs_sigmas(
    xe_ptr,
    we_ptr,
    rows_xe,
    rows_we,
    c,
    valid,
    mask_m,
    mask_n,
    X_MBS: tl.constexpr,
    W_MBS: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    """(sigma_x [BLOCK_M], sigma_w [BLOCK_N]) = fp32(1 / F) of macro block c of the tile's
    rows (1 for an operand without MBS; `valid` False: 1, nothing read): the paper's
    per-chunk sigma_A, sigma_B (section 4.3.2), each an IEEE reciprocal (`div_rn`)."""
    sx = tl.full((BLOCK_M,), 1.0, tl.float32)
    sw = tl.full((BLOCK_N,), 1.0, tl.float32)
    if X_MBS:
        fx = mbs_factor(tl.load(xe_ptr + rows_xe + c, mask=mask_m & valid, other=0))
        sx = tl.math.div_rn(sx, fx)
    if W_MBS:
        fw = mbs_factor(tl.load(we_ptr + rows_we + c, mask=mask_n & valid, other=0))
        sw = tl.math.div_rn(sw, fw)
    return sx, sw


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
    DOT_PRECISION: tl.constexpr,
):
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
    for k0 in range(k_start, k_end, BLOCK_K):
        x_lo, x_hi = dequant_rows(
            xc_ptr, xs_ptr, xe_ptr, rows_xc, rows_xs, rows_xe, mask_m, k0, K, KB,
            FMT, BS, BLOCK_M, BLOCK_K, DOT_DTYPE,
        )  # fmt: skip
        w_lo, w_hi = dequant_rows(
            wc_ptr, ws_ptr, we_ptr, rows_wc, rows_ws, rows_we, mask_n, k0, K, KB,
            FMT, BS, BLOCK_N, BLOCK_K, DOT_DTYPE,
        )  # fmt: skip
        w_lo = tl.trans(w_lo)
        w_hi = tl.trans(w_hi)
        if (X_MBS or W_MBS) and MACRO < BLOCK_K:
            # one dot per macro block, x's other columns zeroed, each partial scaled by its
            # own sigma_x * sigma_w (docs/numerics.md, "Kernel numerics and error bounds")
            HMB: tl.constexpr = MACRO // 2
            col_mb = tl.arange(0, BLOCK_K // 2)[None, :] // HMB
            for j in tl.static_range(BLOCK_K // MACRO):
                sel = col_mb == j
                pj = tl.dot(
                    tl.where(sel, x_lo, 0.0).to(DOT_DTYPE),
                    w_lo,
                    input_precision=DOT_PRECISION,
                    out_dtype=tl.float32,
                )
                pj = tl.dot(
                    tl.where(sel, x_hi, 0.0).to(DOT_DTYPE),
                    w_hi,
                    pj,
                    input_precision=DOT_PRECISION,
                    out_dtype=tl.float32,
                )
                sx, sw = mbs_sigmas(
                    xe_ptr, we_ptr, rows_xe, rows_we, k0 // MACRO + j, k0 + j * MACRO < K,
                    mask_m, mask_n, X_MBS, W_MBS, BLOCK_M, BLOCK_N,
                )  # fmt: skip
                acc += (pj * sx[:, None]) * sw[None, :]
        elif X_MBS or W_MBS:  # the step lies inside one macro block
            part = tl.dot(x_lo, w_lo, input_precision=DOT_PRECISION, out_dtype=tl.float32)
            part = tl.dot(x_hi, w_hi, part, input_precision=DOT_PRECISION, out_dtype=tl.float32)
            sx, sw = mbs_sigmas(
                xe_ptr, we_ptr, rows_xe, rows_we, k0 // MACRO, True,
                mask_m, mask_n, X_MBS, W_MBS, BLOCK_M, BLOCK_N,
            )  # fmt: skip
            acc += (part * sx[:, None]) * sw[None, :]
        else:
            acc = tl.dot(x_lo, w_lo, acc, input_precision=DOT_PRECISION, out_dtype=tl.float32)
            acc = tl.dot(x_hi, w_hi, acc, input_precision=DOT_PRECISION, out_dtype=tl.float32)

    if FMT == 1:  # NVFP4: the global scales, factored out of the sum
        gx = tl.load(xg_ptr + x_row, mask=mask_m, other=0.0)
        gw = tl.load(wg_ptr + w_row, mask=mask_n, other=0.0)
        acc = (acc * gx[:, None]) * gw[None, :]
    if HAS_BIAS:
        acc += tl.load(bias_ptr + n0 + i_n, mask=mask_n, other=0.0).to(tl.float32)[None, :]
    out_ptrs = out_ptr + pid_s.to(tl.int64) * stride_os + out_row[:, None] * stride_om
    tl.store(
        out_ptrs + (n0 + i_n)[None, :],
        acc.to(out_ptr.dtype.element_ty),
        mask=mask_m[:, None] & mask_n[None, :],
    )


# ----------------------------------------------------------------------------- launcher
def supports_macro_block(macro_block: int) -> bool:
    """A power of two >= 16: a K step lies inside one macro block or holds whole ones."""
    return macro_block >= 16 and macro_block & (macro_block - 1) == 0


def gemm_tiles(m: int, macro_block: int, has_mbs: bool, bs: int) -> tuple[int, int, int, int]:
    """(BLOCK_M, BLOCK_N, BLOCK_K, num_warps) for m rows: the decode tile up to
    DECODE_MAX_M rows, the prefill tile above. The interpreter pays per program and per
    step, so without a narrow macro block it takes longer K steps."""
    bm, bn, warps = (
        (DECODE_BLOCK_M, DECODE_BLOCK_N, DECODE_NUM_WARPS)
        if m <= DECODE_MAX_M
        else (
            PREFILL_BLOCK_M,
            PREFILL_BLOCK_N,
            PREFILL_NUM_WARPS_MBS if has_mbs else PREFILL_NUM_WARPS,
        )
    )
    bk = GPU_BLOCK_K
    if has_mbs and macro_block < GPU_BLOCK_K and m > DECODE_MAX_M:
        bk = PREFILL_MBS_BLOCK_K
    if interpreting():
        bk = min(macro_block, 256) if has_mbs and macro_block >= GPU_BLOCK_K else bk
        bk = 256 if not has_mbs else bk
    return bm, bn, max(bk, bs), warps


def split_k_for(out_tiles: int, k_tiles: int, device: torch.device) -> int:
    """Enough (output tile, K slice) programs to fill the GPU about twice (decode); 1 in the
    interpreter and wherever the output tiles alone fill it."""
    if capturing():
        sms = NOMINAL_SMS
    elif interpreting() or device.type != "cuda":
        return 1
    else:
        sms = torch.cuda.get_device_properties(device).multi_processor_count
    return max(1, min(MAX_SPLIT_K, k_tiles, ceil_div(2 * sms, out_tiles)))


def _check_operand(name: str, t: tuple, k: int, fmt: str, bs: int, macro: int) -> None:
    codes, scales, extra, g = t
    rows = codes.shape[0]
    want = {
        "codes": (codes, torch.uint8, ceil_div(k, 2)),
        "scales": (scales, torch.uint8, ceil_div(k, bs)),
    }
    if fmt == "mxplus":
        want["block_max_index"] = (extra, torch.uint8, ceil_div(k, MXPLUS_BLOCK))
    elif extra is not None:
        want["mbs"] = (extra, torch.uint8, ceil_div(k, macro))
    for field, (tt, dtype, cols) in want.items():
        if tt is None or tt.dtype != dtype or tuple(tt.shape) != (rows, cols):
            got = None if tt is None else f"{tt.dtype} {tuple(tt.shape)}"
            raise ValueError(f"mx_gemm: {name} {field} must be {dtype} [{rows}, {cols}], got {got}")
    if fmt == "nvfp4" and (g is None or g.dtype != torch.float32 or g.numel() not in (1, rows)):
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
    out: torch.Tensor,
    *,
    m: int,
    n: int,
    k: int,
    fmt: str,
    bs: int,
    macro_block: int,
    tiles: tuple[int, int, int, int],
    grid_m: int,
    split: int = 1,
    k_per_split: int | None = None,
    bias: torch.Tensor | None = None,
    moe: tuple | None = None,
) -> None:
    """One launch of _mx_gemm_kernel (shared by `mx_gemm` and `moe_gemm.moe_gemm`).

    x, w: (codes, scales, extra, global scales) as uint8 row-major views (extra: MBS bytes or
    MX+ block-max indices; global: fp32 per row, NVFP4 only). moe: (sorted pairs, expert per
    row tile, local experts, top_k) or None."""
    bm, bn, bk, warps = tiles
    interp = interpreting()
    dummy = w[1]  # stands in for absent pointers; never dereferenced
    pairs, tile_expert, n_experts, topk = moe if moe is not None else (dummy, dummy, 0, 1)
    xf, wf = FMT_CODES[fmt], FMT_CODES[fmt]
    assert xf == wf
    x_mbs = fmt == "e8m0" and x[2] is not None
    w_mbs = fmt == "e8m0" and w[2] is not None
    launch(
        _mx_gemm_kernel,
        (triton.cdiv(n, bn), split, grid_m),
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
        k_per_split if k_per_split is not None else k,
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
        # The interpreter's bf16 is wrong: it multiplies in fp32 ("ieee").
        DOT_DTYPE=tl.float32 if interp else tl.bfloat16,
        DOT_PRECISION="ieee" if interp else None,
        **({} if interp else {"num_warps": warps}),
    )


def operand_format(fmt_name: str) -> tuple[str, int]:
    """('e8m0' | 'nvfp4' | 'mxplus', block size) of a `formats` format name."""
    from vllm_mxplus.formats import get_format

    spec = get_format(fmt_name)
    if spec.has_global_scale:
        return "nvfp4", spec.block_size
    return ("mxplus" if fmt_name == "mxplus" else "e8m0"), spec.block_size


def mx_gemm(
    x: tuple,
    w: tuple,
    K: int,
    bias: torch.Tensor | None = None,
    out_dtype: torch.dtype = torch.bfloat16,
    *,
    fmt: str = "e8m0",
    block_size: int = 16,
    macro_block: int = MACRO_BLOCK,
    split_k: int | None = None,
) -> torch.Tensor:
    """y [M, N] = x_hat @ W_hat^T (+ bias) from packed operands, any M.

    x, w: (codes uint8 [rows, ceil(K/2)], scales [rows, ceil(K/bs)] (uint8 E8M0, or
    float8_e4m3fn / uint8 for nvfp4), extra (MBS bytes [rows, ceil(K/macro_block)] or None;
    mxplus: block-max indices [rows, ceil(K/32)]), global scales fp32 [rows] / [rows, 1]
    (nvfp4) or None). fmt: 'e8m0', 'nvfp4' or 'mxplus' (both operands). fp32 accumulation,
    output bf16, fp16 or fp32."""
    if out_dtype not in (torch.bfloat16, torch.float16, torch.float32):
        raise ValueError(f"mx_gemm: out_dtype must be bf16, fp16 or fp32, got {out_dtype}")
    if fmt not in FMT_CODES:
        raise ValueError(f"mx_gemm: fmt must be one of {tuple(FMT_CODES)}, got {fmt!r}")
    if block_size not in BLOCK_SIZES[fmt]:
        raise ValueError(f"mx_gemm: {fmt} takes block sizes {BLOCK_SIZES[fmt]}, not {block_size}")
    has_mbs = fmt == "e8m0" and (x[2] is not None or w[2] is not None)
    if has_mbs and not supports_macro_block(macro_block):
        raise ValueError(f"mx_gemm: macro_block must be a power of two >= 16, got {macro_block}")
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
    tiles = gemm_tiles(m, macro_block, has_mbs, block_size)
    bm, bn, bk, _ = tiles
    if triton.cdiv(m, bm) > MAX_GRID_M_TILES:  # more rows than one grid holds
        rows = MAX_GRID_M_TILES * bm
        parts = [
            mx_gemm(
                tuple(None if t is None else t[r : r + rows] for t in x),
                w,
                K,
                bias,
                out_dtype,
                fmt=fmt,
                block_size=block_size,
                macro_block=macro_block,
                split_k=split_k,
            )
            for r in range(0, m, rows)
        ]
        return torch.cat(parts)
    interp = interpreting()
    n_tiles, k_tiles = triton.cdiv(n, bn), triton.cdiv(K, bk)
    out_tiles = n_tiles * triton.cdiv(m, bm)
    split = 1 if m > DECODE_MAX_M else split_k or split_k_for(out_tiles, k_tiles, device)
    split = max(1, min(split, k_tiles))
    k_per_split = ceil_div(k_tiles, split) * bk
    split = ceil_div(K, k_per_split)  # no empty slices
    if interp and bias is not None:
        bias = bias.to(torch.float32)  # the interpreter's bf16 / fp16 conversions are inexact
    if split == 1:
        # the interpreter's fp32 -> bf16 cast does not round to nearest even: cast outside
        out = torch.empty((m, n), dtype=torch.float32 if interp else out_dtype, device=device)
    else:  # fp32 partials per K slice, summed below (deterministic)
        out = torch.empty((split, m, n), dtype=torch.float32, device=device)
    launch_mx_gemm(
        x,
        w,
        out,
        m=m,
        n=n,
        k=K,
        fmt=fmt,
        bs=block_size,
        macro_block=macro_block,
        tiles=tiles,
        grid_m=triton.cdiv(m, bm),
        split=split,
        k_per_split=k_per_split,
        bias=bias if split == 1 else None,
    )
    if split == 1:
        return out.to(out_dtype)
    y = out.sum(0)
    if bias is not None:
        y += bias.to(torch.float32)
    return y.to(out_dtype)
