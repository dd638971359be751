"""The GEMMs' code -> value decoders (`gemm_blocks.e2m1_value`, `e2m1_pair_values`) against
`formats.e2m1_decode`, bit for bit, over every code and every packed byte (-0.0 included:
compared as fp32 bits).

Runs on CPU under TRITON_INTERPRET=1 (tests/backends/conftest.py) or on CUDA when compiled.
"""

from __future__ import annotations

import torch

from vllm_mxplus.backends.triton.gemm_blocks import e2m1_pair_values, e2m1_value
from vllm_mxplus.backends.triton.launch import tl, triton
from vllm_mxplus.formats.e2m1 import e2m1_decode


@triton.jit
def _decode_bytes_kernel(b_ptr, lo_ptr, hi_ptr, nib_lo_ptr, nib_hi_ptr, N: tl.constexpr):
    i = tl.arange(0, N)
    b = tl.load(b_ptr + i).to(tl.int32)
    lo, hi = e2m1_pair_values(b)
    tl.store(lo_ptr + i, lo)
    tl.store(hi_ptr + i, hi)
    tl.store(nib_lo_ptr + i, e2m1_value(b & 15))
    tl.store(nib_hi_ptr + i, e2m1_value(b >> 4))


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.int32)


def test_e2m1_decoders_match_formats_on_every_byte(triton_device):
    device = triton_device
    b = torch.arange(256, dtype=torch.int32).to(torch.uint8).to(device)
    outs = [torch.empty(256, dtype=torch.float32, device=device) for _ in range(4)]
    _decode_bytes_kernel[(1,)](b, *outs, N=256)
    lo, hi, nib_lo, nib_hi = (o.cpu() for o in outs)
    want_lo = e2m1_decode((b.cpu() & 15).to(torch.uint8)).to(torch.float32)
    want_hi = e2m1_decode((b.cpu() >> 4).to(torch.uint8)).to(torch.float32)
    assert torch.equal(_bits(lo), _bits(want_lo))
    assert torch.equal(_bits(hi), _bits(want_hi))
    assert torch.equal(_bits(nib_lo), _bits(want_lo))
    assert torch.equal(_bits(nib_hi), _bits(want_hi))
    # the check can fail: code 8 is -0.0, whose bits differ from +0.0's
    assert not torch.equal(_bits(want_lo), _bits(want_lo.abs()))
