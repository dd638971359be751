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

from torch import Tensor

from vllm_mxplus.backends.base import (
    Layer,
    LinearBackend,
    LinearSpec,
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


class CpuPackedBackend(LinearBackend):
    name = "cpu-packed"
    kernel = True  # self-tested against `formats` at first use (a few ms per scheme and dtype)
    _args: tuple  # the kernel's resolved arguments, set by process_weights_after_loading

    @classmethod
    def is_supported(cls, platform: str, capability: int | None) -> tuple[bool, str]:
        if platform != "cpu":
            return False, f"the C++ kernels run on the CPU, not {platform}"

        return cpu_kernels.load()

    @classmethod
    def can_implement(cls, spec: LinearSpec) -> tuple[bool, str]:
        return cpu_kernels_take(spec.weight_format, spec.activation_format)

    def process_weights_after_loading(self, layer: Layer, qweight: QuantizedTensor) -> None:
        spec = self.spec
        if qweight.codes.dim() != 2:
            raise ValueError(
                f"cpu-packed expects a 2-D weight, got codes {tuple(qweight.codes.shape)}"
            )
        if qweight.fmt == "nvfp4":
            set_packed_buffers(layer, ATTRS, pack_nvfp4(qweight))  # codes, E4M3, global
            self._args = ("nvfp4", qweight.codes.shape[0], spec.k)
            return
        if qweight.fmt == "mxplus":
            set_packed_buffers(layer, ATTRS, pack_mxplus(qweight))  # codes, E8M0, block maxima
            self._args = ("mxplus", qweight.codes.shape[0], spec.k)
            return
        packed = pack_weight(
            qweight.codes, qweight.scales, qweight.mbs, spec.k, spec.weight_format, spec.macro_block
        )
        set_packed_buffers(layer, ATTRS, packed)
        # Resolved once here (this backend serves this layer alone), so a decode step pays one
        # C++ op call per linear and no lookups.
        self._args = linear_args(
            spec.weight_format,
            spec.activation_format,
            qweight.codes.shape[0],
            spec.k,
            spec.macro_block,
        )

    def apply(
        self, layer: Layer, x: Tensor, bias: Tensor | None, act_global_scale: Tensor | None = None
    ) -> Tensor:

        out_dtype = self.spec.out_dtype
        args = self._args
        weight = (layer.mxplus_cpu_codes, layer.mxplus_cpu_scales, layer.mxplus_cpu_mbs)
        if args[0] == "nvfp4":
            return nvfp4_linear_packed(
                x, args[1], args[2], *weight, bias, out_dtype, act_global_scale
            )
        if args[0] == "mxplus":
            return mxplus_linear_packed(x, args[1], args[2], *weight, bias, out_dtype)
        return linear_packed(x, args, *weight, bias, out_dtype)
