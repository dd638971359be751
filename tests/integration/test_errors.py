"""Errors a vLLM user meets say what to do (imports vLLM, starts no engine)."""

from __future__ import annotations

import re

import pytest
import torch

from vllm_mxplus.checkpoint.layout import make_quantization_config

pytest.importorskip("vllm", reason="vLLM not installed")


@pytest.fixture(scope="module")
def configs():
    from vllm_mxplus.integration.config import CONFIG_CLASSES

    return CONFIG_CLASSES


@pytest.mark.parametrize(
    "k,unit,sizes",
    [
        (4096, 128, [1, 2, 4, 8, 16, 32]),
        (1536, 128, [1, 2, 3, 4, 6, 12]),
        (576, 128, [1]),
        (576, 32, [1, 2, 3, 6, 9, 18]),
        (128, 128, [1]),
    ],
    ids=["K4096-macro", "K1536-macro", "K576-macro", "K576-mx32", "K128-macro"],
)
def test_working_tp_sizes(k: int, unit: int, sizes: list[int]) -> None:
    from vllm_mxplus.integration.params import working_tp_sizes

    got = working_tp_sizes(k, unit)
    assert got == sizes
    for tp in range(1, 65):  # the definition, checked directly
        works = tp == 1 or (k % tp == 0 and (k // tp) % unit == 0)
        assert (tp in got) is works


def test_row_parallel_error_lists_working_sizes(configs) -> None:
    from vllm_mxplus.integration.linear import MxplusLinearMethod

    method = MxplusLinearMethod(configs["mxfp4-mbs"]())
    layer = torch.nn.Module()
    layer.prefix = "model.layers.0.mlp.down_proj"
    # K = 1536 split 8 ways: 192 per rank, not a whole number of macro blocks
    with pytest.raises(ValueError) as e:
        method.create_weights(layer, 192, [64], 1536, 64, torch.bfloat16)
    msg = str(e.value)
    assert "model.layers.0.mlp.down_proj" in msg and "not a multiple of 128" in msg
    assert "tensor_parallel_size values that work: 1, 2, 3, 4, 6, 12." in msg
    assert not re.search(r"\d\.\d", msg), "no fractional K/128 in the message"


def test_row_parallel_error_when_only_tp1_works(configs) -> None:
    from vllm_mxplus.integration.linear import MxplusLinearMethod

    method = MxplusLinearMethod(configs["mxfp4-mbs"]())
    with pytest.raises(ValueError, match="use tensor_parallel_size=1"):
        method.create_weights(torch.nn.Module(), 288, [64], 576, 64, torch.bfloat16)


def test_wrong_loader_for_prequantized_checkpoint_says_drop_quantization(configs) -> None:
    cfg = make_quantization_config("mxfp4-mbs", [])
    with pytest.raises(ValueError) as e:
        configs["nvfp4"].from_config(cfg)
    msg = str(e.value)
    assert "'nvfp4' loader was selected" in msg
    assert "drop --quantization" in msg and "--quantization mxfp4-mbs" in msg


def test_foreign_quantization_config_says_what_to_do(configs) -> None:
    with pytest.raises(ValueError, match="not a vllm-mxplus checkpoint: serve it without"):
        configs["nvfp4"].from_config({"quant_method": "fp8"})
