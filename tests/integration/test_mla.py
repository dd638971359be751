"""MLA's kv_b_proj (integration/mla.py): the weight vLLM's attention reads is the scheme's
dequantized weight, bit for bit, and the layer itself does not quantize its input.
(Fast: a bare module stands in for the vLLM layer; the engine runs in the model matrix.)"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from vllm_mxplus.formats import fake_quantize, get_scheme, quantize
from vllm_mxplus.integration.mla import (
    apply_weight_only,
    install_dequantized_weight,
    is_weight_only,
    weight_read_by_attention,
)

K, N = 576, 256  # kv_lora_rank-like K with a partial macro block (576 = 4.5 x 128)


def _layer(prefix: str, scheme: str, seed: int = 0) -> tuple[torch.nn.Module, torch.Tensor]:
    torch.manual_seed(seed)
    layer = torch.nn.Module()
    layer.prefix = prefix
    layer.input_size_per_partition = K
    layer.register_parameter(
        "weight_packed",
        torch.nn.Parameter(torch.zeros(N, K // 2, dtype=torch.uint8), requires_grad=False),
    )
    w = torch.randn(N, K) * 0.05
    q = quantize(w, get_scheme(scheme).weight_format)
    install_dequantized_weight(layer, q)
    return layer, q.dequantize(torch.float32)


@pytest.mark.parametrize(
    "prefix,want",
    [
        ("model.layers.0.self_attn.kv_b_proj", True),
        ("kv_b_proj", True),
        ("model.layers.0.self_attn.q_proj", False),
        ("model.layers.0.self_attn.kv_a_proj_with_mqa", False),
        ("", False),
    ],
    ids=["mla", "bare", "q_proj", "kv_a", "empty"],
)
def test_which_layers_attention_reads(prefix, want):
    layer = torch.nn.Module()
    layer.prefix = prefix
    assert weight_read_by_attention(layer) is want


@pytest.mark.parametrize("scheme", ["mxfp4-mbs", "nvfp4", "mxfp4-ocp"])
def test_weight_is_the_dequantized_weight(scheme):
    layer, w_hat = _layer("model.layers.0.self_attn.kv_b_proj", scheme)
    assert is_weight_only(layer)
    assert not hasattr(layer, "weight_packed")  # checkpoint tensors released
    assert layer.weight.dtype == torch.float32
    torch.testing.assert_close(layer.weight.data, w_hat, rtol=0, atol=0)


def test_input_is_not_quantized():
    layer, w_hat = _layer("kv_b_proj", "mxfp4-mbs")
    x = torch.randn(33, K, dtype=torch.bfloat16)
    y = apply_weight_only(layer, x, None)
    assert y.dtype == torch.bfloat16
    torch.testing.assert_close(y, F.linear(x.float(), w_hat).to(torch.bfloat16), rtol=0, atol=0)
    # a W4A4 linear would differ: the activation's 4-bit rounding is visible
    y_w4a4 = F.linear(fake_quantize(x.float(), "mxfp4-mbs-s"), w_hat).to(torch.bfloat16)
    assert not torch.equal(y, y_w4a4)


def test_vllm_reads_the_same_weight():
    """vLLM's own accessor (the generic path: apply() on an identity) returns W_hat exactly."""
    from vllm.model_executor.layers.quantization.utils.quant_utils import (
        get_and_maybe_dequant_weights,
    )

    from vllm_mxplus.integration.linear import MxplusLinearMethod

    layer, w_hat = _layer("model.layers.3.self_attn.kv_b_proj", "mxfp4-mbs", seed=1)
    layer.quant_method = MxplusLinearMethod.__new__(MxplusLinearMethod)  # apply() needs no config
    got = get_and_maybe_dequant_weights(layer, out_dtype=torch.float32)
    torch.testing.assert_close(got, w_hat, rtol=0, atol=0)
