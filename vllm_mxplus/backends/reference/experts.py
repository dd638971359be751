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
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import Tensor

from vllm_mxplus.backends.base import STEMS, Activation, ExpertBackend, ExpertWeights, Layer
from vllm_mxplus.backends.expert_layer import expert_bias, gated
from vllm_mxplus.backends.reference.linear import fake_quant_activation, fake_quant_nvfp4_rows
from vllm_mxplus.formats import MACRO_BLOCK

W13_FP32, W2_FP32 = "mxplus_w13_fp32", "mxplus_w2_fp32"  # dequantized experts on the layer


def route(
    topk_weights: torch.Tensor, topk_ids: torch.Tensor, expert_map: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor, list[int], list[torch.Tensor]]:
    """(token of each (token, slot) pair [M*k], its routing weight fp32 [M*k], the local
    experts that got pairs in ascending order, each one's pair indices).

    Sorted experts give a fixed summation order; pairs routed to other ranks' experts
    (expert_map -> -1) are dropped."""
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
    macro_block: int = MACRO_BLOCK,
    expert_map: torch.Tensor | None = None,
    row_global_scale: Callable[[torch.Tensor], torch.Tensor] | None = None,
    w13_bias: torch.Tensor | None = None,
    w2_bias: torch.Tensor | None = None,
) -> torch.Tensor:
    """Routed-expert output [M, H] in x's dtype.

    x [M, H]; w13 [E, 2I, H] fp32 (gate rows then up rows, or interleaved for an activation
    that takes the whole row, see `gated`); w2 [E, H, I] fp32; w13_bias [E, 2I] / w2_bias
    [E, H] (gpt-oss) or None;
    topk_weights / topk_ids [M, k] (ids global). expert_map: global id -> local slot or -1
    (expert parallel; tokens routed to other ranks' experts contribute nothing here).
    row_global_scale: nvfp4 under TP only, h [R, I_part] -> per-row global scales of the
    whole (unsharded) rows, so a row-parallel shard quantizes as the unsharded row would.
    """
    m, k = topk_ids.shape
    out_dtype = x.dtype
    out = torch.zeros(m, w2.shape[1], dtype=torch.float32, device=x.device)
    if m == 0:
        return out.to(out_dtype)
    tok, weights, experts, rows = route(topk_weights, topk_ids, expert_map)
    xq = fake_quant_activation(x, act_format, per_row, macro_block)
    h = torch.zeros(m * k, w2.shape[2], dtype=out_dtype, device=x.device)
    b13, b2 = (None if b is None else b.to(torch.float32) for b in (w13_bias, w2_bias))
    for e, sel in zip(experts, rows):
        gu = F.linear(xq[tok[sel]], w13[e], None if b13 is None else b13[e]).to(out_dtype)
        h[sel] = gated(activation, gu)
    if row_global_scale is not None:
        hq = fake_quant_nvfp4_rows(h, row_global_scale(h))
    else:
        hq = fake_quant_activation(h, act_format, per_row, macro_block)
    for e, sel in zip(experts, rows):
        y = F.linear(hq[sel], w2[e], None if b2 is None else b2[e]).to(out_dtype).float()
        out.index_add_(0, tok[sel], y * weights[sel, None])
    return out.to(out_dtype)


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
