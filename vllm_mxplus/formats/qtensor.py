"""`quantize` / `fake_quantize` and the QuantizedTensor container for every named format."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from vllm_mxplus.formats.constants import NO_BLOCK_MAX, ceil_div
from vllm_mxplus.formats.e2m1 import pack_fp4, unpack_fp4
from vllm_mxplus.formats.mx import dequantize_e8m0_blocks, dequantize_mbs
from vllm_mxplus.formats.mxplus import dequantize_mxplus_blocks
from vllm_mxplus.formats.nvfp4 import (
    dequantize_nvfp4_blocks,
    global_from_amax,
    nvfp4_global_scale,
    quantize_nvfp4_given,
)
from vllm_mxplus.formats.params import GroupParams, choose_params, encode
from vllm_mxplus.formats.schemes import (
    MACRO_BLOCK,
    FormatSpec,
    as_format,
    check_format_macro_block,
    get_format,
)

SUPPORTED_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


@dataclass
class QuantizedTensor:
    """A tensor quantized along its last dim K.

    codes: uint8 [..., ceil(K/2)], two E2M1 codes per byte (element 2i in the low nibble).
    scales: uint8 E8M0 [..., ceil(K/block)], or float8_e4m3fn for nvfp4.
    mbs: uint8 [..., ceil(K/macro_block)] MBS bytes (MBS formats only).
    global_scale: fp32 (nvfp4 only): shape [] per tensor or [..., 1] per row.
    block_max_index: uint8 [..., ceil(K/32)] (mxplus only; 255 = no block max).
    """

    codes: torch.Tensor
    scales: torch.Tensor
    spec: FormatSpec
    shape: torch.Size
    mbs: torch.Tensor | None = None
    global_scale: torch.Tensor | None = None
    block_max_index: torch.Tensor | None = None
    macro_block: int = MACRO_BLOCK

    @property
    def fmt(self) -> str:
        """The format's name (for messages and the checkpoint layout)."""
        return self.spec.name

    def to(self, device: torch.device | str) -> QuantizedTensor:
        """The same quantized tensor with every field on `device`."""

        def move(t: torch.Tensor | None) -> torch.Tensor | None:
            return None if t is None else t.to(device)

        return dataclasses.replace(
            self,
            codes=self.codes.to(device),
            scales=self.scales.to(device),
            mbs=move(self.mbs),
            global_scale=move(self.global_scale),
            block_max_index=move(self.block_max_index),
        )

    def _field(self, name: str) -> torch.Tensor:
        """A field the format needs (global_scale, block_max_index, mbs); clear error if absent."""
        t = getattr(self, name)
        if t is None:
            raise ValueError(f"QuantizedTensor of format {self.fmt!r} has no {name}")
        return t

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """The dequantized tensor in fp32 (then cast to dtype), original shape."""
        spec = self.spec
        k = self.shape[-1]
        kp = _padded_k(spec, k, self.macro_block)
        codes = F.pad(unpack_fp4(self.codes, k), (0, kp - k))
        nb = kp // spec.block_size
        scales = _pad_last(self.scales, nb)
        if spec.scale_rule == "e4m3":
            g = self._field("global_scale")
            out = dequantize_nvfp4_blocks(codes, scales, g)
        elif spec.block_max_mantissa:
            bm = _pad_last(self._field("block_max_index"), nb, value=NO_BLOCK_MAX)
            out = dequantize_mxplus_blocks(codes, scales, bm)
        elif spec.mbs:
            m = _pad_last(self._field("mbs"), kp // self.macro_block)
            out = dequantize_mbs(codes, scales, m, spec.block_size)
        else:
            out = dequantize_e8m0_blocks(codes, scales, spec.block_size)
        return out[..., :k].to(dtype)


def _padded_k(spec: FormatSpec, k: int, macro_block: int) -> int:
    unit = spec.group_size(macro_block)
    return ceil_div(k, unit) * unit


def _pad_last(t: torch.Tensor, n: int, value: int = 0) -> torch.Tensor:
    if t.shape[-1] == n:
        return t
    pad = torch.full((*t.shape[:-1], n - t.shape[-1]), value, dtype=t.dtype, device=t.device)
    return torch.cat([t, pad], dim=-1)


def _check_input(x: torch.Tensor, macro_block: int, spec: FormatSpec) -> None:
    if not isinstance(x, torch.Tensor):
        raise ValueError(f"expected a torch.Tensor, got {type(x).__name__}")
    if x.dtype not in SUPPORTED_DTYPES:
        raise ValueError(
            f"unsupported dtype {x.dtype}: quantize takes float32, bfloat16 or float16"
        )
    if x.dim() == 0 or x.shape[-1] == 0:
        raise ValueError(f"cannot quantize a tensor of shape {tuple(x.shape)}: empty last dim")
    if spec.mbs:
        check_format_macro_block(spec, macro_block)


def quantize(
    x: torch.Tensor,
    fmt: str | FormatSpec,
    *,
    macro_block: int = MACRO_BLOCK,
    per_row: bool = False,
) -> QuantizedTensor:
    """Quantize x along its last dim with a named format (docs/numerics.md).

    x: bf16/fp16/fp32, any leading shape, any K >= 1 (partial blocks and macro blocks are
    shorter blocks; callers never pad). macro_block: MBS macro-block size (the paper's
    ablation, Appendix A). per_row: nvfp4 only, one global scale per row (activations).
    The group parameters and the encoding under them are `formats.params`' pair.
    """
    spec = as_format(fmt)
    _check_input(x, macro_block, spec)
    k = x.shape[-1]
    kp = _padded_k(spec, k, macro_block)
    xp = F.pad(x.to(torch.float32), (0, kp - k)).contiguous()
    g = nvfp4_global_scale(xp, per_row) if spec.has_global_scale else None
    p = choose_params(spec, xp, g, macro_block=macro_block)
    return to_quantized_tensor(spec, encode(spec, xp, p), p, tuple(x.shape))


def to_quantized_tensor(
    fmt: str | FormatSpec, codes: torch.Tensor, p: GroupParams, shape: tuple[int, ...]
) -> QuantizedTensor:
    """The QuantizedTensor of unpacked codes [..., Kp] and parameters for logical shape
    [..., K]."""
    spec = as_format(fmt)
    k = shape[-1]
    nb = ceil_div(k, spec.block_size)
    return QuantizedTensor(
        codes=pack_fp4(codes[..., :k].contiguous()),
        scales=p.scales[..., :nb].contiguous(),
        spec=spec,
        shape=torch.Size(shape),
        mbs=None if p.mbs is None else p.mbs[..., : ceil_div(k, p.macro_block)].contiguous(),
        global_scale=p.global_scale,
        block_max_index=None if p.bm_index is None else p.bm_index[..., :nb].contiguous(),
        macro_block=p.macro_block,
    )


def fake_quantize(
    x: torch.Tensor, fmt: str | FormatSpec, *, macro_block: int = MACRO_BLOCK, per_row: bool = False
) -> torch.Tensor:
    """quantize(x, fmt).dequantize(): fp32, same shape as x."""
    return quantize(x, fmt, macro_block=macro_block, per_row=per_row).dequantize()


def logical_amax(parts: torch.Tensor) -> torch.Tensor:
    """The NVFP4 weight amax of each logical weight: finite |w| max over the last two dims of
    parts [..., rows, K] (q, k, v of a fused qkv_proj, or gate / up of one expert, apart).
    Reduce it over TP ranks before `quantize_nvfp4_logical` when the weight is sharded."""
    a = torch.where(torch.isfinite(parts), parts.abs(), torch.zeros_like(parts))
    return a.amax(-1).amax(-1)


def quantize_nvfp4_logical(
    w: torch.Tensor, amax: torch.Tensor, widths: list[int]
) -> QuantizedTensor:
    """NVFP4 of a fused weight w [N, K] whose consecutive row groups of `widths` are separate
    logical weights, each with its global scale g = amax / (6 * 448) from its own (whole,
    unsharded) amax [len(widths)]; the scales are kept per row, g [N, 1] (docs/numerics.md,
    NVFP4)."""
    n, k = w.shape
    if sum(widths) != n or amax.numel() != len(widths):
        raise ValueError(
            f"quantize_nvfp4_logical: widths {widths} (sum {sum(widths)}) and amax of "
            f"{amax.numel()} values do not describe a weight of {n} rows"
        )
    g = global_from_amax(amax.reshape(-1))
    g_rows = torch.cat([g[i : i + 1].expand(width) for i, width in enumerate(widths)])[:, None]
    codes, scales = quantize_nvfp4_given(w, g_rows.contiguous())
    return QuantizedTensor(
        codes=pack_fp4(codes),
        scales=scales,
        spec=get_format("nvfp4"),
        shape=torch.Size((n, k)),
        global_scale=g_rows.contiguous(),
    )
