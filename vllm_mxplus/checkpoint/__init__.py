"""Offline quantizer and reader for the vllm-mxplus checkpoint layout.

docs/numerics.md, Packing and checkpoint layout.

    quantize_checkpoint(src, dst, "mxfp4-mbs")  # HF dir -> quantized dir (mxplus quantize)
    quantize_checkpoint(src, dst, "nvfp4", out_format="compressed-tensors")  # ct_format.py
    # src may be FP4 already (compressed-tensors, gpt-oss mxfp4): quantized_source.py
    load(dst)               # {module: formats.QuantizedTensor}
    load_unquantized(dst)   # {tensor name: tensor} kept in high precision
    open_checkpoint(dst)    # validated layout, config, per-module shapes, no data read
"""

from vllm_mxplus.checkpoint.errors import CheckpointError
from vllm_mxplus.checkpoint.quantizer import quantize_checkpoint
from vllm_mxplus.checkpoint.reader import (
    QuantizedCheckpoint,
    load,
    load_unquantized,
    open_checkpoint,
)
from vllm_mxplus.checkpoint.report import QuantizeReport
from vllm_mxplus.errors import UsageError

__all__ = [
    "CheckpointError",
    "QuantizeReport",
    "QuantizedCheckpoint",
    "UsageError",
    "load",
    "load_unquantized",
    "open_checkpoint",
    "quantize_checkpoint",
]
