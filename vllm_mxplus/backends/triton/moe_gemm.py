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
(expert e, weight w), a = Q_act(x_t) once per token; g|u = a W13_hat[e]^T (+ b13[e], added to
the fp32 sum) cast to the model dtype; h = `expert_layer.gated(act, g|u)` in the model dtype
(act(g) * u on the halves for silu / gelu, gpt-oss's swigluoai on the interleaved row);
Q_act(h) per pair row; y = Q_act(h) W2_hat[e]^T (+ b2[e], in fp32) cast to the model dtype;
the weighted y summed over the slots in fp32 and cast. Only the GEMMs' fp32 accumulation order
(the bound of `mx_gemm`) and the order of the top-k fp32 additions differ.

Expert biases: the GEMM kernel adds one bias row to every output row, so a layer with expert
biases gets its GEMM outputs in fp32 and each pair's bias row (gathered by its local expert,
0 for pairs of other ranks' experts) is added in fp32 before the cast to the model dtype, as
the reference's fp32 F.linear does (a transient fp32 [P, N] output and bias gather per GEMM,
twice the bytes of the model-dtype output it replaces). Everything stays on the device: torch
ops and kernel launches whose shapes come from the input shapes (no host sync, capturable).
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from vllm_mxplus.backends.base import Activation
from vllm_mxplus.backends.expert_layer import gated
from vllm_mxplus.backends.library import op_name
from vllm_mxplus.backends.triton.decode_gemm import sm90_or_later
from vllm_mxplus.backends.triton.expert_weights import PackedExpertWeights
from vllm_mxplus.backends.triton.gemm_launch import SplitK, codes_aligned
from vllm_mxplus.backends.triton.launch import ceil_div, check_available, interpreting
from vllm_mxplus.backends.triton.moe_decode import moe_takes_hat
from vllm_mxplus.backends.triton.mx_gemm import (
    DECODE_BLOCK_M,
    FMT_CODES,
    FMT_E8M0,
    GATHER_BLOCK_M,
    gemm_tiles,
    launch_mx_gemm,
    narrow_macro_block,
    operand_format,
)
from vllm_mxplus.formats import FormatSpec

# MBS row tiles of 32 pairs: the gathered rows' offsets and the sigma scaling live beside the
# accumulator; 4 warps spilled on sm_80 / sm_100 (kernels/README.md), 8 do not
MOE_NUM_WARPS_MBS = 8
# Row tiles of 64 pairs, 128 weight rows, 8 warps, where every active expert gets about 64
# pairs or more and the code rows vectorize (`gemm_launch.codes_aligned`): wgmma on sm_90,
# tcgen05 on sm_100, about a quarter of the 32-row tile's instructions per MAC; on rows that
# do not vectorize it spills (kernels/README.md, "The prefill tiles")
MOE_WIDE_BLOCK_M = 64
MOE_WIDE_BLOCK_N = 128
MOE_WIDE_NUM_WARPS = 8


def local_experts(topk_ids: torch.Tensor, expert_map: torch.Tensor | None) -> torch.Tensor:
    """The local expert of every (token, slot) pair, int64 [M * top_k] in pair order; -1 for
    pairs routed to other ranks' experts (expert_map: global id -> local id or -1)."""
    ids = topk_ids.reshape(-1).long()
    return ids if expert_map is None else expert_map[ids].long()


def moe_block_m(pairs: int, experts: int, wide: bool = False) -> int:
    """Row tile of the grouped GEMM: the decode tile when the active experts get about 16
    pairs or fewer each, the wide tile (MOE_WIDE_BLOCK_M) where `wide` (`moe_wide`) and
    they get about 64 or more, the 32-row tile otherwise (a choice from shapes only)."""
    active = max(1, min(experts, pairs))
    if pairs <= DECODE_BLOCK_M * active:
        return DECODE_BLOCK_M
    if wide and pairs >= MOE_WIDE_BLOCK_M * active:
        return MOE_WIDE_BLOCK_M
    return GATHER_BLOCK_M


def moe_wide(w13: PackedExpertWeights, w2: PackedExpertWeights, has_mbs: bool, macro: int) -> bool:
    """Whether both stems may take the wide row tile: their code rows vectorize (the
    activation rows, written by the quantizers, have the same byte count and aligned
    allocations) and no MBS macro block is narrower than the K step."""
    return not narrow_macro_block(has_mbs, macro) and all(
        codes_aligned(w.k, w.codes) for w in (w13, w2)
    )


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
    return align_local(local_experts(topk_ids, expert_map), experts, block_m)


