"""Triton decode GEMM: y[M, N] = x_hat @ W_hat^T for few rows (M ~ 1..16).

Both operands arrive quantized (packed E2M1 codes, E8M0 block scales, optional MBS bytes),
so decode and prefill compute the same x_hat. Each program streams a [BLOCK_N, BLOCK_K]
tile of packed weights, with its scales and MBS bytes, exactly once; dequantizes in
registers; and multiplies with tl.dot, accumulating in fp32.

Why the numbers are (nearly) those of the reference x_hat @ W_hat^T:
- value(code) * 2^e is exact in fp32 and in bf16 (two significant bits), so the tensor-core
  dot on bf16 operands forms exact products and accumulates them in fp32.
- MBS divides every element by F = 1 + m/256 (x_hat = value * X / F). F is constant over a
  128-wide macro block of each row of x and of W, so instead of dividing elements the kernel
  divides the partial product of each K tile (inside one macro block) by Fx[m] * Fw[n]
  (exact: a product of two 9-bit integers over 2^16) with an IEEE division (`div_rn`; the
  default `/` lowers to the approximate div.full.f32, up to 2 ulp), the paper's per-chunk
  sigma_A * sigma_B (section 4.3.2, Appendix E).
The only differences left are fp32 rounding order; the tests bound them against float64.
Row offsets (row * stride) are 64-bit: N*K/2 or M*K/2 bytes reach 2^31 on large layers.

The packed layout puts element 2i in the low nibble and 2i+1 in the high nibble of byte i,
for x and W alike, so the kernel never interleaves: it computes
dot(x_lo, W_lo^T) + dot(x_hi, W_hi^T) over the even and the odd elements.
"""

from __future__ import annotations

import torch

from vllm_mxplus.formats import MACRO_BLOCK
from vllm_mxplus.ops.triton_utils import (
    capturing,
    ceil_div,
    check_available,
    interpreting,
    launch,
    tl,
    triton,
)

SUPPORTED_BLOCK_SIZES = (16, 32)
MAX_SPLIT_K = 16
GPU_BLOCK_K = 128  # K elements per step on the GPU: one macro block of 128, or a part of one
# 8 warps: ptxas gives the MBS variant 255 registers with 4 warps (2 blocks = 8 warps per SM
# for a kernel that must keep loads in flight), 128-152 with 8 (`mxplus kernels --aot`).
GPU_NUM_WARPS = 8
NOMINAL_SMS = 132  # SM count used while capturing launches (H100/H200 class)


@triton.jit
def e2m1_value(c):
    """fp32 value of E2M1 codes c (int32, 0..15), from the bits: magnitudes 0, .5, 1, ..., 6.

    For magnitude codes >= 2, bits (c << 22) + (126 << 23) are exactly 2^(e-1) * (1 + m/2)
    with e = c >> 1, m = c & 1; codes 0 and 1 (0 and 0.5) are the subnormal-like pair.
    Code 8 is -0.0.
    """
    mag = c & 7
    v = ((mag << 22) + (126 << 23)).to(tl.float32, bitcast=True)
    v = tl.where(mag < 2, mag.to(tl.float32) * 0.5, v)
    return (v.to(tl.int32, bitcast=True) | ((c & 8) << 28)).to(tl.float32, bitcast=True)


@triton.jit
def e8m0_value(code):
    """fp32 2^(code - 127) from the bits; code 0 is the subnormal 2^-127, code 255 is NaN."""
    bits = tl.where(code == 0, 1 << 22, code << 23)
    bits = tl.where(code == 255, 0x7FC00000, bits)
    return bits.to(tl.float32, bitcast=True)


