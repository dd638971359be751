"""The --smooth ALPHA option of `mxplus quantize` and `mxplus qsnr` (smoothing.py does the
work): declared and checked in one place, without importing torch."""

from __future__ import annotations

import argparse

from vllm_mxplus.errors import UsageError


def add_smooth_option(parser: argparse.ArgumentParser, help: str) -> None:
    """--smooth ALPHA as `mxplus quantize` and `mxplus qsnr` take it (checked by check_alpha)."""
    parser.add_argument("--smooth", type=float, default=None, metavar="ALPHA", help=help)


def check_alpha(alpha: float) -> float:
    if not 0.0 < alpha < 1.0:
        raise UsageError(f"--smooth {alpha}: the migration strength must be in (0, 1), e.g. 0.5")
    return alpha
