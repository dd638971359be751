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

On AMX-BF16 hosts, calls of at least `exact_bf16.MIN_M` rows of every scheme take the
exact-bf16 path instead (exact_bf16.py: bf16-exact operands, an fp32-accumulated GEMM on the
AMX tiles by csrc/mx_amx_cpu.cpp, a derived bound, a first-use self-test per scheme; the
dispatch runs this backend inside its opaque op there: `branches_on_m`); with AMX-INT8 too,
E8M0 weights from `exact_bf16.INT8_MIN_M` rows on int8 tiles (csrc/mx_amx_int8_cpu.cpp);
elsewhere, and with VLLM_MXPLUS_CPU_EXACT_BF16=0, the integer kernels serve every M.
"""

from __future__ import annotations

import logging

import torch
from torch import Tensor

from vllm_mxplus.backends.base import (
    Layer,
    LinearBackend,
    Spec,
    is_cpu_kernel_pair,
    set_packed_buffers,
)
from vllm_mxplus.backends.cpu import exact_bf16
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
from vllm_mxplus.formats import FormatSpec, QuantizedTensor, Scheme
from vllm_mxplus.log_once import log_once

logger = logging.getLogger(__name__)

# codes, scales, and the MBS bytes (E8M0 formats), the fp32 global scales (NVFP4) or the
# block maxima (MX+)
ATTRS = ("mxplus_cpu_codes", "mxplus_cpu_scales", "mxplus_cpu_mbs")
# which C++ GEMM a packed weight runs (the first element of its `pack_for_kernels` args)
GLOBAL_SCALE_GEMM = "e4m3-global"  # cpu_nvfp4_linear: E4M3 block scales + fp32 global
BLOCK_MAX_GEMM = "e8m0-block-max"  # cpu_mxplus_linear: E8M0 + MX+ block maxima
E8M0_GEMM = "e8m0"  # cpu_mx_linear: E8M0 block scales, MBS optional


def cpu_kernels_take(scheme: Scheme) -> tuple[bool, str]:
    """Whether the C++ kernels take this scheme's weight x activation pair (linears and MoE
    experts), from the formats' flags: both NVFP4-like (E4M3 + global scale), both MX+ (block
    maxima), or both E8M0 with the same block and scale rule, MBS on both sides or on neither,
    activations without the dynamic (MBS-D) search. (True, "") or (False, why)."""
    w, a = scheme.weight, scheme.activation
    if is_cpu_kernel_pair(w, a):
        return True, ""
    return False, f"no CPU kernel for weights {w.name} x activations {a.name}"


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
        return cpu_kernels_take(spec.scheme)


def pack_for_kernels(
    q: QuantizedTensor, activation: FormatSpec, macro_block: int
) -> tuple[tuple[torch.Tensor, torch.Tensor, torch.Tensor], tuple]:
    """A weight [N, K] in the kernels' 16-row tiles: ((codes, scales, third), args), third
    the MBS bytes (E8M0 formats), the NVFP4 fp32 global scale of each row or the MX+ block
    maxima; args what `cpu_linear` needs to run it (resolved once, so a decode step pays one
    C++ op call per GEMM and no lookups). activation: the activation format."""
    n, k = q.codes.shape[0], q.shape[-1]
    spec = q.spec
    if spec.has_global_scale:
        return pack_nvfp4(q), (GLOBAL_SCALE_GEMM, n, k)  # codes, E4M3, global
    if spec.block_max_mantissa:
        return pack_mxplus(q), (BLOCK_MAX_GEMM, n, k)  # codes, E8M0, block maxima
    packed = pack_weight(q.codes, q.scales, q.mbs, k, spec, macro_block)
    return packed, (E8M0_GEMM, linear_args(spec, activation, n, k, macro_block))


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
    gemm = args[0]
    if gemm == GLOBAL_SCALE_GEMM:
        return nvfp4_linear_packed(x, args[1], args[2], *weight, bias, out_dtype, act_global_scale)
    if gemm == BLOCK_MAX_GEMM:
        return mxplus_linear_packed(x, args[1], args[2], *weight, bias, out_dtype)
    return linear_packed(x, args[1], *weight, bias, out_dtype)


class CpuPackedBackend(CpuKernels, LinearBackend):
    name = "cpu-packed"
    kernel = True  # self-tested against `formats` at first use (a few ms per scheme and dtype)
    _args: tuple  # the kernel's resolved arguments, set by process_weights_after_loading
    # the exact-bf16 path for calls of at least exact.min_m rows (AMX hosts, every scheme;
    # exact_bf16.py), None where the integer kernels serve every M
    exact: exact_bf16.ExactBf16Weight | None = None

    def process_weights_after_loading(self, layer: Layer, qweight: QuantizedTensor) -> None:
        spec = self.spec
        if qweight.codes.dim() != 2:
            raise ValueError(
                f"cpu-packed expects a 2-D weight, got codes {tuple(qweight.codes.shape)}"
            )
        packed, self._args = pack_for_kernels(qweight, spec.scheme.activation, spec.macro_block)
        set_packed_buffers(layer, ATTRS, packed)
        # an E8M0 weight's tiles decode from the layer's own packed codes and scales
        shared = None
        if self._args[0] == E8M0_GEMM:
            shared = (layer.mxplus_cpu_codes, layer.mxplus_cpu_scales, layer.mxplus_cpu_mbs)
        self.exact = self._exact_weight(qweight, shared)

    def _exact_weight(
        self, qweight: QuantizedTensor, packed: tuple[Tensor, Tensor, Tensor] | None
    ) -> exact_bf16.ExactBf16Weight | None:
        """The exact-bf16 path's weight where this host and scheme take it (AMX-BF16 and the
        tile permission, a scheme whose operands the path builds: E8M0, NVFP4 and MX+ alike,
        the path's first-use self-test for the scheme passed), else None. On AMX tiles an
        E8M0 weight is read from `packed` (no more memory; on int8 tiles its decoded tiles are
        kept, ~1.1 bytes per weight, unless VLLM_MXPLUS_CPU_INT8_HELD=0); NVFP4 and MX+, and
        torch's GEMM elsewhere, keep a bf16 operand (2 more bytes per weight)."""
        ok, why = exact_bf16.takes(self.spec.scheme)
        if ok:
            ok, why = exact_bf16.host_choice()
        tiles, tiles_why = exact_bf16.amx_tiles(self.spec.scheme) if ok else (False, why)
        if ok:
            ok, why = exact_bf16.self_test(self.spec.scheme, tiles=tiles)
        if not ok:
            log_once(
                logger,
                ("exact-bf16", why),
                logging.INFO,
                "mxplus: cpu-packed runs its integer kernels for every M: %s",
                why,
            )
            return None
        w = exact_bf16.ExactBf16Weight.from_quantized(
            qweight, self.spec.scheme, tiles=tiles, packed=packed
        )
        log_once(
            logger,
            ("exact-bf16", self.spec.scheme.name),
            logging.INFO,
            "mxplus: cpu-packed runs %s calls of >= %d rows %s (docs/cpu_kernels.md; %s: "
            "VLLM_MXPLUS_CPU_EXACT_BF16=0 turns it off)",
            self.spec.scheme,
            w.min_m,
            "on AMX-INT8 tiles, the block scales folded into the int8 codes where exact"
            if w.int8 is not None
            else "as exact bf16 GEMMs on AMX-BF16 tiles"
            if tiles
            else f"as exact bf16 GEMMs through oneDNN ({tiles_why})",
            "int8 tiles decoded at load, about 1.1 bytes per weight more memory "
            "(VLLM_MXPLUS_CPU_INT8_HELD=0: decoded per call instead)"
            if w.held is not None
            else "weights decoded from their packed codes per call, no more memory"
            if w.packed is not None
            else "a bf16 copy of each weight, 2 bytes per weight more memory",
        )
        return w

    @property
    def branches_on_m(self) -> bool:
        return self.exact is not None  # the exact-bf16 path from exact.min_m rows

    def apply(
        self, layer: Layer, x: Tensor, bias: Tensor | None, act_global_scale: Tensor | None = None
    ) -> Tensor:
        # NVFP4 rows with given global scales (a row-parallel shard: the whole row's) keep the
        # integer kernel, which quantizes with them; the path quantizes with each row's own
        if (
            self.exact is not None
            and act_global_scale is None
            and x.numel() >= self.exact.min_m * self.exact.k
        ):
            return exact_bf16.linear(x, self.exact, bias, self.spec.out_dtype)
        weight = (layer.mxplus_cpu_codes, layer.mxplus_cpu_scales, layer.mxplus_cpu_mbs)
        return cpu_linear(x, self._args, weight, bias, self.spec.out_dtype, act_global_scale)
