"""MLA's kv_b_proj keeps W_hat in the model's dtype (integration/mla.py): vLLM derives MLA's
k / v dtype from this weight, and fp32 doubled its memory. Rounded once from the fp32 W_hat."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from vllm_mxplus.formats import get_scheme, quantize
from vllm_mxplus.integration.mla import (
    apply_weight_only,
    install_dequantized_weight,
    model_dtype,
)

K, N = 576, 256


def _layer(scheme: str, params_dtype: torch.dtype | None):
    torch.manual_seed(0)
    layer = torch.nn.Module()
    layer.prefix = "model.layers.0.self_attn.kv_b_proj"
    if params_dtype is not None:
        layer.params_dtype = params_dtype
    q = quantize(torch.randn(N, K) * 0.05, get_scheme(scheme).weight_format)
    install_dequantized_weight(layer, q)
    return layer, q.dequantize(torch.float32)


@pytest.mark.parametrize("scheme", ["mxfp4-mbs", "nvfp4", "mxfp4-ocp", "mxfp4-16-oas"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
def test_weight_in_the_model_dtype(scheme, dtype):
    layer, w_hat = _layer(scheme, dtype)
    assert layer.weight.dtype == dtype
    assert torch.equal(layer.weight.data, w_hat.to(dtype))  # one RNE rounding of W_hat
    assert layer.weight.numel() * layer.weight.element_size() == N * K * 2  # half of fp32


@pytest.mark.parametrize("scheme", ["mxfp4-ocp", "mxfp4-16-oas"])
def test_e8m0_without_mbs_is_exact_in_bf16(scheme):
    layer, w_hat = _layer(scheme, torch.bfloat16)
    assert torch.equal(layer.weight.data.float(), w_hat)


def test_mbs_weight_rounds_within_bf16_half_ulp():
    layer, w_hat = _layer("mxfp4-mbs", torch.bfloat16)
    err = (layer.weight.data.float() - w_hat).abs()
    assert bool((err <= w_hat.abs() * 2.0**-8).all()) and bool((err > 0).any())


def test_default_dtype_when_the_layer_has_none():
    prev = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)
    try:
        layer = torch.nn.Module()
        assert model_dtype(layer) == torch.bfloat16
    finally:
        torch.set_default_dtype(prev)
    layer, _ = _layer("mxfp4-mbs", None)
    assert layer.weight.dtype == prev


def test_apply_runs_in_the_weight_dtype():
    layer, _ = _layer("mxfp4-mbs", torch.bfloat16)
    x = torch.randn(33, K, dtype=torch.bfloat16)
    b = torch.randn(N, dtype=torch.float32)
    y = apply_weight_only(layer, x, b)
    assert y.dtype == torch.bfloat16
    assert torch.equal(y, F.linear(x, layer.weight, b.to(torch.bfloat16)))
