"""Online NVFP4 takes one global scale per weight as the checkpoint stores it
(docs/numerics.md, NVFP4): a fused layer loaded as one tensor (Phi-3's qkv_proj, no shard id)
is one weight, its parts loaded apart (Llama's q/k/v, a shard id each) are three — the same
weights `mxplus quantize` and the transformers reference quantize."""

from __future__ import annotations

import torch

from vllm_mxplus.formats import logical_amax, quantize_nvfp4_logical
from vllm_mxplus.integration.linear import (
    quantize_nvfp4_fused,
    recording_stored_tensors,
    stored_widths,
)


class _Layer(torch.nn.Module):
    def __init__(self, widths: list[int]) -> None:
        super().__init__()
        self.logical_widths = widths


def _load_calls(layer: _Layer, shards: list[str | None]) -> list[tuple]:
    seen: list[tuple] = []
    load = recording_stored_tensors(layer, lambda p, w, *a, **k: seen.append((a, k)))
    for shard in shards:
        if shard is None:
            load(None, None)
        else:
            load(None, None, shard)
    return seen


def test_fused_checkpoint_tensor_is_one_weight() -> None:
    layer = _Layer([64, 16, 16])
    assert _load_calls(layer, [None]) == [((), {})]  # the loader itself still runs
    assert stored_widths(layer) == [96]


def test_parts_stored_apart_are_weights_apart() -> None:
    layer = _Layer([64, 16, 16])
    calls = _load_calls(layer, ["q", "k", "v"])
    assert [a for a, _ in calls] == [("q",), ("k",), ("v",)]
    assert stored_widths(layer) == [64, 16, 16]


def test_unfused_layer_is_its_one_weight() -> None:
    layer = _Layer([64])
    _load_calls(layer, [None])
    assert stored_widths(layer) == [64]


def test_global_scales_follow_the_stored_weights() -> None:
    """The fused tensor's rows all share the amax of the whole stored tensor; loaded apart,
    each part keeps its own (so a small v_proj is not scaled by q_proj's amax)."""
    g = torch.Generator().manual_seed(0)
    w = torch.randn(96, 64, generator=g)
    w[80:] *= 0.01  # a "v" part far smaller than the rest
    fused, apart = _Layer([64, 16, 16]), _Layer([64, 16, 16])
    _load_calls(fused, [None])
    _load_calls(apart, ["q", "k", "v"])
    qf = quantize_nvfp4_fused(w, stored_widths(fused), 1)
    qa = quantize_nvfp4_fused(w, stored_widths(apart), 1)
    assert torch.equal(
        qf.global_scale, quantize_nvfp4_logical(w, logical_amax(w)[None], [96]).global_scale
    )
    assert qf.global_scale.unique().numel() == 1
    assert qa.global_scale.unique().numel() == 3
