"""E8M0 scale rules at their edges, special blocks and range ends.

docs/numerics.md, E8M0 block scales.
"""

import math

import pytest
import torch

from vllm_mxplus.formats import quantize
from vllm_mxplus.formats.e8m0 import e8m0_block_scale, e8m0_to_float

RULE_D = {"ocp": lambda f: 0, "floor": lambda f: int(f > 1.5), "oas": lambda f: int(f > 1.75)}


def reference_scale_code(a: float, rule: str) -> int:
    """Independent: frexp in float64 (exact for fp32 values, subnormals included)."""
    if a == 0:
        return 0
    if not math.isfinite(a):
        return 255
    mant, exp = math.frexp(a)  # a = mant * 2^exp, mant in [0.5, 1)
    f, e = mant * 2, exp - 1
    return min(max(e - 2 + RULE_D[rule](f) + 127, 0), 254)


def _f32(v: float) -> float:
    return torch.tensor(v, dtype=torch.float32).item()


def _neighbours(v: float) -> list[float]:
    t = torch.tensor(v, dtype=torch.float32)
    return [
        torch.nextafter(t, torch.tensor(-math.inf)).item(),
        v,
        torch.nextafter(t, torch.tensor(math.inf)).item(),
    ]


EDGE_SIGNIFICANDS = [1.0, 1.5, 1.75, 2.0]
EXPONENTS = [-130, -126, -100, -3, 0, 2, 5, 100, 126]


@pytest.mark.parametrize("rule", ["ocp", "floor", "oas"])
def test_scale_rules_at_significand_edges(rule):
    values = []
    for e in EXPONENTS:
        for f in EDGE_SIGNIFICANDS:
            base = _f32(f * 2.0**e)
            if base > 0 and math.isfinite(base):
                values += _neighbours(base)
    a = torch.tensor(values, dtype=torch.float32)
    got = e8m0_block_scale(a, rule).tolist()
    expected = [reference_scale_code(v, rule) for v in a.tolist()]
    assert got == expected


@pytest.mark.parametrize("rule,lo,hi", [("ocp", 4.0, 8.0), ("floor", 3.0, 6.0), ("oas", 3.5, 7.0)])
def test_scaled_absmax_lands_in_rule_range(rule, lo, hi):
    a = torch.rand(20000) * 1000 + 1e-3
    scaled = a / e8m0_to_float(e8m0_block_scale(a, rule))
    if rule == "ocp":
        assert bool(((scaled >= lo) & (scaled < hi)).all())
    else:
        assert bool(((scaled > lo) & (scaled <= hi)).all())


def test_oas_boundary_exactly_175():
    # significand exactly 1.75 stays in the lower scale (maps to 7), just above moves up
    a = torch.tensor([1.75 * 4, _neighbours(1.75 * 4)[2]], dtype=torch.float32)
    codes = e8m0_block_scale(a, "oas").tolist()
    assert codes == [127, 128]


def test_zero_nan_inf_blocks():
    x = torch.zeros(4, 16)
    x[1, 3] = float("nan")
    x[2, 0] = float("inf")
    x[3, 5] = -float("inf")
    q = quantize(x, "mxfp4-16-oas")
    assert q.scales.tolist() == [[0], [255], [255], [255]]
    assert torch.equal(q.codes[0], torch.zeros_like(q.codes[0]))
    out = q.dequantize()
    assert bool((out[0] == 0).all())
    assert bool(out[1:].isnan().all())


def test_subnormal_blocks_are_exact_scales():
    # fp32 subnormals: the scale comes from the true exponent, clamped to code 0 (2^-127)
    tiny = torch.tensor([1e-40, 1e-45, 3e-39, 1.2e-38], dtype=torch.float32)
    for rule in ("ocp", "floor", "oas"):
        got = e8m0_block_scale(tiny, rule).tolist()
        assert got == [reference_scale_code(v, rule) for v in tiny.tolist()]
    # at the bottom of the E8M0 range (code 0 = 2^-127) subnormal elements stay exact
    x = torch.tensor([[2.0**-126, 2.0**-128, 3 * 2.0**-128, 0.0] * 4])
    q = quantize(x, "mxfp4-16-oas")
    assert q.scales.item() == 0
    assert torch.equal(q.dequantize(), x)


def test_e8m0_range_ends():
    a = torch.tensor([2.0**-130, 2.0**-125, 3.0e38], dtype=torch.float32)
    assert e8m0_block_scale(a, "ocp").tolist() == [0, 0, 252]
    assert e8m0_block_scale(a, "oas").tolist() == [0, 0, 253]
    assert e8m0_to_float(torch.tensor([0, 127, 254, 255], dtype=torch.uint8)).tolist()[:3] == [
        2.0**-127,
        1.0,
        2.0**127,
    ]
    assert math.isnan(e8m0_to_float(torch.tensor([255], dtype=torch.uint8)).item())
