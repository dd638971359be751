"""The FP8-chunk GEMM on the packed weight: each weight chunk re-encoded to FP8 inside the K loop.

    y = sum_c a_scale[c, m] w_scale[c, n] (A_c W_c^T)[m, n] + bias

A is the activations' FP8-chunk layout (`cutlass.act_fp8`: E4M3 [M, Kp], fp32 a_scale
[Kp/128, M]), as `fp8_chunk_gemm` takes it; the weight is its packed form (E2M1 codes
[N, K/2], E8M0 scales [N, K/16], MBS bytes [N, K/128] or None), the form every other GPU path
reads. Where `fp8_chunk_gemm` needs the weight's FP8 form, made per call by a separate kernel
(`cutlass.weight_fp8`: 0.57 bytes per weight read, 1.03 written and read back by the GEMM),
this kernel builds each 128-K chunk of it in registers right before the tensor cores take it:
no temporary, no extra launch, the weight read once per row tile at 0.57 bytes per weight.

The chunk's FP8 form (docs/numerics.md, "The FP8-chunk layout read from the packed weight"):
ref = (the largest E8M0 scale code of the chunk's eight 16-blocks) - 6; a block with code s
holds its E2M1 values times 2^d, d = s - ref <= 6, in E4M3, and the chunk's scale is
2^(ref - 127) * fp32(1/F). For d in [-5, 6] every E2M1 value times 2^d is a normal E4M3
number whose byte is a per-block table of the 3-bit magnitude code (`packed_chunk_fp8`): the
byte of 0.5 * 2^d is 8 (d + 6), the others follow as 4 c + 8 (d + 6) for code c >= 2, and
code 0 is 0; the sign is bit 7. Rows with a chunk that has a nonzero block at d < -5 (its
exponents span more than 11 binades), besides the chunks the FP8 form cannot hold at all,
are the kernel's fallback rows, listed at load (`fp8_chunks.packed_fallback_rows`) and
recomputed from the packed operands, as the pipeline's are.

The result: the same exact products as `fp8_chunk_gemm` on `weight_fp8_chunks`' operand
(that one's ref counts only nonzero blocks; a different ref scales the chunk's bytes and its
scale by inverse powers of two, both exact, so the outputs are the same numbers), and the same
error bound (docs/numerics.md, "Accumulator bits per backend").

On the GPU one inline-PTX sequence builds the FP8 bytes of a word of 8 codes
(`E2M1_FP8_WORD`): a PRMT looks four 3-bit magnitudes up in the block's table at once,
another gathers their sign bits, one LOP3 merges them: 9 instructions per 8 weights. Under the
interpreter the same tables are read element by element (`_table_bytes`).

Rows are addressed through int64 offsets (M * Kp and N * K / 2 can pass 2^31 bytes).
"""

from __future__ import annotations

import torch

from vllm_mxplus.backends.cutlass.fp8_chunks import CHUNK, TOP_SHIFT
from vllm_mxplus.backends.triton.fp8_chunk_gemm import (
    INTERPRET_BLOCK,
    OUT_DTYPES,
    gpu_tile,
    grouped_tile_ids,
)
from vllm_mxplus.backends.triton.gemm_blocks import launch_dependents, mbs_sigma, reduce_split_tile
from vllm_mxplus.backends.triton.gemm_launch import (
    SPLIT_PLANES,
    finish_output,
    split_counters,
    split_k_for,
    sums_in_launch,
)
from vllm_mxplus.backends.triton.launch import (
    check_available,
    interpreting,
    launch,
    pdl_launch,
    tl,
    triton,
)
from vllm_mxplus.backends.triton.quant_blocks import mbs_factor
from vllm_mxplus.formats.constants import ceil_div

