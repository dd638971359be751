"""The one check of a CPU kernel's GEMM output against its float64 product and stated bound
(docs/numerics.md, "Kernel numerics and error bounds"): NaN where the product is NaN, not
finite where it overflows fp32, within `bound` everywhere else that `scale` is finite. Returns the mask of the outputs held
to the bound."""

from __future__ import annotations

import torch


def check_bound(
    y: torch.Tensor, y_ref: torch.Tensor, scale: torch.Tensor, bound: torch.Tensor
) -> torch.Tensor:
    yd = y.double()
    nan_ref = torch.isnan(y_ref)
    over = ~nan_ref & (y_ref.abs() > torch.finfo(torch.float32).max)
    assert torch.isnan(yd[nan_ref]).all(), "an output is not NaN where the product is NaN"
    # +-Inf in the spec (a dequantized value or the sum overflows fp32): +-Inf or NaN here
    assert not torch.isfinite(yd[over]).any(), "an overflowing output is finite"
    check = ~nan_ref & ~over & (scale <= torch.finfo(torch.float32).max)
    err = (yd - y_ref).abs()
    bad = check & ~(err <= bound)
    assert not bad.any(), (
        f"{int(bad.sum())} outputs out of bound, first at {bad.nonzero()[0].tolist()}: "
        f"err {err[bad].max():.3g}, bound {bound[bad].min():.3g}"
    )
    return check
