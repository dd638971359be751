"""One rule for what stays unquantized, and every path that quantizes follows it."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from vllm_mxplus.analysis.sources import is_linear_weight
from vllm_mxplus.backends.reference.modules import apply_fake_quant
from vllm_mxplus.checkpoint.rules import IgnoreMatcher, classify
from vllm_mxplus.quant_rules import stays_unquantized, unquantized_reason

# module name, kept in high precision?
MODULES = [
    ("model.layers.0.self_attn.q_proj", False),
    ("model.layers.0.mlp.gate_proj", False),
    ("model.layers.0.mlp.shared_expert.down_proj", False),
    ("transformer.h.0.attn.c_attn", False),
    ("lm_head", True),
    ("model.embed_tokens", True),
    ("transformer.wte", True),
    ("vision.patch_embed.proj", True),
    ("model.layers.0.mlp.gate", True),
    ("model.layers.0.block_sparse_moe.gate", True),
    ("model.layers.0.mlp.router", True),
    ("model.layers.0.mlp.shared_expert_gate", True),
]
IDS = [m for m, _ in MODULES]


@pytest.mark.parametrize("module,kept", MODULES, ids=IDS)
def test_predicate(module: str, kept: bool) -> None:
    assert stays_unquantized(module) is kept
    reason = unquantized_reason(module)
    assert (reason is not None) is kept
    if kept:
        assert reason in ("embedding / lm_head", "MoE router")


@pytest.mark.parametrize("module,kept", MODULES, ids=IDS)
def test_offline_quantizer_follows_it(module: str, kept: bool) -> None:
    d = classify(f"{module}.weight", "BF16", (32, 64), IgnoreMatcher())
    assert d.quantize is not kept


@pytest.mark.parametrize("module,kept", MODULES, ids=IDS)
def test_qsnr_tool_follows_it(module: str, kept: bool) -> None:
    assert is_linear_weight(f"{module}.weight", (32, 64)) is not kept


def test_fake_quant_reference_follows_it() -> None:
    model = nn.Module()
    for i, (module, _) in enumerate(MODULES):
        parent = model
        for part in module.split(".")[:-1]:
            if not hasattr(parent, part):
                parent.add_module(part, nn.Module())
            parent = getattr(parent, part)
        parent.add_module(module.rsplit(".", 1)[-1], nn.Linear(32, 16 + i))
    replaced = set(apply_fake_quant(model, "mxfp4-mbs"))
    assert replaced == {m for m, kept in MODULES if not kept}
    x = torch.randn(2, 32)
    assert model.get_submodule("lm_head")(x).shape == (2, 16 + IDS.index("lm_head"))


def test_vllm_config_follows_it() -> None:
    pytest.importorskip("vllm", reason="vLLM not installed")
    from vllm_mxplus.integration.config import CONFIG_CLASSES

    qc = CONFIG_CLASSES["mxfp4-mbs"]()
    qc.packed_modules_mapping = {}
    for module, kept in MODULES:
        assert qc.is_skipped(module) is kept, module
