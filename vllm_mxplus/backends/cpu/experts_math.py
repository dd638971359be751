"""Routed experts on the CPU with the packed C++ kernels (every scheme, `cpu_kernels`).

The same computation and order as `moe_experts_reference` (routing, the gated activation in
the model dtype, the weighted fp32 sum over sorted experts); each expert GEMM is
`vllm_mxplus::cpu_mx_linear` on that expert's packed weight, which quantizes the rows it is
given (per row, so per-expert quantization equals quantizing all rows at once) and multiplies
with integer dot products (the same values as the reference up to the bound of
csrc/mx_gemm_cpu.cpp; MX+: `cpu_mxplus_linear`, csrc/mx_mxplus_cpu.cpp; NVFP4:
`cpu_nvfp4_linear`, csrc/mx_nvfp4_cpu.cpp, with each weight row's global scale, i.e. one per
logical weight). Experts stay packed (~0.57 bytes per weight, MX+ ~0.59, instead of the
reference's 4-byte fp32 copy), in the 16-row tiles of `cpu_kernels.pack_weight` /
`pack_mxplus` / `pack_nvfp4`. Expert biases (gpt-oss) are the kernels' bias operand.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from vllm_mxplus.backends.cpu.linear import cpu_linear, pack_for_kernels
from vllm_mxplus.backends.expert_layer import gated
from vllm_mxplus.backends.reference.experts import route
from vllm_mxplus.formats import FormatSpec, QuantizedTensor


@dataclass
class PackedExperts:
    """One stacked expert weight [E, N, K] in the kernels' tile layout (`pack_for_kernels`
    per expert, stacked)."""

    codes: torch.Tensor  # uint8 [E, ceil(N/16), ...]
    scales: torch.Tensor  # uint8 [E, ceil(N/16), ...]
    # uint8 [E, ceil(N/16), ...] or [E, 0, ...]; MX+: the block maxima; NVFP4: the fp32
    # global scale of each weight row [E, ceil(N/16) * 16]
    mbs: torch.Tensor
    args: tuple  # the `cpu_linear` arguments of pack_for_kernels (the same for every expert)
    n: int  # rows per expert

    @classmethod
    def from_rows(
        cls, q: QuantizedTensor, experts: int, activation: FormatSpec, macro_block: int
    ) -> PackedExperts:
        """From a QuantizedTensor of all experts' rows [E*N, K]; activation: the activation
        format."""

        n = q.shape[0] // experts
        k = q.shape[-1]

        def rows(t: torch.Tensor | None, e: int) -> torch.Tensor | None:
            return None if t is None else t[e * n : (e + 1) * n]

        def expert(e: int) -> QuantizedTensor:
            """Expert e's rows as one weight [N, K] (NVFP4: the global scale for all rows,
            or each row's [E*N, 1]); the other fields (format, macro block) are q's."""
            g = q.global_scale
            return dataclasses.replace(
                q,
                codes=q.codes[e * n : (e + 1) * n],
                scales=q.scales[e * n : (e + 1) * n],
                shape=torch.Size((n, k)),
                mbs=rows(q.mbs, e),
                global_scale=g if g is None or g.numel() == 1 else rows(g.reshape(-1, 1), e),
                block_max_index=rows(q.block_max_index, e),
            )

        packed = [pack_for_kernels(expert(e), activation, macro_block) for e in range(experts)]
        codes, scales, mbs = (torch.stack([p[i] for p, _ in packed]) for i in range(3))
        return cls(codes, scales, mbs, packed[0][1], n)

    def linear(
        self,
        e: int,
        x: torch.Tensor,
        out_dtype: torch.dtype,
        act_global_scale: torch.Tensor | None = None,
        bias: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Expert e's GEMM on x's rows (+ its bias [N]). act_global_scale: NVFP4 only,
        per-row global scales [R, 1] to quantize x with instead of its rows' own."""
        weight = (self.codes[e], self.scales[e], self.mbs[e])
        return cpu_linear(x, self.args, weight, bias, out_dtype, act_global_scale)


def moe_experts_packed(
    x: torch.Tensor,
    w13: PackedExperts,
    w2: PackedExperts,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    *,
    activation: Callable[[torch.Tensor], torch.Tensor] = F.silu,
    expert_map: torch.Tensor | None = None,
    row_global_scale: Callable[[torch.Tensor], torch.Tensor] | None = None,
    w13_bias: torch.Tensor | None = None,
    w2_bias: torch.Tensor | None = None,
) -> torch.Tensor:
    """Routed-expert output [M, H] in x's dtype (see moe_experts_reference for the math, the
    activations and the biases, and for row_global_scale: NVFP4 under TP, the down
    projection's input rows quantized with the global scales of the whole unsharded rows).
    The biases go into the kernels, which add them in fp32 before the output cast."""
    m = topk_ids.shape[0]
    out_dtype = x.dtype
    hidden = w2.n
    out = torch.zeros(m, hidden, dtype=torch.float32, device=x.device)
    if m == 0:
        return out.to(out_dtype)
    tok, weights, experts, rows = route(topk_weights, topk_ids, expert_map)
    h = torch.zeros(tok.shape[0], w13.n // 2, dtype=out_dtype, device=x.device)
    for e, sel in zip(experts, rows):
        b13 = None if w13_bias is None else w13_bias[e]
        h[sel] = gated(activation, w13.linear(e, x[tok[sel]], out_dtype, bias=b13))
    g = None if row_global_scale is None else row_global_scale(h)
    for e, sel in zip(experts, rows):
        b2 = None if w2_bias is None else w2_bias[e]
        y = w2.linear(e, h[sel], out_dtype, None if g is None else g[sel], b2).to(torch.float32)
        out.index_add_(0, tok[sel], y * weights[sel, None])
    return out.to(out_dtype)
