"""Grouped MoE expert GEMMs on the GPU: (token, slot) pairs sorted into per-expert row tiles
on the device, every expert's weight read packed by `mx_gemm._mx_gemm_kernel` (MOE mode).

`moe_align` (moe_align_block_size-style, torch ops only: no host sync, no data-dependent
shape, capturable in a CUDA graph) lays the P = M * top_k pairs out as row tiles of BLOCK_M
pairs, each tile holding pairs of one local expert (padded with the sentinel P), and says
which expert each tile belongs to. The number of tiles is a bound from the shapes alone,
ceil((P + min(E, P) * (BLOCK_M - 1)) / BLOCK_M); tiles past the last expert's rows exit at
once. Pairs routed to other ranks' experts (expert_map -> -1) are in no tile.

`moe_experts_triton` is the same computation, in the same dtypes, as
`moe_experts_reference` (backends/reference/experts.py): per token t and each of its top-k
(expert e, weight w), a = Q_act(x_t) once per token; g|u = a W13_hat[e]^T cast to the model
dtype; h = act(g) * u in the model dtype; Q_act(h) per pair row; y = Q_act(h) W2_hat[e]^T
cast to the model dtype; the weighted y summed over the slots in fp32 and cast. Only the
GEMMs' fp32 accumulation order (the bound of `mx_gemm`) and the order of the top-k fp32
additions differ.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from vllm_mxplus.backends.library import op_name
from vllm_mxplus.backends.triton.gemm_launch import SplitK
from vllm_mxplus.backends.triton.launch import ceil_div, check_available, interpreting
from vllm_mxplus.backends.triton.mx_gemm import (
    DECODE_BLOCK_M,
    PREFILL_BLOCK_M,
    gemm_tiles,
    launch_mx_gemm,
    operand_format,
)

# MBS row tiles of 32 pairs: the gathered rows' offsets and the sigma scaling live beside the
# accumulator; 4 warps spilled on sm_80 / sm_100 (kernels/README.md), 8 do not
MOE_NUM_WARPS_MBS = 8


@dataclass
class PackedExpertWeights:
    """One stacked expert weight [E, N, K], all experts' rows as one packed matrix [E*N, .]:
    codes, scales (uint8; E4M3 bytes for nvfp4), extra (MBS bytes / MX+ block-max indices /
    None), global (fp32 per row, nvfp4) or None."""

    codes: torch.Tensor
    scales: torch.Tensor
    extra: torch.Tensor | None
    global_scale: torch.Tensor | None
    experts: int
    n: int  # rows per expert
    k: int

    @property
    def operands(self) -> tuple:
        return (self.codes, self.scales, self.extra, self.global_scale)


def moe_block_m(pairs: int, experts: int) -> int:
    """Row tile of the grouped GEMM: the decode tile when the active experts get about 16
    pairs or fewer each, the prefill tile otherwise (a choice from shapes only)."""
    active = max(1, min(experts, pairs))
    return DECODE_BLOCK_M if pairs <= DECODE_BLOCK_M * active else PREFILL_BLOCK_M


def moe_capacity(pairs: int, experts: int, block_m: int) -> int:
    """Slots of the sorted pair list: every pair plus under one tile of padding per expert
    that can be non-empty (at most min(E, P)), in whole tiles."""
    return ceil_div(pairs + min(experts, pairs) * (block_m - 1), block_m) * block_m


def moe_align(
    topk_ids: torch.Tensor, expert_map: torch.Tensor | None, experts: int, block_m: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """(sorted pair ids int32 [capacity] (P pads), expert of each row tile int32
    [capacity / block_m] (`experts` past the last tile)). Pairs keep their order within an
    expert (a stable sort), so the layout is deterministic."""
    p = topk_ids.numel()
    dev = topk_ids.device
    ids = topk_ids.reshape(-1).long()
    if expert_map is not None:
        ids = expert_map[ids].long()
    ids = torch.where(ids >= 0, ids, experts)  # other ranks' experts: bucket E, never tiled
    counts = torch.zeros(experts + 1, dtype=torch.long, device=dev)
    counts.scatter_add_(0, ids, torch.ones_like(ids))
    padded = (counts[:experts] + block_m - 1) // block_m * block_m
    ends = torch.cumsum(padded, 0)
    starts = torch.cat([ends.new_zeros(1), ends])  # [E + 1]; bucket E starts past the end
    order = torch.sort(ids, stable=True).indices
    sorted_ids = ids[order]
    first = torch.cumsum(counts, 0) - counts  # each bucket's first index in sorted order
    rank = torch.arange(p, device=dev) - first[sorted_ids]
    cap = moe_capacity(p, experts, block_m)
    pos = torch.where(sorted_ids < experts, starts[sorted_ids] + rank, cap)  # cap: discarded
    pairs = torch.full((cap + 1,), p, dtype=torch.int32, device=dev)
    pairs.scatter_(0, pos, order.to(torch.int32))
    tile_start = torch.arange(0, cap, block_m, device=dev)
    tile_expert = torch.searchsorted(ends, tile_start, right=True).to(torch.int32)
    return pairs[:cap], tile_expert


def moe_gemm(
    x: tuple,
    w: PackedExpertWeights,
    pairs: torch.Tensor,
    tile_expert: torch.Tensor,
    *,
    num_pairs: int,
    topk: int,
    out_dtype: torch.dtype,
    fmt: str,
    block_size: int,
    macro_block: int,
    block_m: int,
) -> torch.Tensor:
    """out [num_pairs, w.n]: row p = Q(x)[p // topk] @ W_hat[expert of p]^T for every pair in
    a tile, 0 for the others (pairs of other ranks' experts). x: packed activation operands
    (codes, scales, extra, global) with one row per token (topk > 1) or per pair (topk 1)."""
    check_available(w.codes)
    interp = interpreting()
    out = torch.zeros(
        (num_pairs, w.n), dtype=torch.float32 if interp else out_dtype, device=w.codes.device
    )
    if num_pairs == 0:
        return out.to(out_dtype)
    has_mbs = fmt == "e8m0" and (x[2] is not None or w.extra is not None)
    bm, bn, bk, warps = gemm_tiles(num_pairs, macro_block, has_mbs, block_size)
    if has_mbs and block_m > DECODE_BLOCK_M:
        warps = MOE_NUM_WARPS_MBS
    tiles = (block_m, bn, bk, warps)
    sk = SplitK(split=1, k_per_split=w.k, out=out, bias=None)
    moe = (pairs, tile_expert, w.experts, topk)
    grid_m = tile_expert.shape[0]
    launch_mx_gemm(x, w.operands, sk, w.k, fmt, block_size, macro_block, tiles, grid_m, moe)
    return out.to(out_dtype)


#: `moe_gemm` as a custom op (traceable): x and w packed operands (codes, scales, extra,
#: global), w stacked [experts * n rows, .]; the keyword arguments are moe_gemm's.
MOE_GEMM_SCHEMA = (
    "(Tensor?[] x, Tensor?[] w, Tensor pairs, Tensor tile_expert, SymInt experts, SymInt n, "
    "SymInt k, *, SymInt num_pairs, SymInt topk, ScalarType out_dtype, str fmt, "
    "SymInt block_size, SymInt macro_block, SymInt block_m) -> Tensor"
)


@torch.library.custom_op(op_name("triton_moe_gemm"), mutates_args=(), schema=MOE_GEMM_SCHEMA)
def moe_gemm_op(x, w, pairs, tile_expert, experts, n, k, **kw) -> torch.Tensor:
    """`moe_gemm` on operand lists (x per token or pair, w of `experts` x n rows)."""
    codes, scales, extra, g = w
    weights = PackedExpertWeights(codes, scales, extra, g, experts, n, k)
    return moe_gemm(tuple(x), weights, pairs, tile_expert, **kw)


@moe_gemm_op.register_fake
def _moe_gemm_fake(x, w, pairs, tile_expert, experts, n, k, *, num_pairs, out_dtype, **_kw):
    return w[0].new_empty((num_pairs, n), dtype=out_dtype)


def _grouped(x: tuple, w: PackedExpertWeights, pairs, tile_expert, **kw) -> torch.Tensor:
    """`moe_gemm` through its custom op."""
    operands = (list(x), list(w.operands))
    return torch.ops.vllm_mxplus.triton_moe_gemm(
        *operands, pairs, tile_expert, w.experts, w.n, w.k, **kw
    )


Quantizer = Callable[[torch.Tensor, torch.Tensor | None], tuple]


def moe_experts_triton(
    x: torch.Tensor,
    w13: PackedExpertWeights,
    w2: PackedExpertWeights,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    *,
    weight_format: str,
    quantize_rows: Quantizer,
    macro_block: int,
    activation: Callable[[torch.Tensor], torch.Tensor],
    expert_map: torch.Tensor | None = None,
    row_global_scale: Callable[[torch.Tensor], torch.Tensor] | None = None,
) -> torch.Tensor:
    """Routed-expert output [M, H] in x's dtype (module docstring).

    quantize_rows(rows, global_scale or None) -> packed activation operands (codes, scales,
    extra, global) of `rows`, one row per token / pair. row_global_scale: NVFP4 under TP,
    h -> the global scales of the whole unsharded rows."""
    m, topk = topk_ids.shape
    out_dtype = x.dtype
    p = m * topk
    fmt, bs = operand_format(weight_format)
    block_m = moe_block_m(p, w13.experts)
    pairs, tile_expert = moe_align(topk_ids, expert_map, w13.experts, block_m)
    common = dict(fmt=fmt, block_size=bs, macro_block=macro_block, block_m=block_m)
    a = quantize_rows(x.reshape(m, -1), None)
    gu = _grouped(a, w13, pairs, tile_expert, num_pairs=p, topk=topk, out_dtype=out_dtype, **common)
    gate, up = gu.chunk(2, dim=-1)
    h = activation(gate) * up
    g = None if row_global_scale is None else row_global_scale(h)
    hq = quantize_rows(h, g)
    y = _grouped(hq, w2, pairs, tile_expert, num_pairs=p, topk=1, out_dtype=out_dtype, **common)
    weighted = y.to(torch.float32).view(m, topk, -1) * topk_weights.to(torch.float32)[..., None]
    return weighted.sum(1).to(out_dtype)


__all__ = [
    "PackedExpertWeights",
    "moe_align",
    "moe_block_m",
    "moe_capacity",
    "moe_experts_triton",
    "moe_gemm",
]
