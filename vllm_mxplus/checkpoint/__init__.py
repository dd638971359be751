"""The vllm-mxplus checkpoint: its layout, and the offline quantizer and reader.

docs/numerics.md, Packing and checkpoint layout.

    quantize_checkpoint(src, dst, "mxfp4-mbs")  # HF dir -> quantized dir (mxplus quantize)
    quantize_checkpoint(src, dst, "nvfp4", out_format="compressed-tensors")  # ct_format.py
    # src may be FP4 already (compressed-tensors, gpt-oss mxfp4): quantized_source.py
    load(dst)               # {module: formats.QuantizedTensor}
    load_unquantized(dst)   # {tensor name: tensor} kept in high precision
    open_checkpoint(dst)    # validated layout, config, per-module shapes, no data read

A vLLM worker imports only `layout` (names, stored tensors, the QuantizedTensor builder) and
`rules`; the names above load their modules at first use, so importing this package pulls in
neither the quantizer nor calibration nor the assets.
"""

from __future__ import annotations

import importlib
from typing import Any

_PUBLIC = {
    "CheckpointError": "vllm_mxplus.checkpoint.errors",
    "QuantizeReport": "vllm_mxplus.checkpoint.report",
    "QuantizedCheckpoint": "vllm_mxplus.checkpoint.reader",
    "UsageError": "vllm_mxplus.errors",
    "load": "vllm_mxplus.checkpoint.reader",
    "load_unquantized": "vllm_mxplus.checkpoint.reader",
    "open_checkpoint": "vllm_mxplus.checkpoint.reader",
    "quantize_checkpoint": "vllm_mxplus.checkpoint.quantizer",
}


def __getattr__(name: str) -> Any:
    module = _PUBLIC.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(module), name)


__all__ = sorted(_PUBLIC)
