"""The block-scaled FP4 GEMM on Blackwell's tensor cores (sm_100: tcgen05, kind::mxf4nvf4),
Macro Block Scaling inside the one launch.

y[m, n] = sum_G fa[m, G] fb[n, G] (A_G B_G^T)[m, n] (+ bias), where A_G, B_G are a group's
E2M1 codes times their UE4M3 block scales (one per 16 elements): Triton's `tl.dot_scaled` with
float8_e4m3 scales, which sm_100 runs as one `UTCOMMA.4X` (tcgen05 block-scaled MMA) per 128-K
step, reading the packed codes (0.5 bytes per element) straight from shared memory. K is whole 128-K
chunks (the loop has no K masks). Operands:
codes uint8 [R, K/2] (formats' packing: element 2i in the low nibble, as the MMA wants),
scales uint8 [R, K/16] (UE4M3 bits), factors fp32 [groups, R] (chunk-major: a chunk's
factors are one vector). Each step's scales reach tensor memory by an asynchronous copy
(`scale_rows` / `scale_tile`), so that the MMA stays in flight across steps.

- PER_CHUNK (MBS): one group per 128-K chunk. Each step's product starts from a fresh
  accumulator in tensor memory, is read into registers and added as acc += part * (fa * fb)
  while the next chunk's MMA runs:
  the MBS factors applied per chunk inside the launch (the paper's Appendix E), the promotion
  into fp32 once per chunk. The E8M0 scales arrive relative to the chunk's largest code
  (`fp4_rel_scales`): fa = 2^(ref - 135) sigma.
- otherwise one group per row: the MMA accumulates over all of K in tensor memory, and the
  sum is multiplied by fa[m] then fb[n] once: E8M0 without MBS (`fp4_rel_scales` with one
  group: fa an exact power of two) and NVFP4 (the E4M3 scales as they are, fa and fb the
  global scales, `mx_gemm`'s order).

Error (docs/numerics.md, "The block-scaled FP4 MMA on sm_100"): every product is exact
(E2M1 times a power of two, or NVFP4's E4M3 scale); the MMA adds in fp32; per chunk one
rounding each for fa * fb, the product and the addition; the bias and the output cast.

Under the interpreter (no `dot_scaled` there) and with EMULATE the step decodes both tiles to
fp32 values (`emulated_scaled_dot`: the codes by `gemm_blocks.e2m1_pair_values`, the UE4M3
bits by a float8 bitcast) and runs `tl.dot` in IEEE fp32: everything but the MMA instruction
is the GPU's code. The MMA itself is checked where a GPU runs: the first-use self-test
(`selftest`, bit for bit on exact data) and `scripts/gpu_check.sh`.
"""

from __future__ import annotations

import torch

from vllm_mxplus.backends.triton.fp4_rel_scales import (
    BLOCKS_PER_CHUNK,
    CHUNK,
    ROW_ALIGN,
    aligned_rows,
)
from vllm_mxplus.backends.triton.fp8_chunk_gemm import grouped_tile_ids
from vllm_mxplus.backends.triton.gemm_blocks import (
    e2m1_pair_values,
    launch_dependents,
    wait_prior_grid,
)
from vllm_mxplus.backends.triton.gemm_launch import (
    NOMINAL_SMS,
    plan_split_k,
    split_k_count,
    split_k_result,
)
from vllm_mxplus.backends.triton.launch import (
    capturing,
    chained,
    check_available,
    interpreting,
    launch,
    target_capability,
    tl,
    triton,
)
from vllm_mxplus.formats.constants import SMALL_BLOCK, ceil_div

