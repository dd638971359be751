"""QuantizedTensor <-> the stored tensors, and the weight quantizer.

docs/numerics.md, Packing and checkpoint layout.

Stored per quantized weight of logical shape [..., N, K] (leading dims: stacked experts):
  weight_packed uint8 [..., N, ceil(K/2)], weight_scale uint8 (F8_E4M3 for nvfp4)
  [..., N, ceil(K/block)], weight_mbs uint8 [..., N, ceil(K/macro_block)] (128 unless
  `--macro-block`), weight_bm_index uint8
  [..., N, ceil(K/32)], weight_global_scale fp32 [1] (2-D) or [E, 1] (3-D: one per expert,
  since each expert is its own logical weight, docs/numerics.md, NVFP4).
K itself cannot be recovered from the packed shape when it is odd, so the writer also records
each weight's logical shape and dtype in the shard's __metadata__ (WEIGHTS_METADATA_KEY).
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from vllm_mxplus.checkpoint.layout import (
    SUFFIX_BM_INDEX,
    SUFFIX_GLOBAL,
    SUFFIX_MBS,
    SUFFIX_PACKED,
    SUFFIX_SCALE,
    quantized_from_stored,
    stored_tensors,
    weight_suffixes,
)
from vllm_mxplus.formats import QuantizedTensor, get_format, quantize

WEIGHTS_METADATA_KEY = "mxplus_weights"  # JSON {module: {"shape": [...], "dtype": "BF16"}}
CHUNK_ELEMS = 1 << 22  # rows per quantize() call ~ 4M elements: bounds the temporaries


def stored_layout(
    fmt: str, shape: tuple[int, ...], macro_block: int
) -> dict[str, tuple[str, tuple[int, ...]]]:
    """suffix -> (safetensors dtype, shape) of every stored tensor for a weight of `shape`."""
    return {t.suffix: (t.st_dtype, t.shape(tuple(shape))) for t in stored_tensors(fmt, macro_block)}


def encode(q: QuantizedTensor) -> dict[str, torch.Tensor]:
    """suffix -> CPU tensor to store, in layout.weight_suffixes order."""
    out = {SUFFIX_PACKED: q.codes, SUFFIX_SCALE: q.scales}
    if q.mbs is not None:
        out[SUFFIX_MBS] = q.mbs
    if q.global_scale is not None:
        # In memory [] (2-D) or [E, 1, 1] (3-D); stored [1] or [E, 1].
        out[SUFFIX_GLOBAL] = q.global_scale.reshape(*q.shape[:-2], 1)
    if q.block_max_index is not None:
        out[SUFFIX_BM_INDEX] = q.block_max_index
    return {s: out[s].to("cpu").contiguous() for s in weight_suffixes(q.fmt)}


def decode(
    stored: dict[str, torch.Tensor], fmt: str, shape: tuple[int, ...], macro_block: int
) -> QuantizedTensor:
    """The QuantizedTensor for stored tensors already checked against stored_layout."""
    g = stored.get(SUFFIX_GLOBAL)
    if g is not None:
        # [] for one weight; [E, 1, 1] so that it broadcasts over each expert's blocks.
        g = g.reshape(()) if len(shape) == 2 else g.reshape(*shape[:-2], 1, 1)
    return quantized_from_stored(stored, get_format(fmt), shape, macro_block, g)


def quantize_weight(
    w: torch.Tensor,
    fmt: str,
    device: torch.device | str = "cpu",
    on_progress: Callable[[float], None] | None = None,
    *,
    macro_block: int,
) -> tuple[QuantizedTensor, float, float]:
    """Quantize one (possibly expert-stacked) weight: (QuantizedTensor on CPU, ‖w‖², ‖w − ŵ‖²).

    Equals quantize(w, fmt) for 2-D weights and quantize(w[e], fmt) per expert for 3-D ones,
    bit for bit: rows are independent, so the work is split into row chunks to bound the
    temporaries (nvfp4 needs its per-weight global amax, so its unit is one whole weight).
    on_progress(fraction) is called after each chunk. The squared norms are fp64 sums.
    """
    spec = get_format(fmt)
    k = w.shape[-1]
    if spec.has_global_scale:
        units = [w] if w.dim() == 2 else list(w.unbind(0))
    else:
        rows = w.reshape(-1, k)
        units = list(rows.split(max(1, CHUNK_ELEMS // k)))
    parts: list[QuantizedTensor] = []
    sig = err = 0.0
    for i, unit in enumerate(units):
        x = unit.to(device)
        q = quantize(x, fmt, macro_block=macro_block)
        x32 = x.float()
        # Squares in fp32 (relative error 2^-24, far below what a dB figure shows), sums in fp64.
        sig += float(torch.sum(x32.square(), dtype=torch.float64))
        err += float(torch.sum((x32 - q.dequantize()).square_(), dtype=torch.float64))
        parts.append(_to_cpu(q))
        del x, x32
        if on_progress is not None:
            on_progress((i + 1) / len(units))
    return _merge(parts, fmt, tuple(w.shape), macro_block), sig, err


def _to_cpu(q: QuantizedTensor) -> QuantizedTensor:
    return q.to("cpu")


def _merge(
    parts: list[QuantizedTensor], fmt: str, shape: tuple[int, ...], macro_block: int
) -> QuantizedTensor:
    spec = get_format(fmt)
    lead = shape[:-1]

    def cat(field: str) -> torch.Tensor | None:
        ts = [getattr(p, field) for p in parts]
        if ts[0] is None:
            return None
        if spec.has_global_scale and len(shape) == 3:
            return torch.stack(ts)  # one whole weight per expert
        t = torch.cat([x.reshape(-1, x.shape[-1]) for x in ts]) if ts[0].dim() else ts[0]
        return t.reshape(*lead, t.shape[-1]) if t.dim() else t

    g = cat("global_scale")
    if g is not None and g.dim():
        g = g.reshape(*shape[:-2], 1, 1)  # [E] per-expert scalars -> broadcastable
    codes, scales = cat("codes"), cat("scales")
    assert codes is not None and scales is not None  # every format stores both
    return QuantizedTensor(
        codes=codes,
        scales=scales,
        spec=spec,
        shape=torch.Size(shape),
        mbs=cat("mbs"),
        global_scale=g,
        block_max_index=cat("block_max_index"),
        macro_block=macro_block,
    )
