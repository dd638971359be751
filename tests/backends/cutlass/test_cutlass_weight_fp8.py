"""The per-call sm_90a weight re-encoding (weight_fp8) vs. its definition.

`weight_fp8_chunks(codes, scales, mbs, K, rows)` must equal `encode_fp8_chunks` of the
row-padded packed weight, bit for bit: the FP8 bytes and the folded fp32 scales (as int32
bits), on weights of every kind of chunk (in span, wider than FP8's span, NaN blocks, all-zero
chunks, partial chunks, odd row counts, with and without MBS bytes).

Runs on CPU under TRITON_INTERPRET=1 (tests/backends/conftest.py) or on CUDA when compiled.
"""

from __future__ import annotations

import pytest
import torch
from cutlass_helpers import assert_same_bits

from vllm_mxplus.backends.cutlass.fp8_chunks import ceil_to, encode_fp8_chunks, pad_rows
from vllm_mxplus.backends.cutlass.weight_fp8 import scratch_bytes, weight_fp8_chunks
from vllm_mxplus.formats import quantize
from vllm_mxplus.formats.constants import E8M0_NAN

SCHEMES = ("mxfp4-mbs-d", "mxfp4-mbs-s", "mxfp4-16-oas", "mxfp4-16")
SHAPES = ((8, 128), (13, 100), (40, 576), (7, 1536))


def _weight(fmt: str, n: int, k: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(n, k, generator=g)
    w[:, :: max(1, k // 7)] *= 2.0**12  # outliers: chunks wider than FP8's span
    w[n // 2] *= 2.0**-130  # a row of tiny values: folded scales under 2^-125
    if k > 256:
        w[1, 128:256] = 0.0  # an all-zero chunk
    return quantize(w, fmt)


def _definition(q, k: int, rows: int):
    mbs = None if q.mbs is None else pad_rows(q.mbs, rows)
    lay = encode_fp8_chunks(pad_rows(q.codes, rows), pad_rows(q.scales, rows), mbs, k)
    return lay.fp8, lay.scale


@pytest.mark.parametrize("n,k", SHAPES, ids=[f"{n}x{k}" for n, k in SHAPES])
@pytest.mark.parametrize("fmt", SCHEMES)
def test_weight_fp8_equals_the_definition(fmt, n, k):
    q = _weight(fmt, n, k, seed=n * k)
    rows = ceil_to(n, 8)
    fp8, scale = weight_fp8_chunks(q.codes, q.scales, q.mbs, k, rows)
    want_fp8, want_scale = _definition(q, k, rows)
    assert_same_bits("fp8", fp8, want_fp8)
    assert_same_bits("scale", scale, want_scale)


def test_weight_fp8_nan_block_and_signed_zero():
    """A NaN block scale (code 255) and negative-zero codes encode as the definition does."""
    q = _weight("mxfp4-16-oas", 8, 256, seed=3)
    scales = q.scales.clone()
    scales[2, 3] = E8M0_NAN
    codes = q.codes.clone()
    codes[4, :8] = 0x88  # -0, -0
    fp8, scale = weight_fp8_chunks(codes, scales, None, 256, 8)
    lay = encode_fp8_chunks(codes, scales, None, 256)
    assert_same_bits("fp8", fp8, lay.fp8)
    assert_same_bits("scale", scale, lay.scale)
    assert int(fp8.view(torch.uint8)[4, 0]) == 0x80


@pytest.mark.parametrize("mag", range(1, 8))
def test_weight_fp8_top_block_of_one_magnitude(mag):
    """The chunk's largest-scale block holds only codes of one magnitude (and its negative):
    it must count as nonzero whatever magnitude bits are set (the word kernel tests them
    two words at a time), or the chunk's reference exponent and every byte change. A second
    row leaves that block all zero (it must not count), and the rows vectorize (word kernel)."""
    n, k = 8, 256
    codes = torch.full((n, k // 2), 0x21, dtype=torch.uint8)  # 0.5 and 1.0 elsewhere
    scales = torch.full((n, k // 16), 120, dtype=torch.uint8)
    codes[:, 8:16] = mag | ((mag | 8) << 4)  # block 1: +-value(mag)
    scales[:, 1] = 140  # the largest scale of chunk 0
    codes[3, 8:16] = 0x80  # row 3: block 1 is +0 / -0 only: not a nonzero block
    fp8, scale = weight_fp8_chunks(codes, scales, None, k, n)
    lay = encode_fp8_chunks(codes, scales, None, k)
    assert_same_bits("fp8", fp8, lay.fp8)
    assert_same_bits("scale", scale, lay.scale)
    assert int(lay.ref[0, 0]) == 134 and int(lay.ref[3, 0]) == 114


def test_weight_fp8_checks_its_arguments():
    q = _weight("mxfp4-mbs-s", 8, 128, seed=1)
    with pytest.raises(ValueError, match="rows=4 < the weight's 8 rows"):
        weight_fp8_chunks(q.codes, q.scales, q.mbs, 128, 4)
    with pytest.raises(ValueError, match="mbs has 4 rows"):
        weight_fp8_chunks(q.codes, q.scales, q.mbs[:4], 128, 8)


def test_scratch_bytes():
    """1 byte per (padded) weight plus a 4-byte scale per 128: Llama-3-8B's largest layer."""
    assert scratch_bytes(28672, 4096) == 28672 * 4096 + 4 * 28672 * 32
