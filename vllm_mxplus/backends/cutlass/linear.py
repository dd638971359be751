"""The prefill backends of the FP8-chunk / FP4 pipelines (`gemm`) on sm_90 / sm_100.

- `cutlass_prefill` (M >= VLLM_MXPLUS_PREFILL_MIN_M, default 129) where the CUTLASS extension
  is built: sm_90a's FP8-chunk GEMM, sm_100a's block-scaled FP4 MMA.
- `triton-fp8-prefill` (M >= FP8_PREFILL_MIN_M) where it is not: the same FP8-chunk pipeline
  (weight re-encoded per call, activations by `act_fp8`, the exact fallback) with Triton's
  FP8 GEMM (`triton.fp8_chunk_gemm`) on the FP8 tensor cores, needing no build. Below
  FP8_PREFILL_MIN_M rows the packed Triton GEMM (`triton-gemm`) serves: it reads 0.57 bytes
  per weight where this pipeline moves ~2.6 (encode: read 0.57, write 1.03; GEMM: read 1.03).

The dispatch registry names these classes (`vllm_mxplus.backends.cutlass.linear:...`); the
pieces behind them are one job per module:

- `fp8_chunks`  the sm_90a operand layout (pure torch): the definition of the FP8 re-encoding
- `build`       the C++ sources (package data, `csrc/`), building and loading the extension
- `ops`         the kernels as torch custom ops
- `gemm`        prepared weights and the prefill GEMM API, with the graph-safe exact fallback
- `act_fp8`     the fused sm_90a activation encoder (a Triton kernel)
"""

from __future__ import annotations

import torch
from torch import Tensor

from vllm_mxplus import settings
from vllm_mxplus.backends.base import Layer, LinearBackend, LinearSpec
from vllm_mxplus.backends.cutlass.build import arch_of, is_available
from vllm_mxplus.backends.cutlass.fp8_chunks import BLOCK, CHUNK
from vllm_mxplus.backends.cutlass.gemm import prefill_gemm_from_x, prepare_weight
from vllm_mxplus.backends.triton import launch
from vllm_mxplus.backends.triton.linear import BATCHED_DECODE_MAX_M, HELD_DECODE_MAX_M
from vllm_mxplus.formats import QuantizedTensor, get_format

# The smallest M the Triton FP8-chunk pipeline serves: above the decode GEMM's batched range
# (`triton.linear.decode_max_m`), where its static estimate for Llama-3-8B's linears passes
# the decode GEMM's 64-row tiles (`benchmarks/gpu_static_model.py` prints the paths at each M;
# docs/benchmarks.md); with the weight's FP8 form held from load (VLLM_MXPLUS_FP8_WEIGHT_HELD=1)
# nothing is re-encoded per call and it passes them from 65 rows.
SM100_CAPABILITY = 100
FP8_PREFILL_MIN_M = BATCHED_DECODE_MAX_M + 1
FP8_HELD_MIN_M = HELD_DECODE_MAX_M + 1


