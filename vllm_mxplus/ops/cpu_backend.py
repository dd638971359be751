"""The CPU backend: packed FP4 weights + the C++ kernels of `cpu_kernels` (any M).

The layer keeps the checkpoint's packed tensors (codes, E8M0 scales, MBS bytes: ~0.57 bytes
per weight instead of the reference backend's 4-byte fp32 copy). Each call fake-quantizes
the activation rows in C++ (bit-exact to `formats`) and either streams the packed weight,
dequantizing it in registers (M <= cpu_kernels.GEMV_MAX_M, decode), or dequantizes it once
per call into fp32 and runs torch's GEMM (prefill). Every product is between the same fp32
values the reference backend uses; only the accumulation order differs.

Formats it takes: the E8M0 family with or without MBS (mxfp4-ocp, mxfp4-16, mxfp4-16-oas,
mxfp4-mbs-s, mxfp4-mbs-d weights). MX+ and NVFP4 fall back to the reference backend.
"""

from __future__ import annotations

from typing import Optional

import torch

from vllm_mxplus.formats import QuantizedTensor
from vllm_mxplus.ops.backend import (
    LinearBackend,
    LinearSpec,
    check_e8m0_pair,
    set_packed_buffers,
)

ATTRS = ("mxplus_cpu_codes", "mxplus_cpu_scales", "mxplus_cpu_mbs")


class CpuPackedBackend(LinearBackend):
    name = "cpu-packed"

    @classmethod
    def is_supported(cls, platform: str, capability: Optional[int]) -> tuple[bool, str]:
        if platform != "cpu":
            return False, f"the C++ kernels run on the CPU, not {platform}"
        from vllm_mxplus.ops import cpu_kernels

        return cpu_kernels.load()

    @classmethod
    def can_implement(cls, spec: LinearSpec) -> tuple[bool, str]:
        return check_e8m0_pair(spec.weight_format, spec.activation_format, "CPU kernel")

    def process_weights_after_loading(
        self, layer: torch.nn.Module, qweight: QuantizedTensor, spec: LinearSpec
    ) -> None:
        from vllm_mxplus.ops.cpu_kernels import empty_mbs, linear_args

        if qweight.codes.dim() != 2:
            raise ValueError(f"cpu-packed expects a 2-D weight, got codes {tuple(qweight.codes.shape)}")
        mbs = qweight.mbs if qweight.mbs is not None else empty_mbs(qweight.codes.device)
        set_packed_buffers(layer, ATTRS, (qweight.codes, qweight.scales, mbs))
        # Resolved once here, so a decode step pays one C++ op call per linear and no lookups.
        layer.mxplus_cpu_args = linear_args(spec.weight_format, spec.activation_format, spec.k,
                                            spec.macro_block)

    def apply(
        self,
        layer: torch.nn.Module,
        x: torch.Tensor,
        bias: Optional[torch.Tensor],
        spec: LinearSpec,
        act_global_scale: Optional[torch.Tensor] = None,
    ) -> torch.Tensor:
        from vllm_mxplus.ops.cpu_kernels import linear_packed

        return linear_packed(x, layer.mxplus_cpu_args, layer.mxplus_cpu_codes,
                             layer.mxplus_cpu_scales, layer.mxplus_cpu_mbs, bias, spec.out_dtype)