TOP = tl.constexpr(TOP_SHIFT)  # the chunk's largest block sits at d = 6
# the tables of d = 0: bytes of 0, 0.5, 1, 1.5 (codes 0..3) and 2, 3, 4, 6 (codes 4..7), and
# what one step of d adds to each byte (8: one binade in E4M3's exponent field; 0 for code 0)
TABLE_LO = tl.constexpr(0x3C383000)
TABLE_HI = tl.constexpr(0x4C484440)
STEP_LO = tl.constexpr(0x08080800)
STEP_HI = tl.constexpr(0x08080808)
# $2: four packed code bytes (one word: element 8j + p in nibble p); $3..$6 and $7..$10: the
# block's tables lo and hi (one register per packed element, the same value: the four bytes
# are one block's); $0 / $1: the E4M3 bytes of nibbles 0..3 / 4..7. PRMT's selector is the
# low 16 bits of its third operand, one nibble per output byte, whose bits 0..2 pick a byte
# of {a, b} (bit 3 would switch to a sign-replicate mode: the magnitudes are masked first).
# The signs: nibble 2i's sign bit is bit 7 of byte i of (word << 4), nibble 2i + 1's bit 7
# of byte i of the word, so one PRMT per output word gathers them onto each byte's bit 7
# (selectors 0x5140 and 0x7362) and lop3 0xF8 (a | b & c) merges them with 0x80808080.
E2M1_FP8_WORD = tl.constexpr(
    "{ .reg .b32 s, h, u, m, g;"
    " and.b32 s, $2, 0x77777777;"
    " shr.u32 h, s, 16;"
    " shl.b32 u, $2, 4;"
    " prmt.b32 m, $3, $7, s;"
    " prmt.b32 g, u, $2, 0x5140;"
    " lop3.b32 $0, m, g, 0x80808080, 0xF8;"
    " prmt.b32 m, $3, $7, h;"
    " prmt.b32 g, u, $2, 0x7362;"
    " lop3.b32 $1, m, g, 0x80808080, 0xF8; }"
)
# K the pipeline serves with this kernel (`gemm.packed_serves`): whole chunks, and E8M0 scale
# rows of whole 16 bytes (K % 256 == 0), which vectorize; with narrower scale rows ptxas
# spilled 8-56 B at 255 registers on sm_100 (K = 128, 384, 640)
K_MULTIPLE = 256
# the GPU tile: `fp8_chunk_gemm.gpu_tile`'s, one 128-K chunk per step
NUM_STAGES = 3
GROUP_M = 8


@triton.jit
def _table_bytes(c, lo, hi):
    """E4M3 bytes (int32) of E2M1 codes c (int32 0..15) from their blocks' tables, one byte
    at a time (the interpreter's form of `E2M1_FP8_WORD`)."""
    mag = c & 7
    table = tl.where(mag < 4, lo, hi)
    return ((table >> ((mag & 3) * 8)) & 0xFF) | ((c & 8) << 4)