# tcgen05's order of a 128-row group's scales over one chunk (PTX ISA, "tcgen05 Matrix
# Descriptors", scale factor layout; Triton's block-scaled tutorial): 2 x 32 x 4 x 4, element
# (k0, r32, r4, k4) the scale k0 * 4 + k4 of the group's row r4 * 32 + r32 (`scale_rows`)
SCALE_GROUP_ROWS = 128
SCALE_GROUP = tl.constexpr(SCALE_GROUP_ROWS)  # rows per group
SCALE_GROUP_BYTES = tl.constexpr(SCALE_GROUP_ROWS * BLOCKS_PER_CHUNK)
SCALES_PER_CHUNK = tl.constexpr(BLOCKS_PER_CHUNK)  # UE4M3 bytes per row and chunk
# the GPU tiles ((PER_CHUNK, HAS_BIAS) -> BLOCK_M, BLOCK_N, warps), a 128-K chunk per step
# (one UTCOMMA.4X), 128 rows wide on both sides (a 256-row operand's scales do not take the
# copy into tensor memory, and every step then waits for its MMA). With MBS 8 warps, which
# hold the fp32 accumulator and the chunk's partial in registers (4 warps spill); without it
# the accumulator stays in tensor memory until the epilogue, on 4 warps but with a bias (whose
# epilogue spills 384 bytes there: `mxplus kernels --aot`). Counted by
# `benchmarks/gpu_static_model.py` on sm_100: 224 and 126 instructions per warp and step,
# 0.00085 (MBS) and 0.00024 warp-instructions per MAC, the MMA in flight across steps.
TILES = {
    (True, False): (128, 128, 8),
    (True, True): (128, 128, 8),
    (False, False): (128, 128, 4),
    (False, True): (128, 128, 8),
}
NUM_STAGES = 3
BLOCK_N_SPLIT = 128  # the tile width where K is split (the in-launch sum's registers)
PROGRAMS_PER_SM = 1  # one tile per SM (its registers): a grid below the SM count splits K
MIN_SPLIT = 2  # a grid filling under half the SMs splits K (`gpu_split`)
B200_SMS = 148  # the SMs launches captured for sm_100 are planned for
GROUP_M = 8  # row tiles per group of the launch order: neighbours share B tiles in L2
EMULATE_BLOCK = SCALE_GROUP_ROWS  # emulated tiles: fp32 values of 128 x 128 per operand
OUT_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
CAPABILITY_MAJOR = 10  # sm_100 / sm_103: tcgen05's block-scaled MMA


@triton.jit
def _tile_values(q, s, ROWS: tl.constexpr):
    """fp32 values [ROWS, 128] of packed codes q [ROWS, 64] (uint8) and UE4M3 bits s [ROWS, 8]."""
    lo, hi = e2m1_pair_values(q.to(tl.int32))
    v = tl.reshape(tl.join(lo, hi), (ROWS, 8, 16))
    sv = s.to(tl.float8e4nv, bitcast=True).to(tl.float32)
    return tl.reshape(v * sv[:, :, None], (ROWS, 128))


