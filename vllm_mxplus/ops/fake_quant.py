"""Reference fake-quant linears for any torch model (transformers reference, QSNR tooling).

`FakeQuantLinear` computes what the vLLM plugin's reference backend computes: weights
quantized with the scheme's weight format and dequantized once to fp32, activations
fake-quantized per call with the scheme's activation format, F.linear in fp32, bias added in
fp32, result cast back to the input dtype (see `vllm_mxplus.ops.reference`).
"""

from __future__ import annotations

from typing import Iterable, Optional

import torch
from torch import nn

from vllm_mxplus.formats import MACRO_BLOCK, get_format, get_scheme, quantize
from vllm_mxplus.ops.reference import reference_linear

DEFAULT_SKIP = ("lm_head",)  # paper §5.1: lm_head (and embeddings, norms) stay unquantized


class FakeQuantLinear(nn.Module):
    """A drop-in for nn.Linear with W4A4 fake quantization of one scheme."""

    def __init__(self, linear: nn.Linear, scheme: str, macro_block: int = MACRO_BLOCK):
        super().__init__()
        s = get_scheme(scheme)
        self.scheme = s.name
        self.weight_format = s.weight_format
        self.activation_format = s.activation_format
        self.per_row = get_format(s.activation_format).scale_rule == "e4m3"
        self.macro_block = macro_block
        self.in_features = linear.in_features
        self.out_features = linear.out_features
        w = linear.weight.detach()
        self.register_buffer(
            "weight_fp32",
            quantize(w, s.weight_format, macro_block=macro_block).dequantize(torch.float32),
        )
        bias = None if linear.bias is None else linear.bias.detach().clone()
        self.register_buffer("bias", bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return reference_linear(
            x,
            self.weight_fp32,
            self.bias,
            self.activation_format,
            per_row=self.per_row,
            out_dtype=x.dtype,
            macro_block=self.macro_block,
        )

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, "
                f"scheme={self.scheme}")


def _skipped(name: str, skip: Iterable[str]) -> bool:
    parts = name.split(".")
    return any(name == s or name.endswith("." + s) or s in parts for s in skip)


def apply_fake_quant(
    model: nn.Module,
    scheme: str,
    skip: Optional[Iterable[str]] = None,
    macro_block: int = MACRO_BLOCK,
) -> list[str]:
    """Replace every nn.Linear of `model` in place, except those named in `skip` (a module
    name, its last component(s), or any path component; default: lm_head). Returns the
    names of the replaced modules."""
    get_scheme(scheme)  # fail early on an unknown name
    skip = tuple(DEFAULT_SKIP if skip is None else skip)
    targets = [
        (name, mod) for name, mod in model.named_modules()
        if isinstance(mod, nn.Linear) and not _skipped(name, skip)
    ]
    for name, mod in targets:
        parent_name, _, child = name.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        setattr(parent, child, FakeQuantLinear(mod, scheme, macro_block))
    return [name for name, _ in targets]
