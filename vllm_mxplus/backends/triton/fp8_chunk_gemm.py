"""The FP8-chunk GEMM in Triton: y = sum_c a_scale[c, m] b_scale[c, n] (A_c B_c^T)[m, n] + bias.

The same contract as the CUTLASS sm_90a kernel (`cutlass.ops.fp8_chunk_gemm`), for the
operand layout of `cutlass.fp8_chunks` (MXFP4 at block 16 re-encoded losslessly as FP8 E4M3
with one fp32 scale per (row, 128-K chunk)): A [M, Kp] and B [Np, Kp] float8_e4m3fn, a_scale
[Kp/128, M] and b_scale [Kp/128, Np] fp32, bias fp32 [Np] or None. It needs no extension
build: where the CUTLASS extension is not built, this kernel is the sm_90 prefill GEMM, on
the FP8 tensor cores Triton issues for `tl.dot` of FP8 tiles (wgmma on sm_90, tcgen05 on
sm_100; counted by `benchmarks/gpu_static_model.py`).

Per output tile, one K step per 128-K chunk: part = A_c B_c^T from a fresh accumulator (the
tensor cores' own accumulation inside the chunk), then acc += part * (a_scale * b_scale) in
fp32, so the promotion to fp32 happens once per chunk, as in the CUTLASS kernel. Error
(docs/numerics.md, "Kernel numerics and error bounds"): the products are exact (E2M1 values
scaled by powers of two fit E4M3); Hopper's FP8 MMA accumulates inside a chunk with about 14
significand bits (a relative error below 2^-13 per addition), sm_100's in fp32; then per
chunk two roundings for the scales and one for the addition, and the bias and output ones:
the CUTLASS kernel's bound, gamma S with u = 2^-13 over K + 8 additions on sm_90 and u = 2^-24
on sm_100 (docs/numerics.md, "Accumulator bits per backend").

Rows are addressed through int64 row offsets (M * Kp can pass 2^31 bytes at prefill sizes).
"""

from __future__ import annotations

import torch

from vllm_mxplus.backends.triton.gemm_blocks import launch_dependents
from vllm_mxplus.backends.triton.launch import (
    check_available,
    interpreting,
    launch,
    pdl_launch,
    target_capability,
    tl,
    triton,
)
from vllm_mxplus.formats.constants import MACRO_BLOCK

CHUNK = MACRO_BLOCK  # 128: one scale per (row, chunk), one K step
# the GPU tile, a 128-K chunk per step, 3 stages of FP8 operands in shared memory: 128 x 128
# outputs on 8 warps (two warpgroups: wgmma m64 each), but on sm_90 (`GPU_TILES`)
BLOCK_M = 128
BLOCK_N = 128
NUM_WARPS = 8
NUM_STAGES = 3
# by compute capability major, also `fp8_packed_gemm`'s: on sm_90 every step waits for its
# wgmma (the promotion reads each chunk's product; `kernel_tools/mma_wait.py`), so 128 x 64 on
# one warpgroup, whose 199 registers leave room for two programs per SM: one's wgmma runs
# while the other promotes (128 x 128 on 8 warps: 172 registers, one program, nothing to
# overlap; 64 x 128 re-encodes the packed weight's tile per 64 rows: 1.27x its instructions
# per MAC). sm_100's tcgen05 MMA stays in flight across steps: the default tile.
GPU_TILES = {9: (128, 64, 4)}
GROUP_M = 8  # row tiles per group of the launch order: neighbours share B tiles in L2
INTERPRET_BLOCK = 32  # the interpreter pays per program: small tiles waste less on padding
OUT_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


@triton.jit
def grouped_tile(M, N, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, GROUP_M: tl.constexpr):
    """(offs_m, offs_n) of program 0-axis id's output tile (`grouped_tile_ids`)."""
    pid_m, pid_n = grouped_tile_ids(M, N, BLOCK_M, BLOCK_N, GROUP_M)
    return pid_m * BLOCK_M + tl.arange(0, BLOCK_M), pid_n * BLOCK_N + tl.arange(0, BLOCK_N)


