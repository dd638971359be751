"""The packed form of a stacked expert weight that both grouped expert GEMMs read
(`moe_gemm`: every format; `moe_decode`: E8M0 on the decode kernel)."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class PackedExpertWeights:
    """One stacked expert weight [E, N, K], all experts' rows as one packed matrix [E*N, .]:
    codes, scales (uint8; E4M3 bytes for nvfp4), extra (MBS bytes / MX+ block-max indices /
    None), global (fp32 per row, nvfp4) or None."""

    codes: torch.Tensor
    scales: torch.Tensor
    extra: torch.Tensor | None
    global_scale: torch.Tensor | None
    experts: int
    n: int  # rows per expert
    k: int
    small_scales: bool = False  # `decode_gemm.small_weight_scales` (E8M0), checked at load

    @property
    def operands(self) -> tuple:
        return (self.codes, self.scales, self.extra, self.global_scale)
