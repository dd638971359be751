"""Properties (hypothesis): idempotence, power-of-two covariance, sign symmetry."""

import numpy as np
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra.numpy import arrays

from vllm_mxplus.formats import fake_quantize

MX_NON_MBS = ["mxfp4-ocp", "mxplus", "mxfp4-16", "mxfp4-16-oas"]
NON_MBS = MX_NON_MBS + ["nvfp4"]
ALL = NON_MBS + ["mxfp4-mbs-s", "mxfp4-mbs-d"]

# bf16-representable values well inside the exponent range, so that scaling by 2^k stays
# away from the E8M0 / fp32 range ends
finite = st.floats(min_value=-1e6, max_value=1e6, allow_nan=False, width=32).filter(
    lambda v: v == 0 or abs(v) > 1e-6
)
tensors = (
    st.integers(1, 300)
    .flatmap(lambda k: arrays(np.float32, (2, k), elements=finite))
    .map(lambda a: torch.from_numpy(a).bfloat16().float())
)


# MX+ is not idempotent (see test_mxplus_is_not_idempotent), so it is left out here.
IDEMPOTENT = [f for f in NON_MBS if f != "mxplus"]


@settings(max_examples=40, deadline=None)
@given(x=tensors, fmt=st.sampled_from(IDEMPOTENT))
def test_idempotent(x, fmt):
    once = fake_quantize(x, fmt)
    assert torch.equal(fake_quantize(once, fmt), once)


def test_mxplus_is_not_idempotent():
    """MX+'s extended-precision element is the block max. Quantizing can make another element
    the new max, and a second pass then rounds the old one on the plain E2M1 grid. The
    counterexample hypothesis found: scale 2^17, both elements 5.03 on the grid. The first
    element (the max) keeps 5.0 with MX+'s extra mantissa bits; the second rounds to 6 and
    becomes the max, so in the second pass 5.0 is an ordinary tie and goes to 4 (even code)."""
    x = torch.tensor([[659456.0, 659456.0]])
    once = fake_quantize(x, "mxplus")
    assert once.tolist() == [[655360.0, 786432.0]]  # 5.0 * 2^17 (extended), 6 * 2^17
    assert fake_quantize(once, "mxplus").tolist() == [[524288.0, 786432.0]]  # 4 * 2^17


@settings(max_examples=40, deadline=None)
@given(x=tensors, fmt=st.sampled_from(ALL), k=st.integers(-20, 20))
def test_power_of_two_covariance(x, fmt, k):
    s = 2.0**k
    assert torch.equal(fake_quantize(x * s, fmt), fake_quantize(x, fmt) * s)


@settings(max_examples=40, deadline=None)
@given(x=tensors, fmt=st.sampled_from(ALL))
def test_sign_symmetry_and_preservation(x, fmt):
    out = fake_quantize(x, fmt)
    assert torch.equal(fake_quantize(-x, fmt), -out)
    assert bool(((out == 0) | (torch.sign(out) == torch.sign(x))).all())
