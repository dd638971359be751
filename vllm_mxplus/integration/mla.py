"""Linears whose weight a vLLM attention layer reads directly: MLA's `kv_b_proj`.

DeepSeek-V2/V3-style Multi-head Latent Attention (vLLM `MLAAttention`) asks for kv_b_proj's
weight after loading (`get_and_maybe_dequant_weights`) and absorbs it into the attention
computation (W_UK into the query, W_UV into the output) for decode; prefill calls the layer
on the compressed KV. The activation feeding the absorbed weight never exists as a tensor
that could be quantized, so the rule is (docs/numerics.md, Formats and schemes):

  kv_b_proj's weight is quantized like any other weight of the scheme (same format, same
  checkpoint tensors); its input is NOT quantized, on every path: the layer keeps the
  dequantized fp32 weight W_hat and computes x @ W_hat^T in fp32 (weight-only), and what
  attention absorbs is that same W_hat.

So prefill and decode compute with the same numbers, and a transformers reference that keeps
kv_b_proj weight-only (tests/integration/hf_reference.py) matches them.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from vllm_mxplus.formats import QuantizedTensor

# Last name component of the linears read directly by attention.
WEIGHT_READ_BY_ATTENTION = ("kv_b_proj",)
WEIGHT_ONLY_ATTR = "mxplus_weight_only"


def weight_read_by_attention(layer: torch.nn.Module) -> bool:
    """Whether vLLM's attention reads this linear's weight directly (by its prefix)."""
    prefix = getattr(layer, "prefix", "") or ""
    return prefix.rsplit(".", 1)[-1] in WEIGHT_READ_BY_ATTENTION


def install_dequantized_weight(layer: torch.nn.Module, qweight: QuantizedTensor) -> None:
    """Replace the layer's checkpoint tensors by `weight` = W_hat (fp32 [N, K]), which
    `get_and_maybe_dequant_weights` finds, and mark the layer weight-only."""
    w_hat = qweight.dequantize(torch.float32)
    for name in list(layer._parameters):
        if name == "weight" or name.startswith("weight_"):
            delattr(layer, name)
    layer.register_parameter("weight", torch.nn.Parameter(w_hat, requires_grad=False))
    setattr(layer, WEIGHT_ONLY_ATTR, True)


def is_weight_only(layer: torch.nn.Module) -> bool:
    return getattr(layer, WEIGHT_ONLY_ATTR, False)


def apply_weight_only(
    layer: torch.nn.Module, x: torch.Tensor, bias: torch.Tensor | None
) -> torch.Tensor:
    """x @ W_hat^T (+ bias) in fp32, cast to x's dtype: the input is not quantized."""
    b = None if bias is None else bias.to(torch.float32)
    return F.linear(x.to(torch.float32), layer.weight, b).to(x.dtype)