class CutlassPrefillBackend(LinearBackend):
    """Prefill on sm_90a / sm_100a; registered after the Triton decode backend (M below
    VLLM_MXPLUS_PREFILL_MIN_M)."""

    name = "cutlass_prefill"
    WEIGHT_ATTR = "mxplus_cutlass_weight"
    min_m = int(settings.PREFILL_MIN_M.default)  # the decode kernels serve below it

    @classmethod
    def m_bounds(cls) -> tuple[int, int | None]:
        return settings.prefill_min_m(), None

    kernel = True  # self-tested against `formats` at first use
    # Hopper's FP8 tensor cores (sm_90a) keep about 14 significand bits in the MMA
    # accumulator, truncating, between the promotions into fp32 that the kernel does once per
    # 128-K chunk (where the chunk scales are applied): a relative error below 2^-13 per
    # addition. 2^-13 over all K + 8 additions bounds the chunked sum from above
    # (docs/numerics.md, "Kernel numerics and error bounds"). sm_100a's block-scaled FP4 MMA
    # accumulates in fp32: 24. `accumulator_bits` is the looser one (no device known).
    ACCUMULATOR_BITS = {"sm90a": 13, "sm100a": 24}
    accumulator_bits = 13
    accumulation_chunk = CHUNK  # 128: one promotion into fp32 per chunk, as above

    @classmethod
    def accumulator_bits_on(cls, device: torch.device) -> int:
        """The self-test's accumulator bits on `device` (its architecture), 13 if unknown."""
        return cls.ACCUMULATOR_BITS.get(arch_of(device) or "", cls.accumulator_bits)

    @classmethod
    def is_supported(cls, platform: str, capability: int | None) -> tuple[bool, str]:
        if platform != "cuda" or capability not in (90, 100):
            return False, f"needs CUDA capability 90 or 100, got {platform} {capability}"
        return is_available()

    @classmethod
    def can_implement(cls, spec: LinearSpec) -> tuple[bool, str]:
        for role, fmt in (("weight", spec.weight_format), ("activation", spec.activation_format)):
            f = get_format(fmt)
            if f.block_size != BLOCK or f.has_global_scale or f.block_max_mantissa:
                return False, f"{role} format {fmt} is not E8M0 at block 16"
        if spec.macro_block != CHUNK:
            return False, f"macro block {spec.macro_block} != {CHUNK}"
        if spec.out_dtype not in (torch.bfloat16, torch.float16, torch.float32):
            return False, f"output dtype {spec.out_dtype} (bf16, fp16 or fp32)"
        return True, ""

    @classmethod
    def can_implement_on(cls, spec: LinearSpec, capability: int | None) -> tuple[bool, str]:
        """On sm_100a MBS layers are left to `triton-fp8-prefill`: this kernel applies MBS by
        one block-scaled FP4 launch per 128-K chunk, each reading and writing the fp32 output
        again, which `benchmarks/gpu_static_model.py`'s bound model puts far below bf16 and
        below the FP8-chunk pipeline (docs/benchmarks.md); without MBS it is one full-K
        launch on the FP4 tensor cores, the fastest path there."""
        mbs = get_format(spec.weight_format).mbs or get_format(spec.activation_format).mbs
        if capability == SM100_CAPABILITY and mbs:
            return False, (
                "sm_100a runs MBS as one FP4 launch per 128-K chunk with an fp32 "
                "read-modify-write each, estimated slower than triton-fp8-prefill "
                "(benchmarks/gpu_static_model.py); the in-kernel MBS mainloop is not built"
            )
        return True, ""

    def process_weights_after_loading(self, layer: Layer, qweight: QuantizedTensor) -> None:
        spec = self.spec
        act_mbs = bool(get_format(spec.activation_format).mbs)
        arch = arch_of(qweight.codes.device)
        if arch is None:
            raise RuntimeError(f"CUTLASS prefill: no kernel for {qweight.codes.device}")
        setattr(layer, self.WEIGHT_ATTR, prepare_weight(qweight, arch, activation_mbs=act_mbs))

    def apply(
        self, layer: Layer, x: Tensor, bias: Tensor | None, act_global_scale: Tensor | None = None
    ) -> Tensor:
        spec = self.spec
        lead, k = x.shape[:-1], x.shape[-1]
        y = prefill_gemm_from_x(
            x.reshape(-1, k),
            spec.activation_format,
            getattr(layer, self.WEIGHT_ATTR),
            bias,
            spec.out_dtype,
        )
        return y.reshape(*lead, spec.n)


class TritonFp8PrefillBackend(CutlassPrefillBackend):
    """The FP8-chunk prefill pipeline on Triton's FP8 GEMM: sm_90 (wgmma) and sm_100
    (tcgen05), no extension build. Registered after `cutlass_prefill` (which takes the layer
    where it is built) and before the packed `triton-gemm` (M below FP8_PREFILL_MIN_M)."""

    name = "triton-fp8-prefill"
    WEIGHT_ATTR = "mxplus_fp8_prefill_weight"
    min_m = FP8_PREFILL_MIN_M

    @classmethod
    def m_bounds(cls) -> tuple[int, int | None]:
        return (FP8_HELD_MIN_M if settings.fp8_weight_held() else cls.min_m), None

    @classmethod
    def is_supported(cls, platform: str, capability: int | None) -> tuple[bool, str]:
        if platform != "cuda" or capability not in (90, 100):
            why = f"needs CUDA capability 90 or 100 (FP8 tensor cores), got {platform} {capability}"
            return False, why
        return launch.is_available(torch.device("cuda"))

    @classmethod
    def can_implement_on(cls, spec: LinearSpec, capability: int | None) -> tuple[bool, str]:
        """Every layer `can_implement` takes, on both generations: the FP8-chunk pipeline
        applies MBS per chunk inside its one GEMM."""
        return True, ""

    def process_weights_after_loading(self, layer: Layer, qweight: QuantizedTensor) -> None:
        act_mbs = bool(get_format(self.spec.activation_format).mbs)
        # the FP8-chunk layout ("sm90a") on either architecture: Triton compiles the GEMM for
        # the device's own FP8 tensor cores
        held = settings.fp8_weight_held()
        w = prepare_weight(qweight, "sm90a", activation_mbs=act_mbs, engine="triton", hold_fp8=held)
        setattr(layer, self.WEIGHT_ATTR, w)
