"""The checkpoint layout: tensor names and `quantization_config`.

docs/numerics.md, Packing and checkpoint layout. Per quantized linear NAME (its HF weight is
NAME.weight [N, K]):
  NAME.weight_packed        uint8 [N, ceil(K/2)]   two E2M1 codes per byte
  NAME.weight_scale         uint8 [N, ceil(K/bs)]  E8M0 (float8_e4m3fn for nvfp4)
  NAME.weight_mbs           uint8 [N, ceil(K/mb)]  MBS formats only (mb = macro_block_size)
  NAME.weight_global_scale  float32 [1]            nvfp4 only
  NAME.weight_bm_index      uint8 [N, ceil(K/32)]  mxplus only (255 = no block max)
`stored_tensors(fmt, macro_block)` is that table in code: the writer (`codec.stored_layout`), the reader
and the vLLM parameters (`integration/params.py`) all derive from it. A bias stays NAME.bias
in its original dtype. MoE experts stacked as 3-D [E, N, K] keep the leading expert dim on
every tensor (nvfp4 global scales then [E, 1]).

Each safetensors shard's `__metadata__` carries `mxplus_weights`: JSON {module: {"shape",
"dtype"}} of the original weights, because the packed shape cannot tell K = 75 from K = 76.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, TypeGuard

import torch

from vllm_mxplus.formats import (
    MACRO_BLOCK,
    FormatSpec,
    QuantizedTensor,
    check_macro_block,
    get_format,
    get_scheme,
)
from vllm_mxplus.formats.constants import MX_BLOCK, ceil_div
from vllm_mxplus.quant_rules import ALWAYS_UNQUANTIZED  # noqa: F401  (re-exported)
from vllm_mxplus.version import __version__

FORMAT_VERSION = 1
SUFFIX_PACKED = "weight_packed"
SUFFIX_SCALE = "weight_scale"
SUFFIX_MBS = "weight_mbs"
SUFFIX_GLOBAL = "weight_global_scale"
SUFFIX_BM_INDEX = "weight_bm_index"
ALL_SUFFIXES = (SUFFIX_PACKED, SUFFIX_SCALE, SUFFIX_MBS, SUFFIX_GLOBAL, SUFFIX_BM_INDEX)


@dataclass(frozen=True)
class StoredTensor:
    """One stored tensor of a quantized weight [..., N, K].

    k_per_col: K elements one column covers, so the tensor is [..., N, ceil(K / k_per_col)];
    0 for the per-weight nvfp4 global scale, stored [1] (or [E, 1] for E stacked experts).
    """

    suffix: str
    st_dtype: str  # safetensors dtype name
    dtype: torch.dtype
    k_per_col: int

    def cols(self, k: int) -> int:
        return ceil_div(k, self.k_per_col)

    def shape(self, weight_shape: tuple[int, ...]) -> tuple[int, ...]:
        """The stored shape for a weight of logical shape [..., N, K]."""
        *lead, k = weight_shape
        if self.k_per_col == 0:
            return tuple(weight_shape[:-2]) + (1,)
        return tuple(lead) + (self.cols(k),)


def stored_tensors(fmt: str, macro_block: int) -> list[StoredTensor]:
    """The stored tensors of one quantized weight of format fmt, in layout order."""
    spec = get_format(fmt)
    out = [StoredTensor(SUFFIX_PACKED, "U8", torch.uint8, 2)]
    if spec.scale_is_e8m0:
        out.append(StoredTensor(SUFFIX_SCALE, "U8", torch.uint8, spec.block_size))
    else:
        out.append(StoredTensor(SUFFIX_SCALE, "F8_E4M3", torch.float8_e4m3fn, spec.block_size))
    if spec.mbs:
        out.append(StoredTensor(SUFFIX_MBS, "U8", torch.uint8, macro_block))
    if spec.has_global_scale:
        out.append(StoredTensor(SUFFIX_GLOBAL, "F32", torch.float32, 0))
    if spec.block_max_mantissa:
        out.append(StoredTensor(SUFFIX_BM_INDEX, "U8", torch.uint8, MX_BLOCK))
    return out


def weight_suffixes(fmt: str) -> tuple[str, ...]:
    """The tensor suffixes stored for one quantized weight of format fmt."""
    return tuple(t.suffix for t in stored_tensors(fmt, MACRO_BLOCK))  # suffixes: any macro block


def quantized_from_stored(
    stored: Mapping[str, torch.Tensor],
    spec: FormatSpec,
    shape: Sequence[int],
    macro_block: int,
    global_scale: torch.Tensor | None = None,
    where: str = "weight",
) -> QuantizedTensor:
    """The QuantizedTensor of one weight's stored tensors (suffix -> tensor, the suffixes of
    `stored_tensors`), the one builder of the checkpoint reader and the vLLM loaders.

    The global scale (NVFP4) is given by the caller already shaped for its layout (one per
    tensor, per expert or per row); the other tensors are taken as they are. A stored tensor
    the format needs and `stored` lacks raises a ValueError naming `where` and the suffix."""
    needed = [t.suffix for t in stored_tensors(spec.name, macro_block) if t.suffix != SUFFIX_GLOBAL]
    missing = [s for s in needed if s not in stored]
    if spec.has_global_scale and global_scale is None:
        missing.append(SUFFIX_GLOBAL)
    if missing:
        raise ValueError(
            f"{where}: format {spec.name} needs the stored tensors "
            f"{', '.join(needed)}; missing {', '.join(missing)}"
        )
    return QuantizedTensor(
        codes=stored[SUFFIX_PACKED],
        scales=stored[SUFFIX_SCALE],
        spec=spec,
        shape=torch.Size(shape),
        mbs=stored.get(SUFFIX_MBS) if spec.mbs else None,
        global_scale=global_scale if spec.has_global_scale else None,
        block_max_index=stored.get(SUFFIX_BM_INDEX) if spec.block_max_mantissa else None,
        macro_block=macro_block,
    )


def make_quantization_config(
    scheme: str, unquantized_modules: list[str], macro_block: int = MACRO_BLOCK
) -> dict[str, Any]:
    """The `quantization_config` block written into config.json."""
    s = get_scheme(scheme)
    w = get_format(s.weight_format)
    a = get_format(s.activation_format)
    return {
        "quant_method": s.name,
        "format_version": FORMAT_VERSION,
        "weight_format": w.name,
        "activation_format": a.name,
        "weight_block_size": w.block_size,
        "activation_block_size": a.block_size,
        "macro_block_size": macro_block if (w.mbs or a.mbs) else None,
        "modules_to_not_convert": sorted(set(unquantized_modules)),
        # vLLM 0.32 reads quantization_config["producer"]["name"]: it must be a dict
        "producer": {"name": "vllm-mxplus", "version": __version__},
    }


def is_mxplus_quantization_config(qcfg: object) -> TypeGuard[dict[str, Any]]:
    """True for a quantization_config written by vllm-mxplus (producer {"name": ...})."""
    if not isinstance(qcfg, dict):
        return False
    producer = qcfg.get("producer")
    return isinstance(producer, dict) and producer.get("name") == "vllm-mxplus"


def checkpoint_macro_block(cfg: dict[str, Any]) -> int:
    """The macro block of a checked quantization_config (MACRO_BLOCK when it has none)."""
    return cfg.get("macro_block_size") or MACRO_BLOCK


def check_quantization_config(cfg: dict[str, Any], where: str = "config.json") -> None:
    """Raise ValueError naming the field at fault when a quantization_config is not ours."""
    version = cfg.get("format_version")
    if version != FORMAT_VERSION:
        raise ValueError(
            f"{where}: quantization_config.format_version {version!r} is not supported "
            f"(this vllm-mxplus reads version {FORMAT_VERSION})"
        )
    method: Any = cfg.get("quant_method")
    s = get_scheme(method)
    for key, expected in (
        ("weight_format", s.weight_format),
        ("activation_format", s.activation_format),
    ):
        if cfg.get(key) != expected:
            raise ValueError(
                f"{where}: quantization_config.{key} is {cfg.get(key)!r}, "
                f"scheme {s.name!r} expects {expected!r}"
            )
    if cfg.get("macro_block_size") is not None:
        check_macro_block(
            s.name, cfg["macro_block_size"], f"{where}: quantization_config.macro_block_size"
        )