@triton.jit
def emulated_scaled_dot(a, ua, b, ub, acc, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """acc + (codes a [BM, 64] x UE4M3 ua [BM, 8]) @ (codes b [64, BN] x ub [BN, 8])^T in IEEE
    fp32: what `tl.dot_scaled(a, ua, "e2m1", b, ub, "e2m1", acc)` computes."""
    av = _tile_values(a, ua, BLOCK_M)
    bv = _tile_values(tl.trans(b), ub, BLOCK_N)
    return tl.dot(av, tl.trans(bv), acc, input_precision="ieee")


@triton.jit
def scaled_dot(a, ua, b, ub, acc, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
               EMULATE: tl.constexpr, FRESH: tl.constexpr = False):  # fmt: skip
    """acc + the block-scaled product of one chunk; FRESH: the product alone (acc unused),
    which the MMA computes into a fresh accumulator in tensor memory."""
    if EMULATE:
        if FRESH:
            acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        return emulated_scaled_dot(a, ua, b, ub, acc, BLOCK_M, BLOCK_N)
    sa = ua.to(tl.float8e4nv, bitcast=True)
    sb = ub.to(tl.float8e4nv, bitcast=True)
    if FRESH:
        return tl.dot_scaled(a, sa, "e2m1", b, sb, "e2m1")
    return tl.dot_scaled(a, sa, "e2m1", b, sb, "e2m1", acc=acc)


@triton.jit
def scale_rows(u_ptr, first, rows, stride, c0, ROWS: tl.constexpr):
    """Pointers [ROWS / 128, 1024] to the UE4M3 scale bytes of operand rows first .. first +
    ROWS (clamped into the operand's rows; ROWS whole groups: every tile, `TILES`) at chunk c0, each group's in tcgen05's order
    (SCALE_GROUP_BYTES). Loaded and put back in row order by `scale_tile`, a pattern Triton
    turns into an asynchronous copy into tensor memory (`tcgen05.cp`), so that the MMA stays
    in flight across steps; loaded as [ROWS, 8] the scales pass through registers and each
    step waits for its MMA (`kernel_tools/mma_wait.py`)."""
    i = tl.arange(0, SCALE_GROUP_BYTES)
    row = ((i // 4) % 4) * 32 + (i // 16) % 32
    col = (i // 512) * 4 + i % 4
    g = tl.arange(0, ROWS // SCALE_GROUP)
    r = tl.minimum(first + g[:, None] * SCALE_GROUP + row[None, :], rows - 1).to(tl.int64)
    # typed at the pointer: a bitcast between the load and the reshape hides the pattern
    u_ptr = u_ptr.to(tl.pointer_type(tl.float8e4nv))
    return u_ptr + r * stride + (c0 * SCALES_PER_CHUNK + col)[None, :]


@triton.jit
def scale_tile(rows_ptr, c, ROWS: tl.constexpr):
    """The UE4M3 scales [ROWS, 8] (float8e4nv) of chunk c in row order (`scale_rows`)."""
    u = tl.load(rows_ptr + c * SCALES_PER_CHUNK)
    u = tl.reshape(u, (ROWS // SCALE_GROUP, 2, 32, 4, 4))
    return tl.reshape(tl.permute(u, (0, 3, 2, 1, 4)), (ROWS, SCALES_PER_CHUNK))


@triton.jit
def _chunk_step(
    acc, c, a_rows, b_cols, ua_rows, ub_rows, fa_ptr, fb_ptr, m64, offs_n, live_n,
    stride_fa, stride_fb,
    PER_CHUNK: tl.constexpr, BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, EMULATE: tl.constexpr,
):  # fmt: skip
    """One 128-K chunk c: acc after it (the kernel's docstring). The operand rows are
    clamped into the operands (no masks: rows past M or N repeat the last one, their outputs
    never stored), but for the columns' MBS factors, read at offs_n under live_n: a clamped
    offset hides their contiguity, and Triton 3.6 then copied the 64 factors a thread holds
    one by one (942 instructions per step and 808 spilled bytes on sm_100, 343 and none so;
    Triton 3.7 220 -> 224)."""
    k = c * (BLOCK_K // 2) + tl.arange(0, BLOCK_K // 2)  # the chunk's code bytes
    a = tl.load(a_rows + k[None, :])
    b = tl.load(b_cols + k[:, None])
    ua = scale_tile(ua_rows, c, BLOCK_M)
    ub = scale_tile(ub_rows, c, BLOCK_N)
    if PER_CHUNK:
        # the chunk's product into a fresh accumulator (the MMA's own zeroing), in flight
        # while the step promotes the chunk before it
        part = scaled_dot(a, ua, b, ub, acc, BLOCK_M, BLOCK_N, EMULATE, FRESH=True)
        fa = tl.load(fa_ptr + c * stride_fa + m64)
        fb = tl.load(fb_ptr + c * stride_fb + offs_n, mask=live_n, other=0.0)
        acc += part * (fa[:, None] * fb[None, :])
    else:
        acc = scaled_dot(a, ua, b, ub, acc, BLOCK_M, BLOCK_N, EMULATE)
    return acc


@triton.jit(do_not_specialize=["NC", "CPS"])
def _fp4_scaled_gemm_kernel(
    a_ptr, ua_ptr, fa_ptr, b_ptr, ub_ptr, fb_ptr, bias_ptr, out_ptr,
    M, N, NC, CPS,
    stride_a, stride_ua, stride_fa, stride_b, stride_ub, stride_fb, stride_os, stride_om,
    PER_CHUNK: tl.constexpr, HAS_BIAS: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
    NUM_STAGES: tl.constexpr, EMULATE: tl.constexpr, SPLIT: tl.constexpr,
    PDL: tl.constexpr, TRIGGER: tl.constexpr,
):  # fmt: skip
    if PDL:  # launched early (`launch.pdl_launch`): nothing is read before the prior kernel ends
        wait_prior_grid()
    if TRIGGER:  # the fallback's row list after it may start (it waits for this one)
        launch_dependents()
    pid_m, pid_n = grouped_tile_ids(M, N, BLOCK_M, BLOCK_N, GROUP_M)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    live_m = offs_m < M
    live_n = offs_n < N
    # the operand rows, clamped (`_chunk_step`: unmasked loads in the loop)
    m64 = tl.minimum(offs_m, M - 1).to(tl.int64)
    n64 = tl.minimum(offs_n, N - 1).to(tl.int64)
    # K slice pid_s: chunks [pid_s * CPS, min(NC, (pid_s + 1) * CPS)); unsplit all of them.
    # The operand pointers start at the slice's first chunk, so that the loop counts from 0
    # in both forms
    pid_s = tl.program_id(1)
    c0 = pid_s * CPS if SPLIT else 0
    steps = tl.minimum(NC - c0, CPS) if SPLIT else NC
    a_rows = a_ptr + m64[:, None] * stride_a + c0 * (BLOCK_K // 2)
    b_cols = b_ptr + n64[None, :] * stride_b + c0 * (BLOCK_K // 2)
    ua_rows = scale_rows(ua_ptr, pid_m * BLOCK_M, M, stride_ua, c0, BLOCK_M)
    ub_rows = scale_rows(ub_ptr, pid_n * BLOCK_N, N, stride_ub, c0, BLOCK_N)
    fa_from = fa_ptr + c0 * stride_fa  # int32: below the factors' element count
    fb_from = fb_ptr + c0 * stride_fb
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for c in tl.range(0, steps, num_stages=NUM_STAGES):
        acc = _chunk_step(
            acc, c, a_rows, b_cols, ua_rows, ub_rows, fa_from, fb_from, m64, offs_n, live_n,
            stride_fa, stride_fb, PER_CHUNK, BLOCK_M, BLOCK_N, BLOCK_K, EMULATE,
        )  # fmt: skip
    if not PER_CHUNK:
        fa = tl.load(fa_ptr + m64, mask=live_m, other=0.0)
        fb = tl.load(fb_ptr + n64, mask=live_n, other=0.0)
        acc = acc * fa[:, None]
        acc = acc * fb[None, :]
    if HAS_BIAS:
        acc += tl.load(bias_ptr + offs_n, mask=live_n, other=0.0)[None, :]
    # split K: slice pid_s's fp32 partial in its plane (`gemm_launch.finish_output` sums them)
    out_rows = out_ptr + pid_s.to(tl.int64) * stride_os + offs_m.to(tl.int64)[:, None] * stride_om
    tl.store(
        out_rows + offs_n[None, :],
        acc.to(out_ptr.dtype.element_ty),
        mask=live_m[:, None] & live_n[None, :],
    )


def gpu_split(
    m: int, n: int, k: int, per_chunk: bool, has_bias: bool, sms: int
) -> tuple[int, int, int]:
    """(K slices, BLOCK_M, BLOCK_N) of a GPU launch on `sms` SMs: the tile of `TILES`; where
    that grid fills under half the SMs (MIN_SPLIT), K split to fill them (one tile per SM),
    the tile then BLOCK_N_SPLIT wide. The split variant's loop counts as the whole-K one
    (224 instructions per MBS step on sm_100 in both, `benchmarks/gpu_static_model.py`);
    its fp32 partials are written and summed again (a programmatic dependent launch), which
    the idle SMs of an unsplit grid cost more than from a split of 2 on (Llama-3-8B's
    linears at M = 256 / 512 on B200, by the static model at 9ede586)."""
    bm, bn, _ = TILES[per_chunk, has_bias]
    split = split_k_count(triton.cdiv(m, bm) * triton.cdiv(n, bn), k // CHUNK, sms, PROGRAMS_PER_SM)
    if split < MIN_SPLIT:
        return 1, bm, bn
    bn = BLOCK_N_SPLIT
    tiles = triton.cdiv(m, bm) * triton.cdiv(n, bn)
    return split_k_count(tiles, k // CHUNK, sms, PROGRAMS_PER_SM), bm, bn


def sm_count(device: torch.device) -> int:
    """SMs of `device` (B200's 148 while capturing launches for sm_100, else NOMINAL_SMS,
    and off CUDA)."""
    if capturing() or device.type != "cuda":
        cap = target_capability(device)
        return B200_SMS if cap is not None and cap // 10 == CAPABILITY_MAJOR else NOMINAL_SMS
    return torch.cuda.get_device_properties(device).multi_processor_count


def emulates(device: torch.device) -> bool:
    """Whether launches on `device` take `emulated_scaled_dot` (the interpreter), else the MMA;
    a ValueError on a GPU (or a captured target) outside sm_100's generation, which has no
    block-scaled FP4 MMA (`launch.target_capability`; captures without a target get the
    MMA)."""
    if interpreting():
        return True
    cap = target_capability(device)
    if cap is not None and cap // 10 != CAPABILITY_MAJOR:
        raise ValueError(f"fp4_scaled_gemm: needs sm_100's block-scaled FP4 MMA, not sm_{cap}")
    return False


Operand = tuple[torch.Tensor, torch.Tensor, torch.Tensor]  # (codes, UE4M3 bits, factors)


def _check(name: str, op: Operand, k: int, groups: int) -> None:
    codes, u, f = op
    nc = ceil_div(k, CHUNK)
    rows = codes.shape[0]
    want = (
        ("codes", codes, torch.uint8, (rows, ceil_div(k, 2))),
        ("scales", u, torch.uint8, (rows, nc * BLOCKS_PER_CHUNK)),
        ("factors", f, torch.float32, (groups, rows)),
    )
    for what, t, dtype, shape in want:
        if t.dtype != dtype or tuple(t.shape) != shape or t.stride(-1) != 1:
            raise ValueError(f"fp4_scaled_gemm: {name} {what} must be {dtype} {list(shape)} with "
                             f"unit stride, got {t.dtype} {tuple(t.shape)}")  # fmt: skip


def fp4_scaled_gemm(
    a: Operand,
    b: Operand,
    k: int,
    bias: torch.Tensor | None,
    out_dtype: torch.dtype,
    per_chunk: bool,
    emulate: bool | None = None,
    split_k: int | None = None,
) -> torch.Tensor:
    """out_dtype [M, N] = sum_G fa fb (A_G B_G^T) + bias (module docstring): a, b = (codes
    [R, K/2], UE4M3 scale bits [R, K/16], factors [K/128 with per_chunk, else 1, R]); bias
    fp32 [N] or None.
    emulate: the fp32 dot of the decoded tiles instead of `tl.dot_scaled` (default: under
    the interpreter, `emulates`). split_k: K slices (whole chunks; default: as many as fill
    the SMs, `gpu_split`; 1 emulated), summed in slice order by `gemm_launch.finish_output`."""
    if k % CHUNK:
        raise ValueError(f"fp4_scaled_gemm: K = {k} is not whole {CHUNK}-element chunks (the "
                         "MMA's K step)")  # fmt: skip
    groups = k // CHUNK if per_chunk else 1
    _check("a", a, k, groups)
    _check("b", b, k, groups)
    if bias is not None and (bias.dtype != torch.float32 or bias.shape != (b[0].shape[0],)):
        raise ValueError(f"fp4_scaled_gemm: bias must be fp32 [{b[0].shape[0]}]")
    if out_dtype not in OUT_DTYPES:
        raise ValueError(f"fp4_scaled_gemm: out_dtype must be bf16, fp16 or fp32, got {out_dtype}")
    check_available(a[0])
    m, n = a[0].shape[0], b[0].shape[0]
    dev = a[0].device
    if m == 0 or n == 0:
        return torch.empty((m, n), dtype=out_dtype, device=dev)
    emulate = emulates(dev) if emulate is None else emulate
    nc = k // CHUNK
    if emulate:  # small tiles of fp32 values
        (bm, bn, warps), stages = (EMULATE_BLOCK, EMULATE_BLOCK, 4), 1
    else:
        (bm, bn, warps), stages = TILES[per_chunk, bias is not None], NUM_STAGES
    if split_k is None:
        split_k = 1
        if not emulate:
            split_k, bm, bn = gpu_split(m, n, k, per_chunk, bias is not None, sm_count(dev))
    tiles = triton.cdiv(m, bm) * triton.cdiv(n, bn)
    # fp32 partials [split, M, N] summed in slice order by `finish_output` (the in-launch sum,
    # `gemm_blocks.reduce_split_tile`, spilled these tiles: 88-272 bytes on sm_100); the
    # output is fp32 under the interpreter (its fp32 -> bf16 / fp16 cast is not RNE), cast
    # by torch
    sk = plan_split_k(m, n, k, CHUNK, tiles, split_k, bias, out_dtype, dev)
    launch(
        _fp4_scaled_gemm_kernel,
        (tiles, sk.split),
        *a[:1], a[1], a[2], b[0], b[1], b[2],
        sk.bias if sk.bias is not None else a[2],  # not read without a bias
        sk.out,
        m, n, nc, sk.k_per_split // CHUNK,
        a[0].stride(0), a[1].stride(0), a[2].stride(0),
        b[0].stride(0), b[1].stride(0), b[2].stride(0),
        m * n if sk.split > 1 else 0, n,
        PER_CHUNK=per_chunk,
        HAS_BIAS=sk.bias is not None,
        BLOCK_M=bm,
        BLOCK_N=bn,
        BLOCK_K=CHUNK,
        GROUP_M=GROUP_M,
        NUM_STAGES=stages,
        EMULATE=emulate,
        SPLIT=sk.split > 1,
        num_warps=warps,
        **chained(dev),
    )  # fmt: skip
    return split_k_result(sk, bias, out_dtype) if sk.split > 1 else sk.out.to(out_dtype)


def scale_bits_per_chunk(scales: torch.Tensor, k: int) -> torch.Tensor:
    """NVFP4's E4M3 block scales [R, K/16] as the GEMM's UE4M3 bits (the sign bit is clear:
    NVFP4's scales are >= 0), in rows aligned as `fp4_rel_scales.aligned_rows`."""
    nb = ceil_div(k, SMALL_BLOCK)
    if scales.shape[-1] != nb:
        raise ValueError(f"scale_bits_per_chunk: {scales.shape[-1]} scales for K = {k} ({nb})")
    bits = scales.view(torch.uint8)
    if bits.stride(-1) == 1 and (bits.stride(0) * bits.element_size()) % ROW_ALIGN == 0:
        return bits  # already aligned (K a multiple of 1024): no copy
    u = aligned_rows(scales.shape[0], nb, torch.uint8, scales.device)
    u.copy_(bits)
    return u
