"""The device-side list of the rows an exact fallback GEMM recomputes, in one launch.

The prefill pipelines (`fp4_prefill`, `cutlass.gemm`'s sm_90 one) flag the activation rows
their fast GEMM cannot hold exactly (a byte per row) and `mx_gemm.mx_gemm_rows` recomputes
those rows through the GEMM's gathered-row mode. Its inputs are the flagged rows in ascending
order padded with M up to whole row tiles (`listed`, int32 [tiles * TILE_M]) and, per row
tile, 0 where the tile's first entry is a row and 1 where the tile is padding only
(`tile_expert`, int32 [tiles]: 1 is past the one "expert", so that program returns at once).

One program walks the flags in BLOCK pieces, a running count placing each piece's flagged
rows (`tl.cumsum`): no host sync, fixed shapes (capturable in a CUDA graph), what
`torch.nonzero_static(flags == when, size=tiles * TILE_M, fill_value=M)` and the tile test
give, without their four launches. `when` picks the flag value that means "recompute": the
FP4 pipeline flags inexact rows (1), the FP8 one exact rows (0 recomputes).

On sm_90 and later (`launch.pdl_launch`) the launch is a programmatic dependent one: it waits
for the GEMM before it (`gemm_blocks.wait_prior_grid`) and lets the fallback GEMM after it
start its programs (`gemm_blocks.launch_dependents`).
"""

from __future__ import annotations

import torch

from vllm_mxplus.backends.triton.gemm_blocks import launch_dependents, wait_prior_grid
from vllm_mxplus.backends.triton.launch import (
    chained,
    check_available,
    interpreting,
    launch,
    tl,
    triton,
)

BLOCK = 1024  # flags per step of the walk


@triton.jit
def _list_rows_kernel(
    flags_ptr, listed_ptr, tile_expert_ptr, M, CAPACITY, TILES,
    WHEN: tl.constexpr, TILE_M: tl.constexpr, BLOCK: tl.constexpr,
    PDL: tl.constexpr, TRIGGER: tl.constexpr,
):  # fmt: skip
    if PDL:  # launched early: nothing is read before the kernel before it ends
        wait_prior_grid()
    if TRIGGER:  # the fallback GEMM's programs may start (they wait for this one)
        launch_dependents()
    i = tl.arange(0, BLOCK)
    count = tl.sum(tl.zeros((BLOCK,), dtype=tl.int32), axis=0)  # an int32 scalar
    for start in range(0, M, BLOCK):
        rows = start + i
        live = rows < M
        f = tl.load(flags_ptr + rows, mask=live, other=0).to(tl.int32)
        if WHEN:
            hit = live & (f != 0)
        else:
            hit = live & (f == 0)
        hit32 = hit.to(tl.int32)
        at = count + tl.cumsum(hit32, axis=0) - 1
        tl.store(listed_ptr + at, rows, mask=hit)
        count += tl.sum(hit32, axis=0)
    for start in range(0, CAPACITY, BLOCK):
        at = start + i
        tl.store(listed_ptr + at, tl.full((BLOCK,), 0, tl.int32) + M,
                 mask=(at >= count) & (at < CAPACITY))  # fmt: skip
    for start in range(0, TILES, BLOCK):
        t = start + i
        tl.store(tile_expert_ptr + t, (t * TILE_M >= count).to(tl.int32), mask=t < TILES)


def list_rows(flags: torch.Tensor, tiles: int, tile_m: int, when: bool = True
              ) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    """(listed int32 [tiles * tile_m], tile_expert int32 [tiles]) of the rows i with
    bool(flags[i]) == when (module docstring); flags: bool, int8 or uint8 [M] on the device,
    tiles * tile_m >= M."""
    if flags.dim() != 1 or flags.dtype not in (torch.bool, torch.int8, torch.uint8):
        raise ValueError(f"list_rows: flags must be bool, int8 or uint8 [M], got {flags.dtype} "
                         f"{tuple(flags.shape)}")  # fmt: skip
    m = flags.shape[0]
    capacity = tiles * tile_m
    if capacity < m or tile_m < 1:
        raise ValueError(f"list_rows: {tiles} tiles of {tile_m} rows cannot list {m} rows")
    check_available(flags)
    listed = torch.empty((capacity,), dtype=torch.int32, device=flags.device)
    tile_expert = torch.empty((tiles,), dtype=torch.int32, device=flags.device)
    if capacity == 0:
        return listed, tile_expert
    launch(
        _list_rows_kernel,
        (1,),
        flags.contiguous().view(torch.uint8),
        listed,
        tile_expert,
        m,
        capacity,
        tiles,
        WHEN=int(when),
        TILE_M=tile_m,
        BLOCK=BLOCK,
        **chained(flags.device),
        **({} if interpreting() else {"num_warps": 4}),
    )
    return listed, tile_expert
