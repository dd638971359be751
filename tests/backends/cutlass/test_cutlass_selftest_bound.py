"""The CUTLASS prefill backend's self-test bound admits what Hopper's FP8 tensor cores
compute: about 14 significand bits kept, truncating, between the fp32 promotions once per
128-K chunk (docs/numerics.md, "Kernel numerics and error bounds"). An emulation of that
accumulator passes the bound with the backend's `accumulator_bits`, and fails the fp32 bound
(24 bits) the backend inherited before: the self-test would have rejected a correct kernel.
"""

import pytest
import torch

from vllm_mxplus.backends.cutlass.linear import CutlassPrefillBackend
from vllm_mxplus.formats import fake_quantize, quantize

try:  # the bound's home moves with the self-test's structure
    from vllm_mxplus.backends.checks import output_bound  # type: ignore[import-not-found]
except ImportError:
    from vllm_mxplus.backends.selftest import output_bound


def _truncate(v: torch.Tensor, bits: int) -> torch.Tensor:
    """v (float64) with its significand truncated to `bits` bits (toward zero)."""
    m, e = torch.frexp(v)  # v = m * 2^e, 0.5 <= |m| < 1
    return torch.ldexp(torch.trunc(m * 2.0**bits) / 2.0**bits, e)


def _hopper_like(xq: torch.Tensor, wq: torch.Tensor, kept_bits: int = 14) -> torch.Tensor:
    """y = sum over 128-K chunks (fp32) of a chunk sum accumulated with `kept_bits` bits."""
    m, k = xq.shape
    y = torch.zeros(m, wq.shape[0], dtype=torch.float64)
    for c0 in range(0, k, 128):
        acc = torch.zeros_like(y)
        for j in range(c0, min(c0 + 128, k)):
            acc = _truncate(acc + xq[:, j, None] * wq[None, :, j], kept_bits)
        y = (y + acc.to(torch.float32).to(torch.float64)).to(torch.float32).to(torch.float64)
    return y


@pytest.mark.parametrize("k", [320, 1024])
def test_bound_admits_a_14_bit_accumulator(k):
    g = torch.Generator().manual_seed(k)
    x = torch.randn(16, k, generator=g)
    w = torch.randn(48, k, generator=g) * 0.05
    xq = fake_quantize(x, "mxfp4-mbs-s").to(torch.float64)
    wq = quantize(w, "mxfp4-mbs-s").dequantize(torch.float32).to(torch.float64)
    y64 = xq @ wq.T
    a = xq.abs() @ wq.abs().T
    y = _hopper_like(xq, wq)
    err = (y - y64).abs()
    zero = torch.zeros(48, dtype=torch.float64)
    bits = CutlassPrefillBackend.accumulator_bits
    assert bits <= 14
    assert bool((err <= output_bound(a, y64, zero, k, torch.float32, bits)).all())
    assert not bool((err <= output_bound(a, y64, zero, k, torch.float32, 24)).all())