@triton.jit
def mbs_factor(m):
    """F = 1 + m/256 in fp32 (exact)."""
    return (m.to(tl.float32) + 256.0) * 0.00390625


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
    M,
    N,
    K,
    K_PER_SPLIT,
    stride_xcm,
    stride_xsm,
    stride_xmm,
    stride_wcn,
    stride_wsn,
    stride_wmn,
    stride_os,
    stride_om,
    BS: tl.constexpr,
    MACRO: tl.constexpr,
    X_MBS: tl.constexpr,
    W_MBS: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    DOT_DTYPE: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    pid_n = tl.program_id(0)
    pid_s = tl.program_id(1)  # split-K slice
    pid_m = tl.program_id(2)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_j = tl.arange(0, BLOCK_K // 2)  # byte index inside the K tile
    mask_m = offs_m < M
    mask_n = offs_n < N
    rows_m = offs_m.to(tl.int64)  # 64-bit row offsets (module docstring)
    rows_n = offs_n.to(tl.int64)

    acc = tl.zeros((BLOCK_M, BLOCK_N), tl.float32)
    k_start = pid_s * K_PER_SPLIT
    k_end = tl.minimum(k_start + K_PER_SPLIT, K)
    for k0 in range(k_start, k_end, BLOCK_K):
        kk = k0 + 2 * offs_j  # element index of each byte's low nibble
        mask_k = kk < K  # for odd K the last high nibble is code 0 (pack_fp4's padding)
        kb = k0 // 2 + offs_j
        sb = kk // BS  # block of both nibbles: BS is even

        # activations [BLOCK_M, BLOCK_K/2]: small, re-read from L2 by every program
        mk = mask_m[:, None] & mask_k[None, :]
        xb = tl.load(xc_ptr + rows_m[:, None] * stride_xcm + kb[None, :], mask=mk, other=0)
        xs = tl.load(xs_ptr + rows_m[:, None] * stride_xsm + sb[None, :], mask=mk, other=127)
        xsv = e8m0_value(xs.to(tl.int32))
        xb = xb.to(tl.int32)
        x_lo = (e2m1_value(xb & 15) * xsv).to(DOT_DTYPE)
        x_hi = (e2m1_value(xb >> 4) * xsv).to(DOT_DTYPE)

        # weights, transposed to [BLOCK_K/2, BLOCK_N]: the stream this kernel is bound by
        nk = mask_k[:, None] & mask_n[None, :]
        wb = tl.load(wc_ptr + rows_n[None, :] * stride_wcn + kb[:, None], mask=nk, other=0)
        ws = tl.load(ws_ptr + rows_n[None, :] * stride_wsn + sb[:, None], mask=nk, other=127)
        wsv = e8m0_value(ws.to(tl.int32))
        wb = wb.to(tl.int32)
        w_lo = (e2m1_value(wb & 15) * wsv).to(DOT_DTYPE)
        w_hi = (e2m1_value(wb >> 4) * wsv).to(DOT_DTYPE)

        part = tl.dot(x_lo, w_lo, input_precision=DOT_PRECISION, out_dtype=tl.float32)
        part = tl.dot(x_hi, w_hi, part, input_precision=DOT_PRECISION, out_dtype=tl.float32)
        if X_MBS or W_MBS:
            # BLOCK_K divides MACRO here: the tile lies inside one macro block of every row
            c = k0 // MACRO
            fx = tl.full((BLOCK_M,), 1.0, tl.float32)
            fw = tl.full((BLOCK_N,), 1.0, tl.float32)
            if X_MBS:
                fx = mbs_factor(tl.load(xmbs_ptr + rows_m * stride_xmm + c, mask=mask_m, other=0))
            if W_MBS:
                fw = mbs_factor(tl.load(wmbs_ptr + rows_n * stride_wmn + c, mask=mask_n, other=0))
            part = tl.math.div_rn(part, fx[:, None] * fw[None, :])  # exact F product
        acc += part

    out_ptrs = (
        out_ptr + pid_s.to(tl.int64) * stride_os + rows_m[:, None] * stride_om + offs_n[None, :]
    )
    if HAS_BIAS:
        acc += tl.load(bias_ptr + offs_n, mask=mask_n, other=0.0).to(tl.float32)[None, :]
    tl.store(out_ptrs, acc.to(out_ptr.dtype.element_ty), mask=mask_m[:, None] & mask_n[None, :])


def supports_macro_block(macro_block: int) -> bool:
    """Whether the kernel tiles this MBS macro block (a power of two, >= the K step, so a K
    tile never straddles two macro blocks)."""
    return macro_block >= GPU_BLOCK_K and macro_block & (macro_block - 1) == 0


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
) -> None:
    rows = codes.shape[0]
    if codes.dim() != 2 or codes.dtype != torch.uint8 or codes.shape[1] != ceil_div(k, 2):
        raise ValueError(
            f"decode_gemm: {name}_codes must be uint8 [rows, ceil(K/2)="
            f"{ceil_div(k, 2)}], got {codes.dtype} {tuple(codes.shape)}"
        )
    if scales.dtype != torch.uint8 or tuple(scales.shape) != (rows, ceil_div(k, bs)):
        raise ValueError(
            f"decode_gemm: {name}_scales must be uint8 E8M0 "
            f"[{rows}, {ceil_div(k, bs)}],"
            f" got {scales.dtype} {tuple(scales.shape)}"
        )
    if mbs is not None and (
        mbs.dtype != torch.uint8 or tuple(mbs.shape) != (rows, ceil_div(k, macro))
    ):
        raise ValueError(
            f"decode_gemm: {name}_mbs must be uint8 [{rows}, {ceil_div(k, macro)}],"
            f" got {mbs.dtype} {tuple(mbs.shape)}"
        )


