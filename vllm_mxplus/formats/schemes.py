"""Named number formats (per tensor) and quantization schemes (per layer)
(docs/numerics.md, Formats and schemes)."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Literal

import torch

from vllm_mxplus.formats.constants import MACRO_BLOCK

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

    @property
    def has_global_scale(self) -> bool:
        """NVFP4: E4M3 block scales under an fp32 global scale, one per row for activations
        and one per logical weight for weights (docs/numerics.md, NVFP4)."""
        return self.scale_rule == "e4m3"

    @property
    def scale_dtype(self) -> torch.dtype:
        """The dtype block scales are stored in: uint8 E8M0 codes, or float8_e4m3fn."""
        return torch.float8_e4m3fn if self.has_global_scale else torch.uint8

    def group_size(self, macro_block: int) -> int:
        """The unit K is padded to and a TP shard must hold whole: the macro block for an MBS
        format, else the block (docs/numerics.md, Macro Block Scaling)."""
        return macro_block if self.mbs else self.block_size


@dataclass(frozen=True)
class Scheme:
    """A per-layer scheme: the weight format, the activation format (paper §5 rows) and the
    macro block of its MBS formats. One frozen value, made once (from the vLLM config or a
    checkpoint) and passed whole: `get_scheme(name, macro_block=...)`."""

    name: str
    weight_format: str
    activation_format: str
    description: str
    macro_block: int = MACRO_BLOCK

    def __str__(self) -> str:
        if self.has_mbs and self.macro_block != MACRO_BLOCK:
            return f"{self.name} (macro block {self.macro_block})"
        return self.name

    @property
    def weight(self) -> FormatSpec:
        return get_format(self.weight_format)

    @property
    def activation(self) -> FormatSpec:
        return get_format(self.activation_format)

    @property
    def has_mbs(self) -> bool:
        """Whether either side uses Macro Block Scaling (the macro block matters)."""
        return bool(self.weight.mbs or self.activation.mbs)

    @property
    def group_size(self) -> int:
        """The K unit holding whole quantization groups of both operands (the macro block
        when either side uses MBS, else the larger block): K is padded to it, and a
        row-parallel TP shard must hold whole units so that sharding changes no number."""
        return max(
            self.weight.group_size(self.macro_block), self.activation.group_size(self.macro_block)
        )

    @property
    def activations_per_row(self) -> bool:
        """NVFP4 activations take one global scale per token (docs/numerics.md, NVFP4)."""
        return self.activation.has_global_scale

    def with_macro_block(self, macro_block: int, what: str = "macro_block") -> Scheme:
        """This scheme at another macro block, checked by `check_macro_block`."""
        check_macro_block(self, macro_block, what)
        return dataclasses.replace(self, macro_block=macro_block)


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


def as_format(fmt: str | FormatSpec) -> FormatSpec:
    """A FormatSpec as it is, or the format of a name (`get_format`)."""
    return fmt if isinstance(fmt, FormatSpec) else get_format(fmt)


def get_scheme(name: str | Scheme, macro_block: int | None = None) -> Scheme:
    """The scheme of a name (at its default macro block, MACRO_BLOCK), or at `macro_block`
    (checked); a Scheme is returned as it is. Unknown names raise a ValueError listing the
    valid ones."""
    if isinstance(name, Scheme):
        s = name
    else:
        try:
            s = SCHEMES[name]
        except (KeyError, TypeError):
            raise ValueError(
                f"unknown scheme {name!r}; valid schemes: {', '.join(SCHEMES)}"
            ) from None
    return (
        s
        if macro_block is None or macro_block == s.macro_block
        else s.with_macro_block(macro_block)
    )


def check_format_macro_block(fmt: FormatSpec, macro_block: int, what: str = "macro_block") -> None:
    """The macro block rule for one MBS format (docs/numerics.md, Macro Block Scaling): a
    positive multiple of the format's block size. ValueError naming `what` otherwise."""
    if macro_block <= 0 or macro_block % fmt.block_size:
        raise ValueError(
            f"{what} {macro_block}: a macro block must be a positive multiple of the block "
            f"size {fmt.block_size} (e.g. 32, 64, 128)"
        )


def check_macro_block(scheme: str | Scheme, macro_block: object, what: str = "macro_block") -> None:
    """The one validity rule for a macro block (docs/numerics.md, Macro Block Scaling): a
    positive integer multiple of the block size of the scheme's MBS formats; MACRO_BLOCK for a
    scheme without MBS (nothing to size). ValueError naming `what` otherwise. Each backend
    declares which of the valid values its kernels serve."""
    s = scheme if isinstance(scheme, Scheme) else get_scheme(scheme)
    mbs = [f for f in (s.weight, s.activation) if f.mbs]
    if isinstance(macro_block, bool) or not isinstance(macro_block, int):
        raise ValueError(f"{what} {macro_block!r}: not an integer")
    if not mbs:
        if macro_block != MACRO_BLOCK:
            raise ValueError(f"{what} {macro_block}: scheme {s.name} has no macro blocks")
        return
    check_format_macro_block(mbs[0], macro_block, what)
