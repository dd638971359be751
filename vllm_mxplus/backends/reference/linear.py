"""The reference backend: dequantize the weight once, fake-quantize activations, torch GEMM.

Numerics (docs/numerics.md, "Kernel numerics and error bounds"; the CPU path): the weight is dequantized ONCE after loading into an fp32
tensor W_hat (MBS-dequantized values v·X/F are not representable in bf16, fp32 keeps them
exact); each call fake-quantizes the activation rows with the scheme's activation format
(exact fp32 values) and computes F.linear in fp32, adds the bias in fp32, then casts to the
model dtype. `vllm_mxplus.backends.reference.modules.FakeQuantLinear` does exactly the same, so vLLM and
the transformers reference differ only by GEMM accumulation order.

The activation fake-quant is a torch custom op (`vllm_mxplus::fake_quant_activation`) so that
vLLM's torch.compile treats it as one opaque node instead of tracing the bit tricks.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from vllm_mxplus.backends.base import Layer, LinearBackend
from vllm_mxplus.backends.library import op_name
from vllm_mxplus.backends.reference.activation import fast_fake_quantize, takes_fast_path
from vllm_mxplus.formats import QuantizedTensor, fake_quantize, get_format
from vllm_mxplus.formats.nvfp4 import fake_quantize_nvfp4_given, nvfp4_global_scale

WEIGHT_ATTR = "mxplus_weight_fp32"  # the dequantized weight [N, K] fp32 on the layer


@torch.library.custom_op(op_name("fake_quant_activation"), mutates_args=())
def fake_quant_activation(
    x: torch.Tensor, fmt: str, per_row: bool, macro_block: int
) -> torch.Tensor:
    """fake_quantize(x, fmt) along the last dim, fp32 result (one row = one token)."""
    if x.numel() == 0:
        return torch.empty(x.shape, dtype=torch.float32, device=x.device)
    if takes_fast_path(get_format(fmt)):  # same bits, a third of the ops (activation.py)
        return fast_fake_quantize(x, fmt, macro_block)
    return fake_quantize(x, fmt, per_row=per_row, macro_block=macro_block)


@fake_quant_activation.register_fake
def _(x: torch.Tensor, fmt: str, per_row: bool, macro_block: int) -> torch.Tensor:
    return torch.empty(x.shape, dtype=torch.float32, device=x.device)


@torch.library.custom_op(op_name("fake_quant_nvfp4_rows"), mutates_args=())
def fake_quant_nvfp4_rows(x: torch.Tensor, global_scale: torch.Tensor) -> torch.Tensor:
    """NVFP4 fake quant of x's rows with GIVEN per-row global scales g [..., 1] (fp32).

    Used for row-parallel shards under TP: g comes from the whole row's amax (reduced over
    ranks), so each shard quantizes exactly as the unsharded row would.
    """
    return fake_quantize_nvfp4_given(x, global_scale)


@fake_quant_nvfp4_rows.register_fake
def _(x: torch.Tensor, global_scale: torch.Tensor) -> torch.Tensor:
    return torch.empty(x.shape, dtype=torch.float32, device=x.device)


def nvfp4_row_global_scale(x: torch.Tensor) -> torch.Tensor:
    """Per-row g = amax / (6 * 448) over finite |x| (formats.nvfp4, per_row=True)."""
    return nvfp4_global_scale(x.to(torch.float32), per_row=True)


def reference_linear(
    x: torch.Tensor,
    weight_fp32: torch.Tensor,
    bias: torch.Tensor | None,
    act_format: str,
    *,
    per_row: bool,
    out_dtype: torch.dtype,
    macro_block: int,
    act_global_scale: torch.Tensor | None = None,
) -> torch.Tensor:
    """Q_act(x) @ W_hat^T (+ bias) in fp32, cast to out_dtype. Shared with FakeQuantLinear.

    act_global_scale: NVFP4 only, per-row global scales to use instead of x's own.
    """
    if act_global_scale is not None:
        xq = fake_quant_nvfp4_rows(x, act_global_scale)
    else:
        xq = fake_quant_activation(x, act_format, per_row, macro_block)
    b = None if bias is None else bias.to(torch.float32)
    return F.linear(xq, weight_fp32, b).to(out_dtype)


class ReferenceBackend(LinearBackend):
    """Pure torch, any device: the contract every faster backend is checked against."""

    name = "reference"

    @classmethod
    def is_supported(cls, platform: str, capability: int | None) -> tuple[bool, str]:
        return True, ""

    def process_weights_after_loading(self, layer: Layer, qweight: QuantizedTensor) -> None:
        w = qweight.dequantize(torch.float32).contiguous()
        layer.register_parameter(WEIGHT_ATTR, torch.nn.Parameter(w, requires_grad=False))

    def apply(
        self, layer: Layer, x: Tensor, bias: Tensor | None, act_global_scale: Tensor | None = None
    ) -> Tensor:
        spec = self.spec
        return reference_linear(
            x,
            getattr(layer, WEIGHT_ATTR),
            bias,
            spec.activation_format,
            per_row=spec.activation_per_row,
            out_dtype=spec.out_dtype,
            macro_block=spec.macro_block,
            act_global_scale=act_global_scale,
        )
