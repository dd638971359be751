"""The CPU backend: packed FP4 weights + the C++ kernels of `cpu_kernels` (any M).

The layer keeps the checkpoint's packed bytes re-ordered into 16-row tiles (codes, E8M0
scales, MBS bytes: ~0.57 bytes per weight instead of the reference backend's 4-byte fp32
copy; MX+ ~0.59 with its block maxima; no fp32 weight exists at any time, for any scheme). Each call quantizes the activation rows once in C++
(codes bit-exact with `formats`) and runs one integer-dot-product GEMM for every M: exact
int32 block sums, power-of-two block scales, the MBS factors once per 128-element chunk, fp32
accumulation across blocks. Its error bound against the float64 product of the reference
backend's values is in csrc/mx_gemm_cpu.cpp (docs/numerics.md, "Kernel numerics and error
bounds").

Formats it takes: the E8M0 family with or without MBS (mxfp4-ocp, mxfp4-16, mxfp4-16-oas,
mxfp4-mbs-s, mxfp4-mbs-d weights), NVFP4 (E4M3 block scales, per-row / per-tensor global
scales: csrc/mx_nvfp4_cpu.cpp) and MX+ (block maxima as exact extra integer terms:
csrc/mx_mxplus_cpu.cpp): every scheme.
"""

from __future__ import annotations

import torch
from torch import Tensor

from vllm_mxplus.backends.base import (
    Layer,
    LinearBackend,
    Spec,
    check_e8m0_pair,
    set_packed_buffers,
)
from vllm_mxplus.backends.cpu import kernels as cpu_kernels
from vllm_mxplus.backends.cpu.kernels import (
    linear_args,
    linear_packed,
    mxplus_linear_packed,
    nvfp4_linear_packed,
    pack_mxplus,
    pack_nvfp4,
    pack_weight,
)
from vllm_mxplus.formats import QuantizedTensor

# codes, scales, and the MBS bytes (E8M0 formats), the fp32 global scales (NVFP4) or the
# block maxima (MX+)
ATTRS = ("mxplus_cpu_codes", "mxplus_cpu_scales", "mxplus_cpu_mbs")
NVFP4_PAIR = ("nvfp4", "nvfp4")
MXPLUS_PAIR = ("mxplus", "mxplus")


def cpu_kernels_take(weight_format: str, activation_format: str) -> tuple[bool, str]:
    """Whether the C++ kernels take this weight x activation pair (linears and MoE experts):
    the E8M0 family's pairs, NVFP4 and MX+. (True, "") or (False, why)."""
    if (weight_format, activation_format) in (NVFP4_PAIR, MXPLUS_PAIR):
        return True, ""
    return check_e8m0_pair(weight_format, activation_format, "CPU kernel")


class CpuKernels:
    """Where the C++ kernels serve (linears and MoE experts alike): on the CPU once they are
    built, for the pairs of `cpu_kernels_take`."""

    @classmethod
    def is_supported(cls, platform: str, capability: int | None) -> tuple[bool, str]:
        if platform != "cpu":
            return False, f"the C++ kernels run on the CPU, not {platform}"
        return cpu_kernels.load()

    @classmethod
    def can_implement(cls, spec: Spec) -> tuple[bool, str]:
        return cpu_kernels_take(spec.weight_format, spec.activation_format)


def pack_for_kernels(
    q: QuantizedTensor, activation_format: str, macro_block: int
) -> tuple[tuple[torch.Tensor, torch.Tensor, torch.Tensor], tuple]:
    """A weight [N, K] in the kernels' 16-row tiles: ((codes, scales, third), args), third
    the MBS bytes (E8M0 formats), the NVFP4 fp32 global scale of each row or the MX+ block
    maxima; args what `cpu_linear` needs to run it (resolved once, so a decode step pays one
    C++ op call per GEMM and no lookups)."""
    n, k = q.codes.shape[0], q.shape[-1]
    if q.fmt == "nvfp4":
        return pack_nvfp4(q), ("nvfp4", n, k)  # codes, E4M3, global
    if q.fmt == "mxplus":
        return pack_mxplus(q), ("mxplus", n, k)  # codes, E8M0, block maxima
    packed = pack_weight(q.codes, q.scales, q.mbs, k, q.fmt, macro_block)
    return packed, linear_args(q.fmt, activation_format, n, k, macro_block)


def cpu_linear(
    x: Tensor,
    args: tuple,
    weight: tuple[Tensor, Tensor, Tensor],
    bias: Tensor | None,
    out_dtype: torch.dtype,
    act_global_scale: Tensor | None = None,
) -> Tensor:
    """Q_act(x) @ W_hat^T (+ bias) by the C++ kernel of a `pack_for_kernels` weight.
    act_global_scale: NVFP4 only, per-row global scales [R, 1] to quantize x with instead of
    its rows' own."""
    if args[0] == "nvfp4":
        return nvfp4_linear_packed(x, args[1], args[2], *weight, bias, out_dtype, act_global_scale)
    if args[0] == "mxplus":
        return mxplus_linear_packed(x, args[1], args[2], *weight, bias, out_dtype)
    return linear_packed(x, args, *weight, bias, out_dtype)


class CpuPackedBackend(CpuKernels, LinearBackend):
    name = "cpu-packed"
    kernel = True  # self-tested against `formats` at first use (a few ms per scheme and dtype)
    _args: tuple  # the kernel's resolved arguments, set by process_weights_after_loading

    def process_weights_after_loading(self, layer: Layer, qweight: QuantizedTensor) -> None:
        spec = self.spec
        if qweight.codes.dim() != 2:
            raise ValueError(
                f"cpu-packed expects a 2-D weight, got codes {tuple(qweight.codes.shape)}"
            )
        packed, self._args = pack_for_kernels(qweight, spec.activation_format, spec.macro_block)
        set_packed_buffers(layer, ATTRS, packed)

    def apply(
        self, layer: Layer, x: Tensor, bias: Tensor | None, act_global_scale: Tensor | None = None
    ) -> Tensor:
        weight = (layer.mxplus_cpu_codes, layer.mxplus_cpu_scales, layer.mxplus_cpu_mbs)
        return cpu_linear(x, self._args, weight, bias, self.spec.out_dtype, act_global_scale)