@triton.jit
def packed_chunk_fp8(cb, s, BLOCK_N: tl.constexpr, ASM: tl.constexpr):
    """One 128-K chunk of packed weight rows as E4M3: cb the code bytes (uint8 [BLOCK_N, 64],
    element 2i in the low nibble of byte i), s the blocks' E8M0 codes (int32 [BLOCK_N, 8]).
    Returns (float8e4nv [BLOCK_N, 128] in K order, ref int32 [BLOCK_N])."""
    ref = tl.max(s, axis=1) - TOP
    # the blocks' tables at d = s - ref in [`fp8_chunks.PACKED_MIN_D`, 6]: byte c of lo is
    # the E4M3 byte of E2M1 code c times 2^d (c = 0..3), byte c of hi that of code 4 + c (no
    # byte carries or borrows over that range of d); then over each block's 8 code bytes
    d = s - ref[:, None]
    lo = d * STEP_LO + TABLE_LO
    hi = d * STEP_HI + TABLE_HI
    lo = tl.reshape(tl.broadcast_to(lo[:, :, None], (BLOCK_N, 8, 8)), (BLOCK_N, 64))
    hi = tl.reshape(tl.broadcast_to(hi[:, :, None], (BLOCK_N, 8, 8)), (BLOCK_N, 64))
    if ASM:
        # pack=4: one register of 4 code bytes (one word: elements 8j..8j+7) per call;
        # out0 holds elements 8j..8j+3, out1 8j+4..8j+7
        out0, out1 = tl.inline_asm_elementwise(
            E2M1_FP8_WORD, "=r,=r," + "r," * 8 + "r", [cb, lo, hi], dtype=(tl.uint8, tl.uint8),
            is_pure=True, pack=4,
        )  # fmt: skip
        w = tl.join(tl.reshape(out0, (BLOCK_N, 16, 4)), tl.reshape(out1, (BLOCK_N, 16, 4)))
        w = tl.reshape(tl.permute(w, (0, 1, 3, 2)), (BLOCK_N, 128))
    else:
        c = cb.to(tl.int32)
        even = _table_bytes(c & 15, lo, hi)
        odd = _table_bytes(c >> 4, lo, hi)
        w = tl.reshape(tl.join(even, odd), (BLOCK_N, 128)).to(tl.uint8)
    return w.to(tl.float8e4nv, bitcast=True), ref


