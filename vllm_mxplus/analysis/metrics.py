"""Per-tensor fidelity metrics: QSNR (paper eq. 1, 2), flush-to-zero rate, OAS take-up."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from vllm_mxplus.formats import MACRO_BLOCK, fake_quantize, get_format, qsnr
from vllm_mxplus.formats.constants import SMALL_BLOCK
from vllm_mxplus.formats.e8m0 import e8m0_block_scale


def flush_to_zero_rate(x: torch.Tensor, x_hat: torch.Tensor) -> float:
    """Share of non-zero elements that quantize to zero (paper §3.2)."""
    nonzero = x != 0
    n = int(nonzero.sum())
    return float(((x_hat == 0) & nonzero).sum()) / n if n else 0.0


def oas_takeup(x: torch.Tensor, block: int = SMALL_BLOCK) -> float:
    """Share of non-zero blocks whose scale OAS changes versus masking 6/a (paper §4.2: ~15%)."""
    k = x.shape[-1]
    xp = F.pad(x.float().reshape(-1, k), (0, -k % block))
    a = xp.reshape(xp.shape[0], -1, block).abs().amax(-1)
    live = (a > 0) & torch.isfinite(a)
    n = int(live.sum())
    if n == 0:
        return 0.0
    changed = e8m0_block_scale(a, "oas") != e8m0_block_scale(a, "floor")
    return float((changed & live).sum()) / n


def format_label(fmt: str, macro_block: int) -> str:
    """A format name, tagged with its macro-block size when that is not the default."""
    if get_format(fmt).mbs and macro_block != MACRO_BLOCK:
        return f"{fmt}@{macro_block}"
    return fmt


def tensor_metrics(
    x: torch.Tensor, fmt: str, *, macro_block: int = MACRO_BLOCK, per_row: bool = False
) -> dict[str, float]:
    """QSNR (dB) and flush-to-zero rate of one tensor under one format."""
    x_hat = fake_quantize(x, fmt, macro_block=macro_block, per_row=per_row)
    xf = x.float()
    return {"qsnr": qsnr(xf, x_hat), "ftz": flush_to_zero_rate(xf, x_hat)}


def gemm_qsnr(
    x: torch.Tensor, w: torch.Tensor, fmt: str, *, macro_block: int = MACRO_BLOCK
) -> float:
    """Paper eq. 2: QSNR of Q(x) Q(w)^T against x w^T, both in float64 after quantization.

    Activations use one global scale per row for nvfp4, as at serving time.
    """
    ref = x.double() @ w.double().T
    xq = fake_quantize(x, fmt, macro_block=macro_block, per_row=True).double()
    wq = fake_quantize(w, fmt, macro_block=macro_block).double()
    return qsnr(ref, xq @ wq.T)
