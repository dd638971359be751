"""The fallback GEMM's device-side row list (`row_list.list_rows`): the same list and tile
flags as `torch.nonzero_static` padded with M and the tile test it replaces, for every flag
dtype and sense, across the walk's piece border, dense and sparse flags; its errors; and
`mx_gemm_rows` recomputing exactly the rows its flags name, in either sense."""

from __future__ import annotations

import pytest
import torch

from vllm_mxplus.backends.triton.mx_gemm import mx_gemm, mx_gemm_rows
from vllm_mxplus.backends.triton.row_list import BLOCK, list_rows
from vllm_mxplus.formats import quantize


def _want(flags: torch.Tensor, tiles: int, tile_m: int, when: bool):
    m = flags.shape[0]
    hit = (flags != 0) == when
    listed = torch.nonzero_static(hit, size=tiles * tile_m, fill_value=m)[:, 0].to(torch.int32)
    return listed, (listed.view(tiles, tile_m)[:, 0] >= m).to(torch.int32)


@pytest.mark.parametrize("m", [1, 17, BLOCK - 1, BLOCK, BLOCK + 1, 2 * BLOCK + 300])
@pytest.mark.parametrize("dtype", [torch.bool, torch.int8, torch.uint8])
@pytest.mark.parametrize("when", [True, False])
def test_list_equals_nonzero_static(m, dtype, when, triton_device):
    g = torch.Generator().manual_seed(m * 7 + int(when))
    for p in (0.0, 0.003, 0.5, 1.0):
        for tile_m in (16, 32):
            tiles = -(-m // tile_m) + (tile_m == 16)  # with and without a spare tile
            hit = torch.rand(m, generator=g) < p
            if dtype == torch.bool:
                flags = hit
            else:  # any nonzero byte is set
                flags = hit.to(dtype) * torch.randint(1, 128, (m,), generator=g).to(dtype)
            got = list_rows(flags.to(triton_device), tiles, tile_m, when)
            want = _want(flags, tiles, tile_m, when)
            for a, b in zip(got, want):
                assert a.dtype == torch.int32
                assert torch.equal(a.cpu(), b), (p, tile_m)


def test_list_rejects_bad_flags_and_capacity(triton_device):
    with pytest.raises(ValueError, match="flags must be bool, int8 or uint8"):
        list_rows(torch.zeros(4, dtype=torch.float32, device=triton_device), 1, 16)
    with pytest.raises(ValueError, match="flags must be"):
        list_rows(torch.zeros(2, 2, dtype=torch.bool, device=triton_device), 1, 16)
    with pytest.raises(ValueError, match="cannot list 40 rows"):
        list_rows(torch.zeros(40, dtype=torch.bool, device=triton_device), 2, 16)


@pytest.mark.parametrize("when", [True, False])
def test_rows_gemm_recomputes_exactly_the_flagged_rows(when, triton_device):
    """Rows flagged `when` get mx_gemm's rows bit for bit; every other row keeps y's value."""
    g = torch.Generator().manual_seed(3)
    m, n, k = 37, 24, 256
    fmt = "mxfp4-mbs-s"
    qx = quantize(torch.randn(m, k, generator=g), fmt)
    qw = quantize(torch.randn(n, k, generator=g), "mxfp4-mbs-d")
    dev = triton_device
    x = (qx.codes.to(dev), qx.scales.to(dev), qx.mbs.to(dev), None)
    w = (qw.codes.to(dev), qw.scales.to(dev), qw.mbs.to(dev), None)
    kw = dict(fmt="e8m0", block_size=16, macro_block=128)
    full = mx_gemm(x, w, k, None, torch.bfloat16, **kw).cpu()
    hit = torch.zeros(m, dtype=torch.bool)
    hit[[0, 5, 16, 17, 36]] = True
    flags = (hit if when else ~hit).to(torch.int8)
    y = torch.full((m, n), 7.0, dtype=torch.bfloat16, device=dev)
    got = mx_gemm_rows(y, flags.to(dev), x, w, k, when=when, **kw).cpu()
    assert torch.equal(got[hit].view(torch.int16), full[hit].view(torch.int16))
    assert (got[~hit] == 7.0).all()
