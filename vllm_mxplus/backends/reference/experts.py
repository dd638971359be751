"""Reference MoE experts: W4A4 per-expert GEMMs over the tokens routed to each expert.

Shared by the vLLM FusedMoE method (`integration/fused_moe.py`) and the transformers
fake-quant experts (`backends/reference/modules.py`), so that vLLM and the reference differ only by GEMM
accumulation order (and by the router's own rounding, computed by each framework).

Per token t and each of its top-k (expert e, weight w):
  a   = Q_act(x_t)                               (activation format, per token)
  g|u = a @ W13_hat[e]^T (+ b13[e])              fp32 GEMM and bias, cast to the model dtype
  h   = act(g) * u                               in the model dtype (vLLM's SiluAndMul), or
                                                 swigluoai(g|u) (gpt-oss; expert_layer.py)
  y  += w * (Q_act(h) @ W2_hat[e]^T (+ b2[e]))   fp32 GEMM and bias, cast, weighted, summed
                                                 in fp32
W13_hat / W2_hat are the scheme's dequantized weights (fp32, exact), dequantized once; the
expert biases (gpt-oss) stay in the model dtype and are added in fp32, as linear biases are.
Both activations are quantized along K per row, so quantizing all rows at once equals
quantizing each expert's rows apart (the nvfp4 global scale is per row: docs/numerics.md, NVFP4).

Two routings, one computation. On the CPU each expert multiplies only its own pairs' rows
(`route`: the local experts and their pairs, found on the host). On any other device the
routing is sync-free and CUDA-graph capturable (`_experts_dense`): every local expert
multiplies every token (stage 1) and every pair row (stage 2), and `torch.where` keeps the
rows of the pairs routed to it: no boolean-mask indexing, `torch.unique`, `nonzero` or
`.tolist()`, shapes from the input shapes only, at E / top_k times the routed GEMM work in
stage 1 and E times in stage 2 (the reference is the specification in code; on CUDA it serves
a layer only when VLLM_MXPLUS_BACKEND names it). Per token the expert contributions are added
in ascending expert order on both routings.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import Tensor

from vllm_mxplus.backends.base import STEMS, Activation, ExpertBackend, ExpertWeights, Layer
from vllm_mxplus.backends.expert_layer import expert_bias, gated
from vllm_mxplus.backends.reference.linear import fake_quant_activation, fake_quant_nvfp4_rows

W13_FP32, W2_FP32 = "mxplus_w13_fp32", "mxplus_w2_fp32"  # dequantized experts on the layer


def route(
    topk_weights: torch.Tensor, topk_ids: torch.Tensor, expert_map: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor, list[int], list[torch.Tensor]]:
    """(token of each (token, slot) pair [M*k], its routing weight fp32 [M*k], the local
    experts that got pairs in ascending order, each one's pair indices).

    Sorted experts give a fixed summation order; pairs routed to other ranks' experts
    (expert_map -> -1) are dropped. Host-side (`.tolist()`): for CPU tensors only."""
    m, k = topk_ids.shape
    ids = topk_ids.reshape(-1).long()
    if expert_map is not None:
        ids = expert_map[ids].long()
    tok = torch.arange(m, device=topk_ids.device).repeat_interleave(k)
    weights = topk_weights.reshape(-1).to(torch.float32)
    experts = [int(e) for e in torch.unique(ids[ids >= 0]).tolist()]
    rows = [torch.nonzero(ids == e).squeeze(1) for e in experts]
    return tok, weights, experts, rows


def moe_experts_reference(
    x: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    act_format: str,
    *,
    per_row: bool,
    activation: Callable[[torch.Tensor], torch.Tensor] = F.silu,
    macro_block: int,
    expert_map: torch.Tensor | None = None,
    row_global_scale: Callable[[torch.Tensor], torch.Tensor] | None = None,
    w13_bias: torch.Tensor | None = None,
    w2_bias: torch.Tensor | None = None,
    sync_free: bool | None = None,
) -> torch.Tensor:
    """Routed-expert output [M, H] in x's dtype.

    x [M, H]; w13 [E, 2I, H] fp32 (gate rows then up rows, or interleaved for an activation
    that takes the whole row, see `gated`); w2 [E, H, I] fp32; w13_bias [E, 2I] / w2_bias
    [E, H] (gpt-oss) or None;
    topk_weights / topk_ids [M, k] (ids global). expert_map: global id -> local slot or -1
    (expert parallel; tokens routed to other ranks' experts contribute nothing here).
    row_global_scale: nvfp4 under TP only, h [R, I_part] -> per-row global scales of the
    whole (unsharded) rows, so a row-parallel shard quantizes as the unsharded row would.
    macro_block: the scheme's (the layer passes its Scheme's). sync_free: the capturable
    routing (module docstring); None: on every device but the CPU.
    """
    m, k = topk_ids.shape
    out_dtype = x.dtype
    if m == 0:
        return torch.zeros(m, w2.shape[1], dtype=out_dtype, device=x.device)
    b13, b2 = (None if b is None else b.to(torch.float32) for b in (w13_bias, w2_bias))
    xq = fake_quant_activation(x, act_format, per_row, macro_block)

    def quantize_h(h: torch.Tensor) -> torch.Tensor:
        if row_global_scale is not None:
            return fake_quant_nvfp4_rows(h, row_global_scale(h))
        return fake_quant_activation(h, act_format, per_row, macro_block)

    experts = (xq, out_dtype, w13, w2, b13, b2, activation, quantize_h)
    if sync_free is None:
        sync_free = x.device.type != "cpu"
    routing = _experts_dense if sync_free else _experts_routed
    return routing(experts, topk_weights, topk_ids, expert_map).to(out_dtype)


def _experts_routed(experts: tuple, topk_weights, topk_ids, expert_map) -> torch.Tensor:
    """The layer in fp32 [M, H], each local expert on its own pairs' rows (`route`)."""
    xq, out_dtype, w13, w2, b13, b2, activation, quantize_h = experts
    m, k = topk_ids.shape
    out = torch.zeros(m, w2.shape[1], dtype=torch.float32, device=xq.device)
    tok, weights, local, rows = route(topk_weights, topk_ids, expert_map)
    h = torch.zeros(m * k, w2.shape[2], dtype=out_dtype, device=xq.device)
    for e, sel in zip(local, rows):
        gu = F.linear(xq[tok[sel]], w13[e], None if b13 is None else b13[e]).to(out_dtype)
        h[sel] = gated(activation, gu)
    hq = quantize_h(h)
    for e, sel in zip(local, rows):
        y = F.linear(hq[sel], w2[e], None if b2 is None else b2[e]).to(out_dtype).float()
        out.index_add_(0, tok[sel], y * weights[sel, None])
    return out


def _experts_dense(experts: tuple, topk_weights, topk_ids, expert_map) -> torch.Tensor:
    """The layer in fp32 [M, H] with sync-free routing (module docstring): for each local
    expert e (a count from the weights' shape), g|u of every token and y of every pair row,
    kept by `torch.where` for the pairs routed to e. A row that is not kept never enters a
    sum (a NaN or Inf in it included)."""
    xq, out_dtype, w13, w2, b13, b2, activation, quantize_h = experts
    m, k = topk_ids.shape
    ids = topk_ids.reshape(m, k).long()
    local = ids if expert_map is None else expert_map[ids].long()  # [M, k], -1: other rank
    weights = topk_weights.reshape(m, k, 1).to(torch.float32)
    h = torch.zeros(m, k, w2.shape[2], dtype=out_dtype, device=xq.device)
    for e in range(w13.shape[0]):
        gu = F.linear(xq, w13[e], None if b13 is None else b13[e]).to(out_dtype)
        h = torch.where((local == e)[..., None], gated(activation, gu)[:, None, :], h)
    hq = quantize_h(h.reshape(m * k, -1))
    out = torch.zeros(m, w2.shape[1], dtype=torch.float32, device=xq.device)
    for e in range(w2.shape[0]):
        y = F.linear(hq, w2[e], None if b2 is None else b2[e]).to(out_dtype).float()
        part = torch.where((local == e)[..., None], y.view(m, k, -1) * weights, 0.0)
        out += part.sum(1)
    return out


class ReferenceExperts(ExpertBackend):
    """Any scheme, any device: experts dequantized once to fp32, activations fake-quantized
    per token before each expert GEMM (`moe_experts_reference`). Correct everywhere, slow on
    a GPU, 4 bytes per weight."""

    name = "reference"

    @classmethod
    def is_supported(cls, platform: str, capability: int | None) -> tuple[bool, str]:
        return True, ""

    def process_weights_after_loading(self, layer: Layer, weights: ExpertWeights) -> None:
        fp32 = {stem: weights.dequantized(stem).contiguous() for stem in STEMS}
        for stem, attr in zip(STEMS, (W13_FP32, W2_FP32)):
            layer.register_parameter(attr, torch.nn.Parameter(fp32[stem], requires_grad=False))

    def apply(
        self, layer: Layer, x: Tensor, topk_weights: Tensor, topk_ids: Tensor, act: Activation
    ) -> Tensor:
        spec = self.spec
        return moe_experts_reference(
            x,
            getattr(layer, W13_FP32),
            getattr(layer, W2_FP32),
            topk_weights,
            topk_ids,
            spec.activation_format,
            per_row=spec.activation_per_row,
            activation=act,
            macro_block=spec.macro_block,
            expert_map=layer.expert_map,
            row_global_scale=getattr(layer, "mxplus_row_global_scale", None),
            w13_bias=expert_bias(layer, "w13"),
            w2_bias=expert_bias(layer, "w2"),
        )
