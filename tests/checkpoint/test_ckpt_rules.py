"""The tensor-selection rules and --ignore matching."""

from __future__ import annotations

import pytest

from vllm_mxplus.checkpoint.rules import IgnoreMatcher, classify

CASES = [
    # name, dtype, shape, quantized, reason contains
    ("model.layers.3.self_attn.q_proj.weight", "BF16", (64, 64), True, "quantized"),
    ("model.layers.3.mlp.down_proj.weight", "F16", (64, 100), True, "quantized"),
    ("transformer.h.0.attn.c_proj.weight", "F32", (64, 64), True, "quantized"),
    ("lm_head.weight", "BF16", (96, 64), False, "lm_head"),
    ("model.embed_tokens.weight", "BF16", (96, 64), False, "embedding"),
    ("transformer.wte.weight", "BF16", (96, 64), False, "embedding"),
    ("bert.embeddings.word_embeddings.weight", "BF16", (96, 64), False, "embedding"),
    ("model.norm.weight", "BF16", (64,), False, "not a Linear"),
    ("model.layers.0.self_attn.q_proj.bias", "BF16", (64,), False, "not a Linear"),
    ("model.layers.0.mlp.gate.weight", "BF16", (8, 64), False, "router"),
    ("model.layers.0.block_sparse_moe.gate.weight", "BF16", (8, 64), False, "router"),
    ("model.layers.0.mlp.router.weight", "BF16", (8, 64), False, "router"),
    ("model.layers.0.mlp.gate_proj.weight", "BF16", (128, 64), True, "quantized"),
    ("model.layers.0.mlp.experts.gate_up_proj", "BF16", (8, 128, 64), True, "quantized"),
    ("model.layers.0.mlp.experts.3.up_proj.weight", "BF16", (128, 64), True, "quantized"),
    ("model.layers.0.mlp.experts.gate_up_proj_bias", "BF16", (8, 128), False, "not a Linear"),
    ("model.layers.0.self_attn.q_proj.weight", "I8", (64, 64), False, "dtype I8"),
    ("model.layers.0.self_attn.q_proj.weight", "BF16", (0, 64), False, "empty"),
    ("rotary_emb.inv_freq", "F32", (32,), False, "not a Linear"),
]


@pytest.mark.parametrize(
    "name, dtype, shape, quantized, reason", CASES, ids=[f"{c[0]}-{c[1]}" for c in CASES]
)
def test_classify(name: str, dtype: str, shape: tuple, quantized: bool, reason: str) -> None:
    d = classify(name, dtype, shape, IgnoreMatcher())
    assert d.quantize is quantized and reason in d.reason


@pytest.mark.parametrize(
    "pattern, hits",
    [
        ("down_proj", ["model.layers.0.mlp.down_proj", "model.layers.1.mlp.down_proj"]),
        ("layers.1.*", ["model.layers.1.mlp.down_proj", "model.layers.1.self_attn.q_proj"]),
        ("model.layers.0.*", ["model.layers.0.mlp.down_proj", "model.layers.0.self_attn.q_proj"]),
        ("*q_proj", ["model.layers.0.self_attn.q_proj", "model.layers.1.self_attn.q_proj"]),
        (
            r"re:layers\.[01]\.self_attn",
            ["model.layers.0.self_attn.q_proj", "model.layers.1.self_attn.q_proj"],
        ),
        ("re:^mlp", []),
        ("proj", []),  # a glob is not a substring search
    ],
)
def test_ignore_matcher(pattern: str, hits: list[str]) -> None:
    modules = [
        f"model.layers.{i}.{m}" for i in (0, 1) for m in ("mlp.down_proj", "self_attn.q_proj")
    ]
    matcher = IgnoreMatcher([pattern])
    assert sorted(m for m in modules if matcher.match(m)) == hits
    assert matcher.unused() == ([] if hits else [pattern])


def test_ignore_applies_before_dtype_and_is_recorded() -> None:
    m = IgnoreMatcher(["q_proj"])
    d = classify("model.layers.0.self_attn.q_proj.weight", "BF16", (64, 64), m)
    assert not d.quantize and d.reason == "--ignore q_proj" and d.module.endswith("q_proj")
