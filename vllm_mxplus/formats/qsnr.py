"""Quantization signal-to-noise ratio (paper eq. 1 and 2), sums in float64."""

from __future__ import annotations

import math

import torch


def qsnr(x: torch.Tensor, x_hat: torch.Tensor) -> float:
    """10 log10(||x||^2 / ||x - x_hat||^2) in dB; +inf when the error is zero.

    For a GEMM (eq. 2) pass the exact and the quantized products.
    """
    if x.shape != x_hat.shape:
        raise ValueError(f"qsnr: shapes differ: {tuple(x.shape)} vs {tuple(x_hat.shape)}")
    xd = x.detach().double()
    signal = float(xd.square().sum())
    noise = float((xd - x_hat.detach().double()).square().sum())
    if noise == 0.0:
        return math.inf
    if signal == 0.0:
        return -math.inf
    return 10.0 * math.log10(signal / noise)
