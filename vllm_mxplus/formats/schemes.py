"""Named number formats (per tensor) and quantization schemes (per layer)
(docs/numerics.md, Formats and schemes)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from vllm_mxplus.formats.constants import MACRO_BLOCK  # noqa: F401  (re-exported)

ScaleRule = Literal["ocp", "floor", "oas", "e4m3"]
MbsMode = Literal["static", "dynamic"] | None


@dataclass(frozen=True)
class FormatSpec:
    """One 4-bit format: element E2M1, block size, block-scale rule, optional MBS."""

    name: str
    block_size: int
    scale_rule: ScaleRule
    mbs: MbsMode = None
    block_max_mantissa: bool = False  # MX+: the block max keeps 3 mantissa bits

    @property
    def scale_is_e8m0(self) -> bool:
        return self.scale_rule != "e4m3"


@dataclass(frozen=True)
class Scheme:
    """A per-layer scheme: the weight format and the activation format (paper §5 rows)."""

    name: str
    weight_format: str
    activation_format: str
    description: str


FORMATS: dict[str, FormatSpec] = {
    f.name: f
    for f in (
        FormatSpec("mxfp4-ocp", 32, "ocp"),
        FormatSpec("mxplus", 32, "ocp", block_max_mantissa=True),
        FormatSpec("mxfp4-16", 16, "floor"),
        FormatSpec("mxfp4-16-oas", 16, "oas"),
        FormatSpec("mxfp4-mbs-s", 16, "oas", mbs="static"),
        FormatSpec("mxfp4-mbs-d", 16, "oas", mbs="dynamic"),
        FormatSpec("nvfp4", 16, "e4m3"),
    )
}

SCHEMES: dict[str, Scheme] = {
    s.name: s
    for s in (
        Scheme("mxfp4-ocp", "mxfp4-ocp", "mxfp4-ocp", "OCP MXFP4, block 32 (baseline)"),
        Scheme("mxplus", "mxplus", "mxplus", "MX+ block-max mantissa, block 32 (baseline)"),
        Scheme("mxfp4-16-oas", "mxfp4-16-oas", "mxfp4-16-oas", "MXFP4 block 16 + OAS"),
        Scheme("mxfp4-mbs-s", "mxfp4-mbs-s", "mxfp4-mbs-s", "OAS + static MBS on both"),
        Scheme("mxfp4-mbs-h", "mxfp4-mbs-d", "mxfp4-mbs-s", "weights MBS-D, activations MBS-S"),
        Scheme("mxfp4-mbs", "mxfp4-mbs-d", "mxfp4-mbs-s", "alias of mxfp4-mbs-h (default)"),
        Scheme("nvfp4", "nvfp4", "nvfp4", "NVFP4, E4M3 block-16 scales + fp32 global (baseline)"),
    )
}


def get_format(name: str) -> FormatSpec:
    """Look a format up by name; unknown names raise a ValueError listing the valid ones."""
    try:
        return FORMATS[name]
    except (KeyError, TypeError):
        raise ValueError(f"unknown format {name!r}; valid formats: {', '.join(FORMATS)}") from None


def get_scheme(name: str) -> Scheme:
    """Look a scheme up by name; unknown names raise a ValueError listing the valid ones."""
    try:
        return SCHEMES[name]
    except (KeyError, TypeError):
        raise ValueError(f"unknown scheme {name!r}; valid schemes: {', '.join(SCHEMES)}") from None
