"""Registration and config parsing (imports vLLM, starts no engine)."""

from __future__ import annotations

import pytest

from vllm_mxplus.checkpoint.layout import make_quantization_config
from vllm_mxplus.formats import SCHEMES


@pytest.fixture(scope="module")
def registered():
    import vllm_mxplus

    vllm_mxplus.register()
    vllm_mxplus.register()  # idempotent
    from vllm_mxplus.integration.config import CONFIG_CLASSES

    return CONFIG_CLASSES


@pytest.mark.parametrize("scheme", list(SCHEMES))
def test_get_quantization_config_returns_our_class(registered, scheme):
    from vllm.model_executor.layers.quantization import (
        QUANTIZATION_METHODS,
        get_quantization_config,
    )

    cls = get_quantization_config(scheme)
    assert cls is registered[scheme]
    assert cls.get_name() == scheme
    assert QUANTIZATION_METHODS.count(scheme) == 1
    online = cls()  # what vLLM builds for `--quantization NAME` on a bf16 checkpoint
    assert not online.is_checkpoint_quantized
    assert online.scheme.name == scheme


def test_register_all_is_idempotent(registered):
    from vllm_mxplus.integration.registration import register_all

    assert register_all() == list(SCHEMES)


def test_unknown_scheme_name(registered):
    from vllm.model_executor.layers.quantization import get_quantization_config

    with pytest.raises(ValueError, match="mxfp4-bogus"):
        get_quantization_config("mxfp4-bogus")
    from vllm_mxplus.integration.config import MxplusConfig

    with pytest.raises(TypeError):
        MxplusConfig()  # only the per-scheme subclasses are usable


@pytest.mark.parametrize("scheme", list(SCHEMES))
def test_from_config_reads_checkpoint_block(registered, scheme):
    cfg = make_quantization_config(scheme, ["lm_head", "model.layers.1.mlp.down_proj"])
    qc = registered[scheme].from_config(cfg)
    assert qc.is_checkpoint_quantized
    assert "model.layers.1.mlp.down_proj" in qc.modules_to_not_convert


def test_from_config_rejects_mismatches(registered):
    cfg = make_quantization_config("mxfp4-mbs", [])
    with pytest.raises(ValueError, match="quant_method"):
        registered["nvfp4"].from_config(cfg)
    bad = dict(cfg, weight_format="mxfp4-mbs-s")
    with pytest.raises(ValueError, match="weight_format"):
        registered["mxfp4-mbs"].from_config(bad)
    with pytest.raises(ValueError, match="format_version"):
        registered["mxfp4-mbs"].from_config(dict(cfg, format_version=99))


def test_unquantized_modules_honored(registered):
    qc = registered["mxfp4-mbs"].from_config(
        make_quantization_config("mxfp4-mbs", ["model.layers.1.mlp.down_proj", "o_proj"])
    )
    qc.packed_modules_mapping = {
        "qkv_proj": ["q_proj", "k_proj", "v_proj"],
        "gate_up_proj": ["gate_proj", "up_proj"],
    }
    assert qc.is_skipped("lm_head")
    assert qc.is_skipped("model.layers.1.mlp.down_proj")
    assert not qc.is_skipped("model.layers.0.mlp.down_proj")
    assert qc.is_skipped("model.layers.0.self_attn.o_proj")
    assert not qc.is_skipped("model.layers.0.self_attn.qkv_proj")
    assert not qc.is_skipped("model.layers.0.mlp.gate_up_proj")


class _StubLayer:
    prefix = "model.layers.0.mlp.down_proj"


def test_row_parallel_partition_without_whole_macro_blocks_fails_clearly(registered):
    """K = 576 split over 2 ranks leaves 288 = 2.25 macro blocks per rank: refused at load."""
    from vllm_mxplus.integration.linear import MxplusLinearMethod

    method = MxplusLinearMethod(registered["mxfp4-mbs"]())
    with pytest.raises(ValueError, match=r"down_proj.*288.*multiple of 128"):
        method.create_weights(_StubLayer(), 288, [576], 576, 576, None, weight_loader=None)


def test_gpt_oss_architecture_resolves_to_the_plugin_subclass(registered):
    """vLLM builds gpt-oss from the plugin's subclass (integration/gpt_oss_model.py), which
    is vLLM's own class with one load_weights case added."""
    from vllm import ModelRegistry
    from vllm.model_executor.models.gpt_oss import GptOssForCausalLM

    from vllm_mxplus.integration.gpt_oss_model import MxplusGptOssForCausalLM

    cls = ModelRegistry._try_load_model_cls("GptOssForCausalLM")  # what resolve_model_cls loads
    assert cls is MxplusGptOssForCausalLM
    assert issubclass(cls, GptOssForCausalLM)
    # nothing but load_weights differs from vLLM's class
    own = {k for k, v in vars(cls).items() if callable(v) and not k.startswith("__")}
    assert own == {"load_weights"}


def test_gpt_oss_expert_stack_names(registered):
    """Which checkpoint names the subclass hands to the experts' loaders: the plugin's
    quantized stacks, not vLLM's own (bf16 stacks, biases, MXFP4 blocks)."""
    from vllm_mxplus.integration.gpt_oss_model import EXPERT_STACK

    ours = "model.layers.3.mlp.experts.gate_up_proj.weight_packed"
    m = EXPERT_STACK.match(ours)
    assert m is not None and (m["layer"], m["proj"], m["suffix"]) == (
        "model.layers.3.mlp.experts",
        "gate_up_proj",
        "weight_packed",
    )
    assert EXPERT_STACK.match("model.layers.3.mlp.experts.down_proj.weight_mbs")
    for theirs in (
        "model.layers.3.mlp.experts.gate_up_proj",
        "model.layers.3.mlp.experts.gate_up_proj_bias",
        "model.layers.3.mlp.experts.down_proj_blocks",
        "model.layers.3.self_attn.q_proj.weight_packed",
    ):
        assert EXPERT_STACK.match(theirs) is None, theirs
