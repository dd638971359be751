"""Linears whose weight a vLLM attention layer reads directly: MLA's `kv_b_proj`.

DeepSeek-V2/V3-style Multi-head Latent Attention (vLLM `MLAAttention`) asks for kv_b_proj's
weight after loading (`get_and_maybe_dequant_weights`) and absorbs it into the attention
computation (W_UK into the query, W_UV into the output) for decode; prefill calls the layer
on the compressed KV. The activation feeding the absorbed weight never exists as a tensor
that could be quantized, so the rule is (docs/numerics.md, Formats and schemes):

  kv_b_proj's weight is quantized like any other weight of the scheme (same format, same
  checkpoint tensors); its input is NOT quantized, on every path: the layer keeps the
  dequantized weight W_hat in the model's dtype and computes x @ W_hat^T in that dtype
  (weight-only), and what attention absorbs is that same W_hat.

So prefill and decode compute with the same numbers, and a transformers reference that keeps
kv_b_proj weight-only (tests/integration/hf_reference.py) matches them.

Why the model's dtype and not fp32: vLLM derives the dtype of MLA's k / v in the chunked-prefill
and prefix-cache path from this weight (`_get_kv_b_proj_input_dtype`); an fp32 W_hat made them
fp32 next to a bf16 q. It also halves the memory (DeepSeek-V3: 61 layers x 32768 x 512 =
1.02e9 elements, 3.8 GiB in fp32, 1.9 GiB in bf16, before TP). W_hat is rounded once from
its fp32 value (round to nearest even): exact for the E8M0 formats without MBS (an E2M1 value
times a power of two fits bf16), within 2^-8 relative in bf16 (2^-11 in fp16) for MBS and
NVFP4 weights, the rounding every unquantized bf16 weight of the model carries
(docs/numerics.md, "Kernel numerics and error bounds").
"""

from __future__ import annotations

import logging

import torch
import torch.nn.functional as F
from vllm.config import get_current_vllm_config

from vllm_mxplus.backends.base import Layer
from vllm_mxplus.formats import QuantizedTensor

# Last name component of the linears read directly by attention.
WEIGHT_READ_BY_ATTENTION = ("kv_b_proj",)
WEIGHT_ONLY_ATTR = "mxplus_weight_only"
# vLLM 0.32's CPU `rotary_embedding` op rotates a 3-D query [tokens, heads, rope_dim] as
# tokens x heads one-head rows at positions[t * heads + h], so MLA's multi-head q_pe is rotated
# at wrong positions on CPU, quantized or not (measured: tests/integration/test_mla_judged.py).
# vLLM's torch rotary is right; this custom_ops entry selects it.
CPU_ROPE_FIX = "-rotary_embedding"
CPU_ROPE_ADVICE = (
    "vLLM's CPU rotary_embedding op rotates MLA's multi-head query at wrong positions "
    "(with or without quantization); serve with --compilation-config "
    '\'{"custom_ops": ["all", "-rotary_embedding"]}\' to use vLLM\'s torch rotary instead'
)

logger = logging.getLogger(__name__)
_cpu_rope_warned = False


def warn_cpu_rotary(device_type: str, custom_ops: list[str] | None = None) -> bool:
    """Warn once when an MLA model is served on CPU with vLLM's CPU rotary op (custom_ops:
    the engine's compilation_config.custom_ops; None: read from vLLM's current config).
    Returns whether it warned."""
    global _cpu_rope_warned
    if device_type != "cpu" or _cpu_rope_warned:
        return False
    if custom_ops is None:
        custom_ops = list(get_current_vllm_config().compilation_config.custom_ops)
    if CPU_ROPE_FIX in custom_ops:
        return False
    _cpu_rope_warned = True
    logger.warning("MLA on CPU: %s", CPU_ROPE_ADVICE)
    return True


def weight_read_by_attention(layer: Layer) -> bool:
    """Whether vLLM's attention reads this linear's weight directly (by its prefix)."""
    prefix = getattr(layer, "prefix", "") or ""
    return prefix.rsplit(".", 1)[-1] in WEIGHT_READ_BY_ATTENTION


def model_dtype(layer: Layer) -> torch.dtype:
    """The dtype vLLM created the layer's parameters in (the model's), else torch's default
    (vLLM loads a model under its dtype as the default)."""
    dtype = getattr(layer, "params_dtype", None)
    return dtype if isinstance(dtype, torch.dtype) else torch.get_default_dtype()


def install_dequantized_weight(
    layer: Layer, qweight: QuantizedTensor, dtype: torch.dtype | None = None
) -> None:
    """Replace the layer's checkpoint tensors by `weight` = W_hat ([N, K] in `dtype`, default
    the model's: `model_dtype`), which `get_and_maybe_dequant_weights` finds, and mark the
    layer weight-only."""
    w_hat = qweight.dequantize(torch.float32).to(dtype or model_dtype(layer))
    for name in list(layer._parameters):
        if name == "weight" or name.startswith("weight_"):
            delattr(layer, name)
    layer.register_parameter("weight", torch.nn.Parameter(w_hat, requires_grad=False))
    setattr(layer, WEIGHT_ONLY_ATTR, True)


def is_weight_only(layer: Layer) -> bool:
    return getattr(layer, WEIGHT_ONLY_ATTR, False)


def apply_weight_only(layer: Layer, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """x @ W_hat^T (+ bias) in W_hat's dtype (the model's), cast to x's dtype: the input is
    not quantized."""
    w = layer.weight
    b = None if bias is None else bias.to(w.dtype)
    return F.linear(x.to(w.dtype), w, b).to(x.dtype)
