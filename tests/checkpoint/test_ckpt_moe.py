"""MoE: 3-D stacked experts [E, N, K] and per-expert 2-D weights are quantized, routers kept."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from ckpt_helpers import complete_tensors, gpt_oss_config, make_custom
from test_ckpt_roundtrip import check_round_trip

from vllm_mxplus.checkpoint import load, load_unquantized, open_checkpoint, quantize_checkpoint
from vllm_mxplus.formats import get_scheme, quantize

E, H, I = 4, 64, 48  # experts, hidden, expert intermediate (K = 48: a partial macro block)  # noqa: E741


def moe_tensors() -> dict[str, torch.Tensor]:
    torch.manual_seed(3)
    bf = dict(dtype=torch.bfloat16)
    return {
        # transformers >= 5 fused experts (no .weight suffix), [E, N, K]
        "model.layers.0.mlp.experts.gate_up_proj": torch.randn(E, 2 * I, H, **bf),
        "model.layers.0.mlp.experts.down_proj": torch.randn(E, H, I, **bf) * 10,
        "model.layers.0.mlp.gate.weight": torch.randn(E, H, **bf),  # Qwen-MoE router
        "model.layers.0.mlp.shared_expert_gate.weight": torch.randn(1, H, **bf),
        # Mixtral per-expert 2-D and a 3-D `.weight` stack
        "model.layers.1.block_sparse_moe.gate.weight": torch.randn(E, H, **bf),
        "model.layers.1.block_sparse_moe.experts.0.w1.weight": torch.randn(I, H, **bf),
        "model.layers.1.block_sparse_moe.experts.1.w1.weight": torch.randn(I, H, **bf),
        "model.layers.1.stacked.weight": torch.randn(E, 16, 100, **bf),
        "model.layers.0.post_attention_layernorm.weight": torch.ones(H, **bf),
    }


@pytest.mark.parametrize("scheme", ["mxfp4-mbs", "nvfp4", "mxplus"])
def test_moe_round_trip(tmp_path: Path, scheme: str) -> None:
    # a layout test, not a model: Qwen-MoE and Mixtral names side by side under the custom
    # model_type (a known model_type is checked against its skeleton, source_check.py)
    src = make_custom(tmp_path / "src", moe_tensors())
    dst = tmp_path / "q"
    report = quantize_checkpoint(src, dst, scheme, progress=False)
    check_round_trip(src, dst, scheme)
    q = load(dst)
    assert set(q) == {
        "model.layers.0.mlp.experts.gate_up_proj",
        "model.layers.0.mlp.experts.down_proj",
        "model.layers.1.block_sparse_moe.experts.0.w1",
        "model.layers.1.block_sparse_moe.experts.1.w1",
        "model.layers.1.stacked",
    }
    assert (report.n_quantized, report.n_kept) == (5, 4)
    kept = load_unquantized(dst)
    assert {
        "model.layers.0.mlp.gate.weight",
        "model.layers.1.block_sparse_moe.gate.weight",
        "model.layers.0.mlp.shared_expert_gate.weight",
    } <= set(kept)
    cfg = json.loads((dst / "config.json").read_text())["quantization_config"]
    assert cfg["modules_to_not_convert"] == [
        "model.layers.0.mlp.gate",
        "model.layers.0.mlp.shared_expert_gate",
        "model.layers.1.block_sparse_moe.gate",
    ]
    ck = open_checkpoint(dst)
    stored = ck.modules["model.layers.0.mlp.experts.gate_up_proj"].tensors
    assert stored["weight_packed"].shape == (E, 2 * I, H // 2)
    if scheme == "nvfp4":  # one global scale per expert, each its own logical weight
        assert stored["weight_global_scale"].shape == (E, 1)
        assert ck.modules["model.layers.1.block_sparse_moe.experts.0.w1"].tensors[
            "weight_global_scale"
        ].shape == (1,)
    if scheme == "mxfp4-mbs":
        assert stored["weight_mbs"].shape == (E, 2 * I, 1)


def test_transposed_expert_stacks_are_quantized_per_expert(tmp_path: Path) -> None:
    """gpt-oss stores experts [E, K, N] (x @ W): each expert is quantized along K, i.e. its
    transpose, and stored [E, N, K] like every other quantized weight."""
    cfg = gpt_oss_config(hidden=32, intermediate=32, experts=2, heads=2)
    tensors = {
        "model.layers.0.mlp.experts.gate_up_proj": torch.randn(2, 32, 64),
        "model.layers.0.mlp.experts.down_proj": torch.randn(2, 32, 32),
        "model.layers.0.mlp.experts.gate_up_proj_bias": torch.randn(2, 64),
        "model.layers.0.self_attn.q_proj.weight": torch.randn(32, 32),
    }
    src = make_custom(tmp_path / "src", complete_tensors(cfg, tensors), cfg)
    for scheme in ("mxfp4-mbs-s", "nvfp4"):
        quantize_checkpoint(src, tmp_path / scheme, scheme, progress=False)
        got = load(tmp_path / scheme)
        assert set(got) == {
            *(f"model.layers.0.self_attn.{p}_proj" for p in "qkvo"),
            "model.layers.0.mlp.experts.gate_up_proj",
            "model.layers.0.mlp.experts.down_proj",
        }
        for name in ("gate_up_proj", "down_proj"):
            w = tensors[f"model.layers.0.mlp.experts.{name}"]
            q = got[f"model.layers.0.mlp.experts.{name}"]
            assert q.shape == (2, w.shape[2], w.shape[1])
            for e in range(2):  # expert e: the format of its [N, K] weight, as online
                want = quantize(w[e].T.contiguous(), get_scheme(scheme).weight_format)
                assert torch.equal(q.dequantize()[e], want.dequantize())
        bias = load_unquantized(tmp_path / scheme)["model.layers.0.mlp.experts.gate_up_proj_bias"]
        assert torch.equal(bias, tensors["model.layers.0.mlp.experts.gate_up_proj_bias"])


def test_transposed_expert_stacks_in_compressed_tensors_need_ignore(tmp_path: Path) -> None:
    """--format compressed-tensors stores 2-D weights only: a gpt-oss expert stack is refused
    by name with the way out (--ignore keeps it bf16, and the rest is written)."""
    from vllm_mxplus.errors import UsageError

    cfg = gpt_oss_config(hidden=32, intermediate=32, experts=2, heads=2)
    tensors = {
        "model.layers.0.mlp.experts.gate_up_proj": torch.randn(2, 32, 64),
        "model.layers.0.mlp.experts.down_proj": torch.randn(2, 32, 32),
        "model.layers.0.self_attn.q_proj.weight": torch.randn(32, 32),
    }
    src = make_custom(tmp_path / "src", complete_tensors(cfg, tensors), cfg)
    with pytest.raises(UsageError, match=r"experts\.(gate_up|down)_proj.*--ignore"):
        quantize_checkpoint(
            src, tmp_path / "ct", "mxfp4-ocp", progress=False, out_format="compressed-tensors"
        )
    assert not (tmp_path / "ct").exists()  # nothing half-written
    quantize_checkpoint(
        src,
        tmp_path / "ct",
        "mxfp4-ocp",
        progress=False,
        out_format="compressed-tensors",
        ignore=["re:.*experts.*"],
    )
    cfg = json.loads((tmp_path / "ct" / "config.json").read_text())
    assert cfg["quantization_config"]["quant_method"] == "compressed-tensors"
