"""Every expert backend a CUDA MoE layer can get, run on fake CUDA tensors under the capture
guard (`graph_guard`) at vLLM's capture sizes: the grouped Triton experts (`triton-grouped`)
and the reference experts (served on CUDA only when VLLM_MXPLUS_BACKEND names them), for
every expert activation with and without expert biases, expert parallelism (an expert map)
and, for NVFP4, the TP row scales of the down projection's inputs.

The guard fails on host syncs (`.item()`, `.tolist()`, `nonzero`, `torch.unique`),
boolean-mask indexing, data-dependent shapes, host <-> device copies and CPU tensors built
per call; the controls at the end show it fails on the reference's old host-side routing.
"""

from __future__ import annotations

import pytest
import torch

from vllm_mxplus.backends.base import ExpertSpec
from vllm_mxplus.backends.expert_layer import EXPERT_ACTIVATIONS, expert_activation
from vllm_mxplus.backends.graph_guard import (
    GraphCaptureViolation,
    cuda_empty,
    fake_cuda,
    guarded,
)
from vllm_mxplus.formats import FormatSpec, get_scheme

CAPTURE_MS = (1, 16, 24, 512)  # vLLM's capture sizes: decode ends, first prefill size, largest
SCHEMES = ["mxfp4-mbs", "mxfp4-mbs-s", "mxfp4-16-oas", "mxfp4-ocp", "nvfp4", "mxplus"]
E_GLOBAL, E, H, INTER, TOPK = 16, 8, 256, 128, 4  # gpt-oss routes top-4


@pytest.fixture(autouse=True)
def _fake_cuda():
    with fake_cuda():
        yield


def _layer(scheme: str, bias: bool) -> torch.nn.Module:
    """A layer with what apply reads besides the backend's tensors: the expert map (half the
    experts on another rank), NVFP4's TP row scales, the biases (model dtype)."""
    s = get_scheme(scheme)
    layer = torch.nn.Module()
    layer.expert_map = cuda_empty((E_GLOBAL,), torch.int32)
    layer.mxplus_row_global_scale = (
        (lambda t: t.abs().amax(-1, keepdim=True).float() / 2688)
        if s.activation.has_global_scale
        else None
    )
    if bias:
        layer.w13_bias = cuda_empty((E, 2 * INTER), torch.bfloat16)
        layer.w2_bias = cuda_empty((E, H), torch.bfloat16)
    return layer


def _packed(fmt: FormatSpec, macro: int, n: int, k: int):
    """Fake packed expert weights of format fmt, E experts of n rows, from its flags."""
    from vllm_mxplus.backends.triton.moe_gemm import PackedExpertWeights

    rows = E * n
    extra = None
    if fmt.block_max_mantissa:
        extra = cuda_empty((rows, k // fmt.block_size), torch.uint8)
    elif fmt.mbs:
        extra = cuda_empty((rows, -(-k // macro)), torch.uint8)
    g = cuda_empty((rows,)) if fmt.has_global_scale else None
    scales = cuda_empty((rows, k // fmt.block_size), torch.uint8)
    return PackedExpertWeights(cuda_empty((rows, k // 2), torch.uint8), scales, extra, g, E, n, k)


def _apply(backend, layer, m: int, activation: str):
    x = cuda_empty((m, H), torch.bfloat16)
    tw, ti = cuda_empty((m, TOPK)), cuda_empty((m, TOPK), torch.int32)
    y, guard = guarded(backend.apply, layer, x, tw, ti, expert_activation(activation))
    assert y.shape == (m, H) and y.dtype == torch.bfloat16 and y.device.type == "cuda"
    return guard


@pytest.mark.parametrize("m", CAPTURE_MS, ids=lambda m: f"M{m}")
@pytest.mark.parametrize("bias", [False, True], ids=["no-bias", "bias"])
@pytest.mark.parametrize("activation", EXPERT_ACTIVATIONS)
@pytest.mark.parametrize("scheme", SCHEMES)
def test_triton_experts_capturable(scheme, activation, bias, m):
    from vllm_mxplus.backends.triton.experts import PACKED_ATTR, TritonExperts

    s = get_scheme(scheme)
    spec = ExpertSpec(s, device_type="cuda", activation=activation, has_bias=bias)
    assert TritonExperts.can_implement(spec) == (True, "")
    layer = _layer(scheme, bias)
    packed = {
        "w13": _packed(s.weight, s.macro_block, 2 * INTER, H),
        "w2": _packed(s.weight, s.macro_block, H, INTER),
    }
    setattr(layer, PACKED_ATTR, packed)
    guard = _apply(TritonExperts(spec), layer, m, activation)
    # E8M0 experts whose stems take x_hat (both K here do) run the decode kernel's grouped
    # mode, NVFP4 and MX+ mx_gemm's
    e8m0 = not (s.weight.has_global_scale or s.weight.block_max_mantissa)
    grouped = "triton_moe_decode_gemm" if e8m0 else "triton_moe_gemm"
    assert guard.ops.count(f"vllm_mxplus.{grouped}.default") == 2
    assert guard.ops.count("vllm_mxplus.triton_act_quant_hat.default") == (2 if e8m0 else 0)
    if bias:  # each pair's bias rows gathered on the device, added to the fp32 sums
        assert guard.ops.count("aten.index.Tensor") >= 2


@pytest.mark.parametrize("m", CAPTURE_MS, ids=lambda m: f"M{m}")
@pytest.mark.parametrize("bias", [False, True], ids=["no-bias", "bias"])
@pytest.mark.parametrize("activation", EXPERT_ACTIVATIONS)
@pytest.mark.parametrize("scheme", ["mxfp4-mbs", "nvfp4", "mxplus"])
def test_reference_experts_capturable(scheme, activation, bias, m):
    """Forced on CUDA (VLLM_MXPLUS_BACKEND=reference), the reference routes sync-free."""
    from vllm_mxplus.backends.reference.experts import W2_FP32, W13_FP32, ReferenceExperts

    spec = ExpertSpec(get_scheme(scheme), device_type="cuda", activation=activation, has_bias=bias)
    layer = _layer(scheme, bias)
    setattr(layer, W13_FP32, cuda_empty((E, 2 * INTER, H)))
    setattr(layer, W2_FP32, cuda_empty((E, H, INTER)))
    guard = _apply(ReferenceExperts(spec), layer, m, activation)
    assert guard.count("aten.mm") + guard.count("aten.addmm") >= 2 * E  # every local expert


# ------------------------------------------------------------------------- controls
def test_guard_fails_the_host_side_routing():
    """The CPU routing (`route`: torch.unique, nonzero, .tolist()) on fake CUDA tensors is
    what the guard exists to catch."""
    from vllm_mxplus.backends.reference.experts import route

    ids = cuda_empty((16, TOPK), torch.int32)
    with pytest.raises(GraphCaptureViolation):
        guarded(route, cuda_empty((16, TOPK)), ids, None)


def test_guard_fails_a_per_call_host_bias_copy():
    """A bias moved to the device per call (a host tensor copied in) fails too."""

    def apply(x: torch.Tensor) -> torch.Tensor:
        return x + torch.zeros(x.shape[-1]).to(x.device)

    with pytest.raises(GraphCaptureViolation):
        guarded(apply, cuda_empty((4, H)))