# NC / CPS are not specialized when 1 (one chunk, or one chunk per K slice): the binary that
# runs is the one `mxplus kernels --aot` compiles and checks
@triton.jit(do_not_specialize=["NC", "CPS"])
def _fp8_packed_gemm_kernel(
    a_ptr, as_ptr, wc_ptr, ws_ptr, wm_ptr, bias_ptr, out_ptr, y_ptr, cnt_ptr,
    M, N, K, NC, CPS,
    stride_am, stride_asc, stride_wc, stride_ws, stride_wm, stride_os, stride_om, stride_ym,
    HAS_MBS: tl.constexpr, HAS_BIAS: tl.constexpr, BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
    NUM_STAGES: tl.constexpr, ASM: tl.constexpr, REDUCE: tl.constexpr,
    TRIGGER: tl.constexpr,
):  # fmt: skip
    if TRIGGER:  # the exact fallback's row list may start (it waits for this launch)
        launch_dependents()
    pid_m, pid_n = grouped_tile_ids(M, N, BLOCK_M, BLOCK_N, GROUP_M)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    live_m = offs_m < M
    live_n = offs_n < N
    # the operand rows clamped into the operands: the loop's loads need no masks (rows past
    # M or N repeat the last one; their outputs are never stored)
    m_ld = tl.minimum(offs_m, M - 1)
    n_ld = tl.minimum(offs_n, N - 1).to(tl.int64)
    a_rows = a_ptr + m_ld.to(tl.int64)[:, None] * stride_am
    w_rows = n_ld[:, None]
    offs_k = tl.arange(0, BLOCK_K)  # one chunk
    offs_b = tl.arange(0, BLOCK_K // 2)  # its code bytes
    offs_s = tl.arange(0, BLOCK_K // 16)  # its 16-blocks

    # K slice pid_s: chunks [pid_s * CPS, min(NC, (pid_s + 1) * CPS)) (all of them unsplit)
    pid_s = tl.program_id(1)
    c0 = pid_s * CPS
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for c in tl.range(c0, tl.minimum(NC, c0 + CPS), num_stages=NUM_STAGES):
        a = tl.load(a_rows + (c * BLOCK_K + offs_k)[None, :])
        kb = c * (BLOCK_K // 2) + offs_b
        cb = tl.load(wc_ptr + w_rows * stride_wc + kb[None, :])
        sb = c * (BLOCK_K // 16) + offs_s
        s = tl.load(ws_ptr + w_rows * stride_ws + sb[None, :]).to(tl.int32)
        w, ref = packed_chunk_fp8(cb, s, BLOCK_N, ASM)
        part = tl.dot(a, tl.trans(w), out_dtype=tl.float32)
        sa = tl.load(as_ptr + c * stride_asc + m_ld)
        if HAS_MBS:
            f = mbs_factor(tl.load(wm_ptr + n_ld * stride_wm + c))
        else:
            f = tl.full((BLOCK_N,), 1.0, tl.float32)
        # 2^(ref - 127) from the bits (normal on every row the kernel serves: ref >= 2)
        p2 = ((tl.minimum(tl.maximum(ref, 1), 254)) << 23).to(tl.float32, bitcast=True)
        sw = p2 * mbs_sigma(f, HAS_MBS, ASM)
        acc += part * (sa[:, None] * sw[None, :])

    if REDUCE:  # split K, summed by the tile's last slice (`gemm_blocks.reduce_split_tile`)
        reduce_split_tile(
            out_ptr, acc, bias_ptr, y_ptr, cnt_ptr, pid_m * BLOCK_M, pid_n * BLOCK_N, M, N,
            pid_s, stride_os, stride_om, stride_ym, HAS_BIAS, BLOCK_M, BLOCK_N, SPLIT_PLANES,
        )  # fmt: skip
    else:
        if HAS_BIAS:
            acc += tl.load(bias_ptr + offs_n, mask=live_n, other=0.0)[None, :]
        out_rows = (
            out_ptr + pid_s.to(tl.int64) * stride_os + offs_m.to(tl.int64)[:, None] * stride_om
        )
        tl.store(
            out_rows + offs_n[None, :],
            acc.to(out_ptr.dtype.element_ty),
            mask=live_m[:, None] & live_n[None, :],
        )


def fp8_packed_gemm(
    a_fp8: torch.Tensor,
    a_scale: torch.Tensor,
    w_codes: torch.Tensor,
    w_scales: torch.Tensor,
    w_mbs: torch.Tensor | None,
    k: int,
    bias: torch.Tensor | None,
    out_dtype: torch.dtype,
    split_k: int | None = None,
) -> torch.Tensor:
    """out_dtype [M, N] = sum_c a_scale[c,:,None] w_scale[c,None,:] (A_c W_c^T) + bias, the
    weight W [N, k] packed (module docstring); its fallback rows' columns are not exact here
    (the caller recomputes them). split_k: K slices (whole chunks each); None: enough for
    about VLLM_MXPLUS_GPU_PROGRAMS_PER_SM programs per SM (`gemm_launch.split_k_for`: a few
    rows of a 4096-wide layer give 32 output tiles), none under the interpreter. The slices'
    fp32 partials are summed in order (`gemm_launch.finish_output`)."""
    if a_fp8.dtype != torch.float8_e4m3fn or a_fp8.dim() != 2:
        raise ValueError(f"fp8_packed_gemm: a_fp8 must be 2-D float8_e4m3fn, got "
                         f"{a_fp8.dtype} {tuple(a_fp8.shape)}")  # fmt: skip
    nc = k // CHUNK
    if k % CHUNK or a_fp8.shape[1] != k:
        raise ValueError(f"fp8_packed_gemm: K = {k} must be whole {CHUNK}-element chunks and "
                         f"a_fp8's width, got {a_fp8.shape[1]} columns (other K: the "
                         "re-encoding pipeline, `weight_fp8` + `fp8_chunk_gemm`)")  # fmt: skip
    n = w_codes.shape[0]
    if w_codes.dtype != torch.uint8 or w_codes.shape[1] != ceil_div(k, 2):
        raise ValueError(f"fp8_packed_gemm: w_codes must be uint8 [N, {ceil_div(k, 2)}], got "
                         f"{w_codes.dtype} {tuple(w_codes.shape)}")  # fmt: skip
    if w_scales.dtype != torch.uint8 or tuple(w_scales.shape) != (n, ceil_div(k, 16)):
        raise ValueError(f"fp8_packed_gemm: w_scales must be uint8 [{n}, {ceil_div(k, 16)}] "
                         f"(E8M0), got {w_scales.dtype} {tuple(w_scales.shape)}")  # fmt: skip
    if w_mbs is not None and tuple(w_mbs.shape) != (n, nc):
        raise ValueError(f"fp8_packed_gemm: w_mbs must be [{n}, {nc}], got {tuple(w_mbs.shape)}")
    if a_scale.dtype != torch.float32 or tuple(a_scale.shape) != (nc, a_fp8.shape[0]):
        raise ValueError(f"fp8_packed_gemm: a_scale must be fp32 [{nc}, {a_fp8.shape[0]}], got "
                         f"{a_scale.dtype} {tuple(a_scale.shape)}")  # fmt: skip
    if bias is not None and (bias.dtype != torch.float32 or bias.shape[0] < n):
        raise ValueError(f"fp8_packed_gemm: bias must be fp32 with >= {n} entries")
    if out_dtype not in OUT_DTYPES:
        raise ValueError(f"fp8_packed_gemm: out_dtype must be bf16, fp16 or fp32, got {out_dtype}")
    check_available(a_fp8)
    m = a_fp8.shape[0]
    out = torch.empty((m, n), dtype=out_dtype, device=a_fp8.device)
    if m == 0 or n == 0:
        return out
    a_fp8, a_scale = a_fp8.contiguous(), a_scale.contiguous()
    if interpreting():
        bm = bn = INTERPRET_BLOCK
        warps, stages = 4, 1
    else:
        bm, bn, warps = gpu_tile(a_fp8.device)
        stages = NUM_STAGES
    tiles = triton.cdiv(m, bm) * triton.cdiv(n, bn)
    if split_k is None:
        split_k = 1 if interpreting() else split_k_for(tiles, nc, a_fp8.device)
    cps = triton.cdiv(nc, max(1, min(split_k, nc)))
    split = triton.cdiv(nc, cps)
    y = counters = None
    if split > 1:  # fp32 partials [split, m, n], the bias added by the sum
        out = torch.empty((split, m, n), dtype=torch.float32, device=a_fp8.device)
        # summed by the launch itself where it gets counters (`gemm_launch.split_counters`)
        counters = split_counters(a_fp8.device) if sums_in_launch(tiles, split) else None
        if counters is not None:  # fp32 under the interpreter, whose casts are not IEEE
            y_dtype = torch.float32 if interpreting() else out_dtype
            y = torch.empty((m, n), dtype=y_dtype, device=a_fp8.device)
    mbs_arg = w_mbs if w_mbs is not None else w_scales  # not read without MBS
    bias_k = bias if split == 1 or counters is not None else None
    launch(
        _fp8_packed_gemm_kernel,
        (tiles, split),
        a_fp8,
        a_scale,
        w_codes,
        w_scales,
        mbs_arg,
        bias_k if bias_k is not None else a_scale,  # not read without a bias
        out,
        y if y is not None else out,  # not written without the in-launch sum
        counters if counters is not None else a_scale,
        m,
        n,
        k,
        nc,
        cps,
        a_fp8.stride(0),
        a_scale.stride(0),
        w_codes.stride(0),
        w_scales.stride(0),
        mbs_arg.stride(0),
        m * n if split > 1 else 0,
        n,
        n,
        HAS_MBS=w_mbs is not None,
        HAS_BIAS=bias_k is not None,
        BLOCK_M=bm,
        BLOCK_N=bn,
        BLOCK_K=CHUNK,
        GROUP_M=GROUP_M,
        NUM_STAGES=stages,
        ASM=not interpreting(),
        REDUCE=counters is not None,
        TRIGGER=pdl_launch(out.device),
        num_warps=warps,
    )
    if y is not None:
        return y.to(out_dtype)
    return finish_output(out, None if bias is None else bias[:n], out_dtype) if split > 1 else out