@triton.jit
def grouped_tile_ids(M, N, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, GROUP_M: tl.constexpr):
    """(row tile, column tile) of program 0-axis id, in the grouped launch order: GROUP_M row
    tiles per group sweep the columns together, so neighbours share B tiles in L2."""
    pid = tl.program_id(0)
    tiles_m = tl.cdiv(M, BLOCK_M)
    tiles_n = tl.cdiv(N, BLOCK_N)
    per_group = GROUP_M * tiles_n
    first_m = (pid // per_group) * GROUP_M
    group_m = tl.minimum(tiles_m - first_m, GROUP_M)
    pid_m = first_m + (pid % per_group) % group_m
    pid_n = (pid % per_group) // group_m
    return pid_m, pid_n


@triton.jit
def _fp8_chunk_gemm_kernel(
    a_ptr, as_ptr, b_ptr, bs_ptr, bias_ptr, out_ptr,
    M, N, NC,
    stride_am, stride_bn, stride_asc, stride_bsc, stride_om,
    HAS_BIAS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr, NUM_STAGES: tl.constexpr,
    TRIGGER: tl.constexpr,
):  # fmt: skip
    if TRIGGER:  # the exact fallback's row list may start (it waits for this launch)
        launch_dependents()
    offs_m, offs_n = grouped_tile(M, N, BLOCK_M, BLOCK_N, GROUP_M)
    live_m = offs_m < M
    live_n = offs_n < N
    # the operand rows clamped into the operands: the loop's loads need no masks (rows past
    # M or N repeat the last one; their outputs are never stored). The columns' chunk scales
    # are read at offs_n under live_n instead: a clamped offset hides their contiguity, and
    # Triton 3.6 then copied each thread's scales one by one (sm_100: 858 instructions per
    # step, 552 bytes spilled; 330 and none so, Triton 3.7 204 -> 208)
    m_ld = tl.minimum(offs_m, M - 1)
    n_ld = tl.minimum(offs_n, N - 1)
    a_rows = a_ptr + m_ld.to(tl.int64)[:, None] * stride_am
    b_rows = b_ptr + n_ld.to(tl.int64)[:, None] * stride_bn
    offs_k = tl.arange(0, BLOCK_K)  # one chunk

    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for c in tl.range(0, NC, num_stages=NUM_STAGES):
        k = c * BLOCK_K + offs_k
        a = tl.load(a_rows + k[None, :])
        b = tl.load(b_rows + k[None, :])
        part = tl.dot(a, tl.trans(b), out_dtype=tl.float32)
        sa = tl.load(as_ptr + c * stride_asc + m_ld)
        sb = tl.load(bs_ptr + c * stride_bsc + offs_n, mask=live_n, other=0.0)
        acc += part * (sa[:, None] * sb[None, :])

    if HAS_BIAS:
        acc += tl.load(bias_ptr + offs_n, mask=live_n, other=0.0)[None, :]
    out_rows = out_ptr + offs_m.to(tl.int64)[:, None] * stride_om
    tl.store(
        out_rows + offs_n[None, :],
        acc.to(out_ptr.dtype.element_ty),
        mask=live_m[:, None] & live_n[None, :],
    )


def _check(a_fp8, a_scale, b_fp8, b_scale, bias, out_dtype) -> int:
    """The chunk count NC, after checking the operands' dtypes and shapes (ValueError naming
    the argument at fault)."""
    for name, t in (("a_fp8", a_fp8), ("b_fp8", b_fp8)):
        if t.dtype != torch.float8_e4m3fn or t.dim() != 2:
            raise ValueError(f"fp8_chunk_gemm: {name} must be 2-D float8_e4m3fn, got "
                             f"{t.dtype} {tuple(t.shape)}")  # fmt: skip
    kp = a_fp8.shape[1]
    if b_fp8.shape[1] != kp or kp % CHUNK:
        raise ValueError(f"fp8_chunk_gemm: K of a_fp8 ({kp}) and b_fp8 ({b_fp8.shape[1]}) must "
                         f"agree and be whole {CHUNK}-element chunks")  # fmt: skip
    nc = kp // CHUNK
    for name, t, rows in (("a_scale", a_scale, a_fp8.shape[0]), ("b_scale", b_scale,
                                                                  b_fp8.shape[0])):  # fmt: skip
        if t.dtype != torch.float32 or tuple(t.shape) != (nc, rows):
            raise ValueError(f"fp8_chunk_gemm: {name} must be fp32 [{nc}, {rows}], got "
                             f"{t.dtype} {tuple(t.shape)}")  # fmt: skip
    if bias is not None and (bias.dtype != torch.float32 or bias.shape[0] < b_fp8.shape[0]):
        raise ValueError(f"fp8_chunk_gemm: bias must be fp32 with >= {b_fp8.shape[0]} entries")
    if out_dtype not in OUT_DTYPES:
        raise ValueError(f"fp8_chunk_gemm: out_dtype must be bf16, fp16 or fp32, got {out_dtype}")
    return nc


def gpu_tile(device: torch.device) -> tuple[int, int, int]:
    """(BLOCK_M, BLOCK_N, warps) of a GPU launch on `device` (`GPU_TILES`; sm_90's under
    the interpreter or a capture without a capability, as the other launchers)."""
    cap = target_capability(device)
    major = 9 if cap is None else cap // 10
    return GPU_TILES.get(major, (BLOCK_M, BLOCK_N, NUM_WARPS))


def fp8_chunk_gemm(
    a_fp8: torch.Tensor,
    a_scale: torch.Tensor,
    b_fp8: torch.Tensor,
    b_scale: torch.Tensor,
    bias: torch.Tensor | None,
    out_dtype: torch.dtype,
) -> torch.Tensor:
    """out_dtype [M, Np] = sum_c a_scale[c,:,None] b_scale[c,None,:] (A_c B_c^T) + bias."""
    nc = _check(a_fp8, a_scale, b_fp8, b_scale, bias, out_dtype)
    check_available(a_fp8)
    m, n = a_fp8.shape[0], b_fp8.shape[0]
    out = torch.empty((m, n), dtype=out_dtype, device=a_fp8.device)
    if m == 0 or n == 0:
        return out
    a_scale, b_scale = a_scale.contiguous(), b_scale.contiguous()
    a_fp8, b_fp8 = a_fp8.contiguous(), b_fp8.contiguous()
    if interpreting():
        bm = bn = INTERPRET_BLOCK
        warps, stages = 4, 1
    else:
        bm, bn, warps = gpu_tile(a_fp8.device)
        stages = NUM_STAGES
    launch(
        _fp8_chunk_gemm_kernel,
        (triton.cdiv(m, bm) * triton.cdiv(n, bn),),
        a_fp8,
        a_scale,
        b_fp8,
        b_scale,
        bias if bias is not None else a_scale,  # not read without a bias
        out,
        m,
        n,
        nc,
        a_fp8.stride(0),
        b_fp8.stride(0),
        a_scale.stride(0),
        b_scale.stride(0),
        out.stride(0),
        HAS_BIAS=bias is not None,
        BLOCK_M=bm,
        BLOCK_N=bn,
        BLOCK_K=CHUNK,
        GROUP_M=GROUP_M,
        NUM_STAGES=stages,
        TRIGGER=pdl_launch(out.device),
        num_warps=warps,
    )
    return out
