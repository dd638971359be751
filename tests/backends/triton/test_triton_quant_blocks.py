"""The activation quantizers' E2M1 rounding (`quant_blocks.e2m1_magnitude_code`: one fp32
addition per element) against `formats.e2m1_magnitude_code` (a comparison per threshold),
code for code, on every threshold, its fp32 neighbours, every grid value, subnormals,
values past 6, Inf, NaN and a million random magnitudes.

Runs on CPU under TRITON_INTERPRET=1 (tests/backends/conftest.py) or on CUDA when compiled.
"""

from __future__ import annotations

import torch

from vllm_mxplus.backends.triton.launch import tl, triton
from vllm_mxplus.backends.triton.quant_blocks import e2m1_magnitude_code
from vllm_mxplus.formats.e2m1 import E2M1_THRESHOLDS, E2M1_VALUES
from vllm_mxplus.formats.e2m1 import e2m1_magnitude_code as spec_code

BLOCK = 4096


@triton.jit
def _codes_kernel(v_ptr, c_ptr, N, BLOCK: tl.constexpr):
    i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    v = tl.load(v_ptr + i, mask=i < N, other=0.0)
    tl.store(c_ptr + i, e2m1_magnitude_code(v), mask=i < N)


def _edge_values() -> torch.Tensor:
    pts = torch.tensor(list(E2M1_THRESHOLDS) + list(E2M1_VALUES) + [5.999, 6.5, 7.0, 8.0, 1e30])
    up = torch.nextafter(pts, torch.tensor(float("inf")))
    down = torch.nextafter(pts, torch.tensor(0.0))
    tiny = torch.tensor([0.0, 2.0**-149, 2.0**-127, 2.0**-126, 1e-30, float("inf"), float("nan")])
    gen = torch.Generator().manual_seed(0)
    uniform = torch.rand(1 << 19, generator=gen) * 8.0
    logs = torch.exp2(torch.rand(1 << 19, generator=gen) * 40.0 - 30.0)
    return torch.cat([pts, up, down, tiny, uniform, logs]).to(torch.float32)


def _codes(v: torch.Tensor) -> torch.Tensor:
    c = torch.empty(v.shape, dtype=torch.int32, device=v.device)
    _codes_kernel[(triton.cdiv(v.numel(), BLOCK),)](v, c, v.numel(), BLOCK=BLOCK)
    return c.cpu()


def test_e2m1_rounding_matches_formats(triton_device):
    v = _edge_values()
    got = _codes(v.to(triton_device))
    want = spec_code(v).to(torch.int32)
    bad = got != want
    assert not bad.any(), f"{int(bad.sum())} codes differ, first at v = {v[bad][0].item()!r}"
    # every code and both tie directions occur, so a wrong tie rule cannot pass
    assert set(want.tolist()) == set(range(8))
    assert _codes(torch.tensor([0.25, 0.75, 2.5, 3.5]).to(triton_device)).tolist() == [0, 2, 4, 6]
