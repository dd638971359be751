"""Bit-exact and error-bound comparisons of backend results with `vllm_mxplus.formats`,
shared by the self-tests (`selftest.py`, `selftest_experts.py`). docs/numerics.md, "Kernel
numerics and error bounds", derives the bound."""

from __future__ import annotations

import torch

EXTRA_ROUNDINGS = 8  # per product, beyond the fp32 accumulation (selftest.py's docstring)


def _bits(t: torch.Tensor) -> torch.Tensor:
    """The raw bits of t as integers (NaN payloads and -0 compared exactly)."""
    view = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[t.element_size()]
    return t.contiguous().view(view)


def first_bit_difference(
    name: str, got: torch.Tensor | None, want: torch.Tensor | None
) -> str | None:
    """None when got and want are bit-identical, else the first differing element."""
    if got is None or want is None:
        return (
            None
            if got is None and want is None
            else (
                f"{name}: got {'None' if got is None else tuple(got.shape)}, "
                f"want {'None' if want is None else tuple(want.shape)}"
            )
        )
    if got.shape != want.shape or got.dtype != want.dtype:
        return f"{name}: got {tuple(got.shape)} {got.dtype}, want {tuple(want.shape)} {want.dtype}"
    diff = _bits(got.cpu()) != _bits(want.cpu())
    if not bool(diff.any()):
        return None
    idx = tuple(int(i) for i in diff.nonzero()[0])
    return (
        f"{name}{list(idx)} = {got.cpu()[idx].item()!r}, want {want.cpu()[idx].item()!r} "
        f"(bit for bit; elements differing: {int(diff.sum())})"
    )


def first_outside_bound(
    got: torch.Tensor, want: torch.Tensor, bound: torch.Tensor, nan_ok: bool = False
) -> str | None:
    """None when |got - want| <= bound at every element of the 2-D outputs (with nan_ok, also
    where both are NaN), else the first element outside the bound: a NaN where a number is
    expected is outside."""
    bad = ~((got - want).abs() <= bound)
    if nan_ok:
        bad &= ~(got.isnan() & want.isnan())
    if not bool(bad.any()):
        return None
    r, c = (int(i) for i in bad.nonzero()[0])
    return (
        f"y[{r}, {c}] = {got[r, c].item()!r}, want {want[r, c].item()!r} "
        f"± {bound[r, c].item():.3g} ({int(bad.sum())} of {bad.numel()} elements "
        f"outside the bound)"
    )


def output_bound(
    a: torch.Tensor,
    y64: torch.Tensor,
    bias64: torch.Tensor,
    k: int,
    out_dtype: torch.dtype,
    accumulator_bits: int = 24,
) -> torch.Tensor:
    """The per-element bound on |y - y64| of the module docstring (float64)."""
    u = 2.0**-accumulator_bits
    fi = torch.finfo(out_dtype)
    u_out = fi.eps / 2
    n = k + EXTRA_ROUNDINGS
    gamma = n * u / (1 - n * u)
    r = y64.abs() + bias64.abs() + gamma * a
    return gamma * a + 2 * (u + u_out) * (1 + u_out) * r + fi.smallest_normal * fi.eps
