"""The CUTLASS prefill backend's self-test bound admits what Hopper's FP8 tensor cores
compute: about 14 significand bits kept, truncating, between the fp32 promotions once per
128-K chunk (docs/numerics.md, "Kernel numerics and error bounds"). An emulation of that
accumulator passes the bound with the backend's `accumulator_bits`, and fails the fp32 bound
(24 bits) the backend inherited before: the self-test would have rejected a correct kernel.
The bound is the chunked one (`accumulation_chunk`): the narrow accumulator inside each
128-K chunk, fp32 across chunks. One 13-bit accumulator over all K has n·u >= 1 past K ~ 8184
(the first H200 run: Llama-3-8B's down projection, K = 14336, "failed" a correct kernel
against a negative bound) and admits an all-zero output from K ~ 4096.
"""

import pytest
import torch

from vllm_mxplus.backends.checks import accumulation_gamma, output_bound
from vllm_mxplus.backends.cutlass.linear import CutlassPrefillBackend
from vllm_mxplus.formats import fake_quantize, quantize


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


def _case(k: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(4, k, generator=g)
    w = torch.randn(24, k, generator=g) * k**-0.5
    xq = fake_quantize(x, "mxfp4-mbs-s").to(torch.float64)
    wq = quantize(w, "mxfp4-mbs-s").dequantize(torch.float32).to(torch.float64)
    return xq, wq, xq @ wq.T, xq.abs() @ wq.abs().T


@pytest.mark.parametrize("k", [1024, 4096, 14336])
def test_chunked_bound_admits_the_accumulator_and_rejects_a_zero_output(k):
    be = CutlassPrefillBackend
    bits, chunk = be.accumulator_bits, be.accumulation_chunk
    assert chunk == 128
    xq, wq, y64, a = _case(k, k)
    zero = torch.zeros(wq.shape[0], dtype=torch.float64)
    bound = output_bound(a, y64, zero, k, torch.float32, bits, chunk)
    assert bool((bound > 0).all())
    assert bool(((_hopper_like(xq, wq) - y64).abs() <= bound).all())
    # an all-zero output is outside (a chunk left out is not: the exact-data check sees that)
    assert not bool(((torch.zeros_like(y64) - y64).abs() <= bound).all())


def test_one_narrow_accumulator_over_all_k_is_no_bound():
    with pytest.raises(ValueError, match="n·u = .* >= 1, no bound"):
        accumulation_gamma(14336, 13)
    assert accumulation_gamma(14336, 13, 128) < 0.02  # inside a chunk 136 roundings at 2^-13
    for k in (320, 1024, 4096):  # the chunked bound is never looser than the one over all K
        assert accumulation_gamma(k, 13, 128) <= accumulation_gamma(k, 13)
    assert accumulation_gamma(4096, 24, 128) == accumulation_gamma(4096, 24)  # fp32: no chunks