def align_local(
    local: torch.Tensor, experts: int, block_m: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """`moe_align` from the pairs' local experts (`local_experts`)."""
    p = local.numel()
    dev = local.device
    ids = torch.where(local >= 0, local, experts)  # other ranks' experts: bucket E, never tiled
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
    has_mbs: bool | None = None,
) -> torch.Tensor:
    """out [num_pairs, w.n]: row p = Q(x)[p // topk] @ W_hat[expert of p]^T for every pair in
    a tile, 0 for the others (pairs of other ranks' experts). x: packed activation operands
    (codes, scales, extra, global) with one row per token (topk > 1) or per pair (topk 1).
    fmt: the operands' kind (`mx_gemm.operand_format`); has_mbs: MBS bytes on either side (None: the
    extra bytes of E8M0 operands, which are MBS bytes)."""
    check_available(w.codes)
    interp = interpreting()
    out = torch.zeros(
        (num_pairs, w.n), dtype=torch.float32 if interp else out_dtype, device=w.codes.device
    )
    if num_pairs == 0:
        return out.to(out_dtype)
    if has_mbs is None:
        has_mbs = FMT_CODES[fmt] == FMT_E8M0 and (x[2] is not None or w.extra is not None)
    bm, bn, bk, warps = gemm_tiles(num_pairs, macro_block, has_mbs, block_size, gather=True)
    if block_m == MOE_WIDE_BLOCK_M:
        bn, warps = MOE_WIDE_BLOCK_N, MOE_WIDE_NUM_WARPS
    elif has_mbs and block_m > DECODE_BLOCK_M:
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
    "bool has_mbs, SymInt block_size, SymInt macro_block, SymInt block_m) -> Tensor"
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
# rows -> (codes, scales, MBS bytes or None, global scales or None, x_hat): `act_quant_hat`
HatQuantizer = Callable[[torch.Tensor], tuple]


def pair_bias(bias: torch.Tensor, local: torch.Tensor) -> torch.Tensor:
    """Each pair's expert bias row in fp32 [P, N] from the experts' biases [E, N] and the
    pairs' local experts (`local_experts`); 0 for pairs of other ranks' experts (-1)."""
    rows = bias[local.clamp(min=0)].to(torch.float32)
    return torch.where((local >= 0)[:, None], rows, 0.0)


def moe_experts_triton(
    x: torch.Tensor,
    w13: PackedExpertWeights,
    w2: PackedExpertWeights,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    *,
    weight: FormatSpec,
    activation_mbs: bool,
    quantize_rows: Quantizer,
    macro_block: int,
    activation: Activation,
    expert_map: torch.Tensor | None = None,
    row_global_scale: Callable[[torch.Tensor], torch.Tensor] | None = None,
    w13_bias: torch.Tensor | None = None,
    w2_bias: torch.Tensor | None = None,
    quantize_hat: HatQuantizer | None = None,
) -> torch.Tensor:
    """Routed-expert output [M, H] in x's dtype (module docstring).

    weight: the experts' weight format; activation_mbs: whether the activation format has
    MBS bytes. quantize_rows(rows, global_scale or None) -> packed activation operands
    (codes, scales, extra, global) of `rows`, one row per token / pair. activation: the
    layer's expert activation (`expert_layer.gated` applies it to g|u). row_global_scale:
    NVFP4 under TP, h -> the global scales of the whole unsharded rows. w13_bias [E, 2I] /
    w2_bias [E, H]: the local experts' biases (gpt-oss) or None. quantize_hat: the
    activation format's `act_quant_hat` (E8M0 formats); with it, E8M0 experts whose stems
    take the x_hat word path (`moe_decode.moe_takes_hat`) run the decode kernel's grouped
    mode (`moe_decode`), the others `mx_gemm`'s."""
    m, topk = topk_ids.shape
    out_dtype = x.dtype
    p = m * topk
    local = local_experts(topk_ids, expert_map)
    has_mbs = bool(weight.mbs) or activation_mbs
    kind, block_size = operand_format(weight.name)  # the kind from the format's flags
    hat = (
        quantize_hat is not None
        and FMT_CODES[kind] == FMT_E8M0
        and moe_takes_hat(w13, w2, macro_block, has_mbs, p)
    )
    wide = sm90_or_later(x.device) if hat else moe_wide(w13, w2, has_mbs, macro_block)
    block_m = moe_block_m(p, w13.experts, wide)
    pairs, tile_expert = align_local(local, w13.experts, block_m)
    common = dict(
        fmt=kind,
        has_mbs=has_mbs,
        block_size=block_size,
        macro_block=macro_block,
        block_m=block_m,
    )

    def gemm(rows: torch.Tensor, g: torch.Tensor | None, w: PackedExpertWeights,
             rows_per: int, bias: torch.Tensor | None):  # fmt: skip
        """One grouped GEMM of the quantized rows, its pairs' biases added to the fp32 sums
        before the cast."""
        dtype = out_dtype if bias is None else torch.float32
        kw = dict(num_pairs=p, topk=rows_per, out_dtype=dtype)
        if hat:
            assert quantize_hat is not None
            _, _, x_mbs, _, x_hat, _ = quantize_hat(rows)
            y = torch.ops.vllm_mxplus.triton_moe_decode_gemm(
                x_hat, x_mbs, [w.codes, w.scales, w.extra], pairs, tile_expert, w.experts,
                w.n, w.k, **kw, block_size=block_size, macro_block=macro_block,
                block_m=block_m, w_small_scales=w.small_scales,
            )  # fmt: skip
        else:
            y = _grouped(quantize_rows(rows, g), w, pairs, tile_expert, **kw, **common)
        return y if bias is None else (y + pair_bias(bias, local)).to(out_dtype)

    gu = gemm(x.reshape(m, -1), None, w13, topk, w13_bias)
    h = gated(activation, gu)
    g = None if row_global_scale is None else row_global_scale(h)
    y = gemm(h, g, w2, 1, w2_bias)
    weighted = y.to(torch.float32).view(m, topk, -1) * topk_weights.to(torch.float32)[..., None]
    return weighted.sum(1).to(out_dtype)


__all__ = [
    "PackedExpertWeights",
    "align_local",
    "local_experts",
    "moe_align",
    "moe_block_m",
    "moe_capacity",
    "moe_wide",
    "moe_experts_triton",
    "moe_gemm",
    "pair_bias",
]