def _row_major(t: torch.Tensor | None) -> torch.Tensor | None:
    return t if t is None or t.stride(-1) == 1 else t.contiguous()


def _default_split_k(n_tiles: int, k_tiles: int, device: torch.device) -> int:
    """Enough (N tile, K slice) programs to fill the GPU about twice; 1 in the interpreter."""
    if capturing():
        sms = NOMINAL_SMS
    elif interpreting() or device.type != "cuda":
        return 1
    else:
        sms = torch.cuda.get_device_properties(device).multi_processor_count
    return max(1, min(MAX_SPLIT_K, k_tiles, ceil_div(2 * sms, n_tiles)))


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
    *,
    block_size: int | None = None,
    macro_block: int = MACRO_BLOCK,
    block_n: int | None = None,
    split_k: int | None = None,
) -> torch.Tensor:
    """y [M, N] = x_hat @ W_hat^T (+ bias) from quantized activations and weights.

    x_codes uint8 [M, ceil(K/2)], x_scales uint8 E8M0 [M, ceil(K/bs)], x_mbs uint8
    [M, ceil(K/128)] or None; w_* the same with N rows (the `formats.quantize` layout of a
    weight [N, K]). Formats: block 16 or 32 E8M0 (`mxfp4-16-oas`, `mxfp4-ocp`, ...) with or
    without MBS on either operand (`mxfp4-mbs-d` weights with `mxfp4-mbs-s` activations).
    block_size is inferred from the scale count when not given. fp32 accumulation; the
    output dtype is bf16, fp16 or fp32. block_n / split_k override the launch heuristics.
    """
    if out_dtype not in (torch.bfloat16, torch.float16, torch.float32):
        raise ValueError(f"decode_gemm: out_dtype must be bf16, fp16 or fp32, got {out_dtype}")
    bs = block_size or _infer_block_size(K, x_scales.shape[-1])
    if bs not in SUPPORTED_BLOCK_SIZES:
        raise ValueError(
            f"decode_gemm: block_size must be one of {SUPPORTED_BLOCK_SIZES}, got {bs}"
        )
    has_mbs = x_mbs is not None or w_mbs is not None
    if has_mbs and not supports_macro_block(macro_block):
        raise ValueError(
            f"decode_gemm: macro_block must be a power of two >= {GPU_BLOCK_K}, got {macro_block}"
        )
    _check_operand("x", x_codes, x_scales, x_mbs, K, bs, macro_block)
    _check_operand("w", w_codes, w_scales, w_mbs, K, bs, macro_block)
    m, n = x_codes.shape[0], w_codes.shape[0]
    if bias is not None and tuple(bias.shape) != (n,):
        raise ValueError(f"decode_gemm: bias must have shape ({n},), got {tuple(bias.shape)}")
    check_available(w_codes)
    x_codes, x_scales, x_mbs, w_codes, w_scales, w_mbs, bias = map(
        _row_major, (x_codes, x_scales, x_mbs, w_codes, w_scales, w_mbs, bias)
    )

    interp = interpreting()
    # GPU: 16 rows (tl.dot's minimum; rows past M are masked), 64-wide N tiles, 128 of K per
    # step (inside one macro block). The interpreter pays per program and per step, not per
    # element, so it gets the largest tiles that keep numpy's temporaries small.
    if interp:
        block_m = max(16, min(128, triton.next_power_of_2(m)))
        block_n = block_n or 256
        block_k = min(macro_block, 512) if has_mbs else 512
    else:
        block_m = 16
        block_n = block_n or 64
        block_k = GPU_BLOCK_K
    launch_options = {} if interp else {"num_warps": GPU_NUM_WARPS}
    n_tiles, k_tiles = triton.cdiv(n, block_n), triton.cdiv(K, block_k)
    split = max(1, min(split_k or _default_split_k(n_tiles, k_tiles, w_codes.device), k_tiles))
    k_per_split = ceil_div(k_tiles, split) * block_k
    split = ceil_div(K, k_per_split)  # no empty slices

    if m == 0 or n == 0:
        return torch.zeros((m, n), dtype=out_dtype, device=w_codes.device)
    if interp and bias is not None:
        bias = bias.to(torch.float32)  # the interpreter's bf16/fp16 conversions are not exact
    if split == 1:
        # The interpreter's fp32 -> bf16 cast does not round to nearest even: cast outside.
        out = torch.empty(
            (m, n), dtype=torch.float32 if interp else out_dtype, device=w_codes.device
        )
        stride_os = 0
    else:  # fp32 partials per K slice, summed below (deterministic, unlike atomics)
        out = torch.empty((split, m, n), dtype=torch.float32, device=w_codes.device)
        stride_os = out.stride(0)

    grid = (n_tiles, split, triton.cdiv(m, block_m))
    dummy = w_scales  # stands in for absent optional pointers; never dereferenced
    launch(
        _decode_gemm_kernel,
        grid,
        x_codes,
        x_scales,
        x_mbs if x_mbs is not None else dummy,
        w_codes,
        w_scales,
        w_mbs if w_mbs is not None else dummy,
        bias if (bias is not None and split == 1) else dummy,
        out,
        m,
        n,
        K,
        k_per_split,
        x_codes.stride(0),
        x_scales.stride(0),
        x_mbs.stride(0) if x_mbs is not None else 0,
        w_codes.stride(0),
        w_scales.stride(0),
        w_mbs.stride(0) if w_mbs is not None else 0,
        stride_os,
        out.stride(-2),
        BS=bs,
        MACRO=macro_block,
        X_MBS=x_mbs is not None,
        W_MBS=w_mbs is not None,
        HAS_BIAS=bias is not None and split == 1,
        BLOCK_M=block_m,
        BLOCK_N=block_n,
        BLOCK_K=block_k,
        # The interpreter's bf16 is wrong: it multiplies in fp32 ("ieee").
        DOT_DTYPE=tl.float32 if interp else tl.bfloat16,
        DOT_PRECISION="ieee" if interp else None,  # None: bf16 operands, no fp32 mode
        **launch_options,
    )
    if split == 1:
        return out.to(out_dtype)
    y = out.sum(0)
    if bias is not None:
        y += bias.to(torch.float32)
    return y.to(out_dtype)
