"""What the GEMM launchers (`triton_decode_gemm`, `triton_mx_gemm`) share on the host: their
argument checks, the macro blocks their K steps tile, and split-K (how many K slices, the
output the kernel writes, the deterministic sum of the fp32 partials in a second launch or
inside the GEMM's own, the interpreter's cast outside the kernel).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple

import torch
from torch._subclasses.fake_tensor import FakeTensor

from vllm_mxplus import settings
from vllm_mxplus.backends.triton.gemm_blocks import launch_dependents, wait_prior_grid
from vllm_mxplus.backends.triton.launch import (
    capturing,
    ceil_div,
    chained,
    interpreting,
    launch,
    tl,
    triton,
)

MAX_SPLIT_K = 16
SPLIT_PLANES = tl.constexpr(MAX_SPLIT_K)  # planes `gemm_blocks.reduce_split_tile` unrolls
MAX_GRID_M_TILES = 65535  # the grid's third axis (row tiles) is at most 2^16 - 1 on CUDA
MIN_MACRO_BLOCK = 16  # one scale block; a power of two: a K step holds whole macro blocks
NOMINAL_SMS = 132  # SM count used while capturing launches (H100/H200 class)
OUT_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
# output tiles one launch can sum its K slices for in-launch (`split_counters`): above the
# largest split grid (`split_k_count` splits only grids of fewer than per_sm x SMs tiles)
SPLIT_COUNTERS = 4096

_COUNTERS: dict[tuple, torch.Tensor] = {}


def codes_aligned(k: int, *codes: torch.Tensor) -> bool:
    """Whether packed code rows of K elements vectorize on the GPU: the row's byte count and
    every operand's row pitch and base address are multiples of 16 bytes. The wide decode
    tiles (16 x 128 x 128) need it: with per-byte masked loads they spill registers."""
    return ceil_div(k, 2) % 16 == 0 and all(
        t.stride(0) % 16 == 0 and _base_address(t) % 16 == 0 for t in codes
    )


def _base_address(t: torch.Tensor) -> int:
    """t's first byte's address; for a fake tensor (tracing: no storage, whose data_ptr torch
    deprecates) its byte offset into a storage that the caching allocator aligns to 512."""
    if isinstance(t, FakeTensor):
        return int(t.storage_offset()) * t.element_size()
    return t.data_ptr()


def supports_macro_block(macro_block: int) -> bool:
    """Whether the GEMMs tile this MBS macro block: a power of two >= 16, so a K step (itself
    a power of two) lies inside one macro block or holds whole ones, never parts."""
    return macro_block >= MIN_MACRO_BLOCK and macro_block & (macro_block - 1) == 0


def check_gemm_args(who: str, out_dtype: torch.dtype, macro_block: int, has_mbs: bool) -> None:
    """Raise a ValueError naming `who` for an out_dtype other than bf16, fp16 and fp32, or for
    MBS operands with a macro block the K steps cannot tile (`supports_macro_block`)."""
    if out_dtype not in OUT_DTYPES:
        raise ValueError(f"{who}: out_dtype must be bf16, fp16 or fp32, got {out_dtype}")
    if has_mbs and not supports_macro_block(macro_block):
        raise ValueError(
            f"{who}: macro_block must be a power of two >= {MIN_MACRO_BLOCK} (a K step holds "
            f"whole macro blocks), got {macro_block}"
        )


def dot_dtype() -> Any:
    """The dot operands' dtype (constexpr DOT_DTYPE): bf16 on the GPU; fp32 under the
    interpreter, whose bf16 arithmetic is wrong (`gemm_blocks.pair_dot` then multiplies in
    IEEE fp32)."""
    return tl.float32 if interpreting() else tl.bfloat16


def split_k_for(
    out_tiles: int, k_tiles: int, device: torch.device, per_sm: int | None = None
) -> int:
    """Enough (output tile, K slice) programs for VLLM_MXPLUS_GPU_PROGRAMS_PER_SM (2) per SM
    (per_sm: a kernel's own, where its registers fit fewer); 1 in the interpreter. out_tiles counts N tiles x M tiles: many rows (prefill) need no split, whose
    fp32 partials would cost split x M x N x 4 bytes."""
    if capturing():
        sms = NOMINAL_SMS
    elif interpreting() or device.type != "cuda":
        return 1
    else:
        sms = torch.cuda.get_device_properties(device).multi_processor_count
    return split_k_count(out_tiles, k_tiles, sms, per_sm or settings.gpu_programs_per_sm())


def split_k_count(out_tiles: int, k_tiles: int, sms: int, per_sm: int) -> int:
    """`split_k_for`'s rule on a GPU of `sms` SMs: about per_sm programs per SM, at most
    MAX_SPLIT_K slices and one per K step."""
    return max(1, min(MAX_SPLIT_K, k_tiles, ceil_div(per_sm * sms, out_tiles)))


class SplitK(NamedTuple):
    """A launch's K slices and what its kernel writes and reads besides the operands."""

    split: int  # K slices (grid axis 1)
    k_per_split: int  # K per slice: a whole number of K steps
    out: torch.Tensor  # y [m, n] itself (split 1), or fp32 partials [split, m, n]
    # the bias as the kernel reads it (split 1 or summed in the launch), else None
    bias: torch.Tensor | None
    y: torch.Tensor | None = None  # y [m, n], where the launch sums its slices itself
    counters: torch.Tensor | None = None  # `split_counters`' int32 [SPLIT_COUNTERS] then


def split_counters(device: torch.device) -> torch.Tensor | None:
    """The arrival counters of the in-launch split-K sum (`gemm_blocks.reduce_split_tile`)
    on `device` and its current stream: int32 [SPLIT_COUNTERS], zero between launches (the
    last program of each tile sets its counter back to 0). One buffer per stream: launches
    on one stream run one after the other, so they never count into the same counter at the
    same time (vLLM's micro-batches share one compute stream). Allocated (zeroed) at the
    first call on a stream, so not during a CUDA-graph capture: None then (the caller sums
    in a second launch); vLLM's warm-up runs before each capture allocate it. Kept for the
    process (16 KiB)."""
    if capturing():  # recorded, never run; the tensors may be fake (not kept)
        return torch.empty(SPLIT_COUNTERS, dtype=torch.int32, device=device)
    cuda = device.type == "cuda"
    if cuda:
        stream = torch.cuda.current_stream(device)
        key: tuple = (stream.device.index, stream.cuda_stream)
    else:  # the interpreter's CPU tensors, the meta device of `capture_launches`
        key = (device.type, device.index)
    counters = _COUNTERS.get(key)
    if counters is None:
        if cuda and torch.cuda.is_current_stream_capturing():
            return None
        counters = torch.zeros(SPLIT_COUNTERS, dtype=torch.int32, device=device)
        _COUNTERS[key] = counters
    return counters


def plan_split_k(
    m: int,
    n: int,
    k: int,
    block_k: int,
    out_tiles: int,
    split_k: int | None,
    bias: torch.Tensor | None,
    out_dtype: torch.dtype,
    device: torch.device,
    in_launch: bool = False,
    per_sm: int | None = None,
) -> SplitK:
    """Split K in split_k slices when given (at most one per K step), else `split_k_for`;
    no slice is empty. Partials are summed in slice order, so deterministically (unlike
    atomic adds): in_launch (a kernel that calls `gemm_blocks.reduce_split_tile`) by the
    last program of each output tile, where `split_counters` has counters (SplitK.y,
    SplitK.counters set), else by `finish_output`'s second launch. Under the interpreter y
    stays fp32 (its fp32 -> bf16 cast does not round to nearest even: `split_k_result`
    casts) and the bias is read as fp32 (its bf16 / fp16 conversions are not exact).
    per_sm: `split_k_for`'s (a launch of smaller programs asks for more per SM)."""
    k_tiles = triton.cdiv(k, block_k)
    split = max(1, min(split_k or split_k_for(out_tiles, k_tiles, device, per_sm), k_tiles))
    k_per_split = ceil_div(k_tiles, split) * block_k
    split = ceil_div(k, k_per_split)
    interp = interpreting()
    kernel_bias = bias.to(torch.float32) if interp and bias is not None else bias
    y_dtype = torch.float32 if interp else out_dtype
    if split > 1:
        out = torch.empty((split, m, n), dtype=torch.float32, device=device)
        counters = (
            split_counters(device) if in_launch and sums_in_launch(out_tiles, split) else None
        )
        if counters is None:
            return SplitK(split, k_per_split, out, None)
        y = torch.empty((m, n), dtype=y_dtype, device=device)
        return SplitK(split, k_per_split, out, kernel_bias, y, counters)
    out = torch.empty((m, n), dtype=y_dtype, device=device)
    return SplitK(1, k_per_split, out, kernel_bias)


def sums_in_launch(out_tiles: int, split: int) -> bool:
    """Whether a launch of out_tiles tiles and `split` K slices can sum them itself
    (`gemm_blocks.reduce_split_tile`): a counter per tile (SPLIT_COUNTERS) and at most the
    SPLIT_PLANES planes its sum unrolls (an explicit split_k may ask for more)."""
    return out_tiles <= SPLIT_COUNTERS and split <= MAX_SPLIT_K


def split_k_result(sk: SplitK, bias: torch.Tensor | None, out_dtype: torch.dtype) -> torch.Tensor:
    """y in out_dtype after a launch planned by `plan_split_k`: the launch's own sum
    (SplitK.y), else `finish_output` of what it wrote."""
    if sk.y is not None:
        return sk.y.to(out_dtype)
    return finish_output(sk.out, bias, out_dtype)


def by_row_chunks(x: tuple, rows: int, gemm: Callable[[tuple], torch.Tensor]) -> torch.Tensor:
    """gemm(x's rows) for consecutive chunks of at most `rows` rows of the x operands (None
    stays None), concatenated: more row tiles than one grid holds (MAX_GRID_M_TILES) run as
    consecutive launches."""
    m = x[0].shape[0]
    chunks = (tuple(None if t is None else t[r : r + rows] for t in x) for r in range(0, m, rows))
    return torch.cat([gemm(xr) for xr in chunks])


FINISH_BLOCK = 1024  # outputs per program of the split-K finish


@triton.jit
def _finish_kernel(part_ptr, bias_ptr, y_ptr, split, mn, n,
                   HAS_BIAS: tl.constexpr, BLOCK: tl.constexpr,
                   PDL: tl.constexpr, TRIGGER: tl.constexpr):  # fmt: skip
    """y[i] = (((p[0, i] + p[1, i]) + ...) + p[split-1, i]) (+ bias[i % n]) over the fp32
    partials p [split, mn], cast to y's dtype in the store: the K slices in order, so the same
    bits every run. The slice step is added to a 64-bit pointer (split * mn may pass 2^31).
    PDL / TRIGGER: a programmatic dependent launch (`launch.pdl_launch`): it waits for the GEMM
    before it, and lets the kernel after it start its programs (which wait for this one)."""
    if PDL:
        wait_prior_grid()
    if TRIGGER:
        launch_dependents()
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < mn
    ptrs = part_ptr + offs
    acc = tl.load(ptrs, mask=mask, other=0.0)
    for _ in range(1, split):
        ptrs += mn
        acc += tl.load(ptrs, mask=mask, other=0.0)
    if HAS_BIAS:
        acc += tl.load(bias_ptr + offs % n, mask=mask, other=0.0).to(tl.float32)
    tl.store(y_ptr + offs, acc.to(y_ptr.dtype.element_ty), mask=mask)


def finish_output(
    out: torch.Tensor, bias: torch.Tensor | None, out_dtype: torch.dtype
) -> torch.Tensor:
    """y in out_dtype from `SplitK.out`: the K slices' partials summed in fp32 in slice order
    plus the bias (which the kernel adds only without split-K) and cast, in one launch
    (`_finish_kernel`: on a decode step each launch costs as much as a small kernel's work);
    or y itself cast. Under the interpreter the kernel writes fp32 and reads the bias as fp32
    (its own bf16 / fp16 conversions are not IEEE), and torch casts."""
    if out.dim() == 2:
        return out.to(out_dtype)
    split, m, n = out.shape
    if m * n == 0:
        return torch.empty((m, n), dtype=out_dtype, device=out.device)
    interp = interpreting()
    y = torch.empty((m, n), dtype=torch.float32 if interp else out_dtype, device=out.device)
    b = None if bias is None else (bias.to(torch.float32) if interp else bias)
    grid = (ceil_div(m * n, FINISH_BLOCK),)
    launch(_finish_kernel, grid, out, b if b is not None else y, y, split, m * n, n,
           HAS_BIAS=b is not None, BLOCK=FINISH_BLOCK, **chained(out.device))  # fmt: skip
    return y.to(out_dtype)
