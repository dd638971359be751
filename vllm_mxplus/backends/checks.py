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


FP32_BITS = 24  # the fp32 accumulator across a chunked kernel's chunks


def gamma(n: int, accumulator_bits: int) -> float:
    """γ_n = n·u / (1 − n·u), u = 2^−bits: the relative bound of n roundings. n·u ≥ 1 makes
    it meaningless (negative or infinite), so that is an error, never a bound."""
    nu = n * 2.0**-accumulator_bits
    if nu >= 1.0:
        raise ValueError(
            f"error bound: {n} additions at {accumulator_bits} accumulator bits give n·u = "
            f"{nu:.3g} >= 1, no bound; a kernel that accumulates in fewer bits than fp32 must "
            "say over how many K it does (accumulation_chunk)"
        )
    return nu / (1.0 - nu)


def accumulation_gamma(k: int, accumulator_bits: int = 24, chunk: int | None = None) -> float:
    """The relative bound γ on |ŷ − y| / S of a K-long dot product (module docstring). One
    accumulator over all K: γ_{K+8} at its bits. A chunked kernel (`chunk`: K elements summed
    in the narrow accumulator from zero, then scaled and added into fp32): γ_in + γ_out·(1 +
    γ_in), γ_in = γ_{chunk+8} at its bits inside a chunk, γ_out = γ_{chunks+8} at fp32 across
    the chunks (each chunk's sum is off by at most γ_in times its own S and is at most
    (1 + γ_in) times that S in magnitude; docs/numerics.md)."""
    if chunk is None or chunk >= k or accumulator_bits >= FP32_BITS:
        return gamma(k + EXTRA_ROUNDINGS, accumulator_bits)
    g_in = gamma(chunk + EXTRA_ROUNDINGS, accumulator_bits)
    g_out = gamma(-(-k // chunk) + EXTRA_ROUNDINGS, FP32_BITS)
    return g_in + g_out * (1.0 + g_in)


def output_bound(
    a: torch.Tensor,
    y64: torch.Tensor,
    bias64: torch.Tensor,
    k: int,
    out_dtype: torch.dtype,
    accumulator_bits: int = 24,
    chunk: int | None = None,
) -> torch.Tensor:
    """The per-element bound on |y - y64| of the module docstring (float64); `chunk`: see
    `accumulation_gamma`."""
    u = 2.0**-accumulator_bits
    fi = torch.finfo(out_dtype)
    u_out = fi.eps / 2
    g = accumulation_gamma(k, accumulator_bits, chunk)
    r = y64.abs() + bias64.abs() + g * a
    return g * a + 2 * (u + u_out) * (1 + u_out) * r + fi.smallest_normal * fi.eps
