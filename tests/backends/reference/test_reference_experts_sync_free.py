"""The reference experts' sync-free routing (`moe_experts_reference(..., sync_free=True)`, what
a CUDA layer forced onto the reference runs: no boolean masks, `torch.unique`, `nonzero` or
`.tolist()`; tests/backends/test_graph_guard_experts.py runs it under the capture guard) gives
the layer the routed CPU path gives: both pass the expert self-test for every activation with
and without biases and agree with the float64 layer within its bound under expert
parallelism. (Not bit for bit with each other: the CPU BLAS sums a row in an order that
depends on how many rows the GEMM has.)
"""

from __future__ import annotations

import pytest
import torch

from vllm_mxplus.backends.base import ExpertSpec, ExpertWeights
from vllm_mxplus.backends.expert_layer import EXPERT_ACTIVATIONS, expert_activation, gated
from vllm_mxplus.backends.reference.experts import ReferenceExperts, moe_experts_reference
from vllm_mxplus.backends.selftest_experts import (
    BIAS_STEP,
    W13_SCALE,
    _grid_rows,
    _quantized,
    expected_layer,
    run_expert_self_test,
)
from vllm_mxplus.formats import get_scheme


class _SyncFreeReference(ReferenceExperts):
    """The reference experts with the CUDA routing on CPU tensors."""

    name = "reference-sync-free"

    def apply(self, layer, x, topk_weights, topk_ids, act):
        spec = self.spec
        return moe_experts_reference(
            x, layer.mxplus_w13_fp32, layer.mxplus_w2_fp32, topk_weights, topk_ids,
            spec.activation_format, per_row=spec.activation_per_row, activation=act,
            macro_block=spec.macro_block, expert_map=layer.expert_map,
            w13_bias=getattr(layer, "w13_bias", None), w2_bias=getattr(layer, "w2_bias", None),
            sync_free=True,
        )  # fmt: skip


@pytest.mark.parametrize("bias", [False, True], ids=["no-bias", "bias"])
@pytest.mark.parametrize("activation", EXPERT_ACTIVATIONS)
@pytest.mark.parametrize("scheme", ["mxfp4-mbs", "nvfp4", "mxplus"])
def test_sync_free_reference_passes_the_expert_self_test(scheme, activation, bias):
    spec = ExpertSpec(get_scheme(scheme), activation=activation, has_bias=bias)
    assert run_expert_self_test(_SyncFreeReference, spec, torch.device("cpu")) is None


E_GLOBAL, E, H, INTER, TOPK = 6, 4, 128, 96, 3
EXPERT_MAP = torch.tensor([0, -1, 1, 2, -1, 3])  # experts 1 and 4 on another rank


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("scheme", ["mxfp4-mbs-s", "nvfp4"])
def test_both_routings_match_the_float64_layer_under_expert_parallelism(scheme, dtype):
    """gpt-oss's layer (swigluoai, biases, top-3 of 6 experts, 4 local): the sync-free and the
    routed reference within `expected_layer`'s bound (stage 1 exact by construction, see
    selftest_experts.py)."""
    s = get_scheme(scheme)
    spec = ExpertSpec(s, activation="swigluoai", has_bias=True)
    gen = torch.Generator().manual_seed(5)
    nvfp4 = s.weight.has_global_scale
    bs = s.weight.block_size
    w13 = _grid_rows(E * 2 * INTER, H, bs, nvfp4, gen).reshape(E, 2 * INTER, H) * W13_SCALE
    w2 = torch.randn(E, H, INTER, generator=gen) * 0.1
    hat13 = _quantized(w13, spec).dequantize(torch.float32).reshape(w13.shape)
    hat2 = _quantized(w2, spec).dequantize(torch.float32).reshape(w2.shape)
    assert torch.equal(hat13, w13)
    b13 = (torch.randint(-64, 65, (E, 2 * INTER), generator=gen) * BIAS_STEP).to(dtype)
    b2 = (torch.randn(E, H, generator=gen) * 0.05).to(dtype)
    m = 7
    x = _grid_rows(m, H, bs, nvfp4, gen).to(dtype)
    ids = torch.stack([torch.randperm(E_GLOBAL, generator=gen)[:TOPK] for _ in range(m)])
    ids[0] = torch.tensor([1, 4, 0])  # one token with two pairs on the other rank
    wts = torch.softmax(torch.randn(m, TOPK, generator=gen), -1)
    act = expert_activation("swigluoai")
    kw = dict(
        per_row=s.activations_per_row, activation=act, macro_block=s.macro_block,
        expert_map=EXPERT_MAP, w13_bias=b13, w2_bias=b2,
    )  # fmt: skip
    dense = moe_experts_reference(
        x, hat13, hat2, wts, ids, s.activation_format, **kw, sync_free=True
    )
    routed = moe_experts_reference(x, hat13, hat2, wts, ids, s.activation_format, **kw)

    def h(e: torch.Tensor, gu64: torch.Tensor) -> torch.Tensor:
        return gated(act, (gu64 + b13[e].double()).to(dtype))

    local = EXPERT_MAP[ids]
    want, bound = expected_layer(
        x.float(), local, wts, {"w13": hat13, "w2": hat2}, spec, h, w2_bias=b2, out_dtype=dtype
    )
    for name, y in (("sync-free", dense), ("routed", routed)):
        assert y.dtype == dtype and y.shape == (m, H)
        err = (y.double() - want).abs()
        assert bool((err <= bound).all()), f"{name}: max err {err.max()} vs bound {bound.max()}"


def test_sync_free_rows_of_other_ranks_never_enter_the_sum():
    """Every local expert's rows are computed for every token: a NaN in the rows of an expert
    no pair is routed to (here its whole weight) stays out of the output, which equals the
    output with that weight finite (the kept rows are chosen by torch.where, not multiplied
    by 0)."""
    gen = torch.Generator().manual_seed(0)
    w13 = torch.randn(2, 8, 16, generator=gen)
    w2 = torch.randn(2, 16, 4, generator=gen)
    w13[1] = float("nan")  # expert 1: no token routed to it
    x = torch.randn(3, 16, generator=gen)
    ids = torch.zeros(3, 1, dtype=torch.int64)
    wts = torch.ones(3, 1)
    kw = dict(per_row=False, macro_block=16, activation=expert_activation("silu"))
    dense = moe_experts_reference(x, w13, w2, wts, ids, "mxfp4-16", **kw, sync_free=True)
    w13[1] = 1.0
    finite = moe_experts_reference(x, w13, w2, wts, ids, "mxfp4-16", **kw, sync_free=True)
    assert not dense.isnan().any()
    assert torch.equal(dense, finite)


def test_reference_backend_on_cpu_keeps_the_routed_path():
    """Plain CPU calls route on the host (cheaper: only the routed rows are multiplied);
    the layer is the same either way (tests above)."""
    spec = ExpertSpec(get_scheme("mxfp4-mbs"))
    backend = ReferenceExperts(spec)
    layer = torch.nn.Module()
    layer.expert_map = None
    w = {"w13": torch.randn(2, 8, 128), "w2": torch.randn(2, 128, 4)}
    backend.process_weights_after_loading(
        layer, ExpertWeights(quantized=lambda s: (None, 2), dequantized=lambda s: w[s])
    )
    x = torch.randn(3, 128)
    y = backend.apply(layer, x, torch.ones(3, 1), torch.zeros(3, 1, dtype=torch.int64), torch.relu)
    assert y.shape == (3, 128) and not y.isnan().any()
