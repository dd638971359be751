"""E2M1 rounding and packing against an independent nearest-value formula."""

import math

import pytest
import torch

from vllm_mxplus.formats.e2m1 import (
    E2M1_VALUES,
    e2m1_decode,
    e2m1_encode,
    e2m1_magnitude_code,
    pack_fp4,
    unpack_fp4,
)


def reference_code(v: float) -> int:
    """Nearest E2M1 magnitude by distance in float64, ties to the even code, saturating."""
    mag = abs(v)
    if mag >= 6.0:  # saturate (also avoids float64 distance ties for huge values)
        return 7 | (8 if math.copysign(1.0, v) < 0 else 0)
    dists = [abs(mag - q) for q in E2M1_VALUES]
    best = min(dists)
    ties = [i for i, d in enumerate(dists) if d == best]
    code = ties[0] if len(ties) == 1 else next(i for i in ties if i % 2 == 0)
    return code | (8 if math.copysign(1.0, v) < 0 else 0)


def test_all_bf16_bit_patterns():
    bits = torch.arange(65536, dtype=torch.int32).to(torch.int16)
    x = bits.view(torch.bfloat16).float()
    finite = torch.isfinite(x)
    codes = e2m1_encode(x, x.view(torch.int32) < 0)
    expected = torch.tensor([reference_code(v) for v in x[finite].tolist()], dtype=torch.uint8)
    assert finite.sum() == 65536 - 256  # 254 NaN patterns and +-Inf
    mismatch = (codes[finite] != expected).nonzero()
    assert mismatch.numel() == 0, f"first mismatch at {x[finite][mismatch[0]].item()}"


@pytest.mark.parametrize(
    "v,code",
    [
        (0.25, 0),
        (0.2500001, 1),
        (0.75, 2),
        (1.25, 2),
        (1.75, 4),
        (2.5, 4),
        (3.5, 6),
        (5.0, 6),
        (5.0001, 7),
        (6.0, 7),
        (1e30, 7),
        (float("inf"), 7),
    ],
    ids=lambda p: str(p),
)
def test_ties_to_even_and_saturation(v, code):
    assert e2m1_magnitude_code(torch.tensor([v])).item() == code


def test_nan_magnitude_is_code_zero():
    assert e2m1_magnitude_code(torch.tensor([float("nan")])).item() == 0


def test_decode_table_and_negative_zero():
    vals = e2m1_decode(torch.arange(16, dtype=torch.uint8))
    assert vals[:8].tolist() == list(E2M1_VALUES)
    assert vals[8:].tolist() == [-v for v in E2M1_VALUES]
    assert math.copysign(1.0, vals[8].item()) < 0


@pytest.mark.parametrize("k", [1, 2, 17, 100, 576], ids=lambda k: f"K{k}")
def test_pack_unpack_round_trip(k):
    codes = torch.randint(0, 16, (3, k), dtype=torch.uint8)
    packed = pack_fp4(codes)
    assert packed.shape == (3, (k + 1) // 2)
    assert torch.equal(packed[:, 0] & 0xF, codes[:, 0])  # element 0 in the low nibble
    if k > 1:
        assert torch.equal(packed[:, 0] >> 4, codes[:, 1])
    assert torch.equal(unpack_fp4(packed, k), codes)
