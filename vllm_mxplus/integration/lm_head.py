"""The lm_head on CPUs without native bf16: an fp32 GEMM over an fp32 copy of its weight.

vLLM serves an unquantized bf16 lm_head (`ParallelLMHead`, often tied to the embeddings) with
oneDNN's bf16 GEMM. On an x86 CPU without `avx512_bf16` and without AMX-BF16 oneDNN emulates
it (converting operands as it goes), and the lm_head of a small model (SmolLM2-135M: 49152 x
576) becomes a fifth of a CPU decode step. An fp32 GEMM over the same values is the same
arithmetic: bf16/fp16 -> fp32 is exact, the product of two bf16 (or fp16) values is exact in
fp32, and both GEMMs accumulate in fp32, so only the accumulation order differs (as between
any two bf16 GEMMs); the logits are rounded back to the activation dtype, as vLLM's are.

`MxplusLMHeadMethod` is what `MxplusConfig.get_quant_method` returns for a `ParallelLMHead`
(never for a plain embedding). On a CPU-platform weight of dtype bf16/fp16, when
VLLM_MXPLUS_CPU_LM_HEAD_FP32 says so (`auto`: exactly when the CPU lacks native bf16), it
makes an fp32 GEMM over an fp32 copy of the weight once (`Fp32Gemm`, a plain attribute, not a
parameter: the tied embedding weight and the embedding lookups are untouched) and computes
the logits of calls with at least MIN_ROWS rows with it, cast back to the activation dtype.
Everywhere else (and for single rows) it is vLLM's `UnquantizedEmbeddingMethod`.
"""

from __future__ import annotations

import logging

import torch
from vllm.model_executor.layers.vocab_parallel_embedding import UnquantizedEmbeddingMethod

from vllm_mxplus import settings
from vllm_mxplus.log_once import log_once
from vllm_mxplus.platform_amx import cpu_flags, read_cpuinfo

logger = logging.getLogger(__name__)

FP32_ATTR = "mxplus_lm_head_fp32"  # the layer attribute holding its Fp32Gemm (or None)
# Fewer rows than this (single-stream decode) keep vLLM's bf16 GEMM: at M = 1 the GEMM is a
# read of the weight, and the bf16 weight is half the bytes of the fp32 one (SmolLM2's
# 49152 x 576 on the AVX-512 Xeon, one thread: 2.8 ms bf16 vs 7 ms fp32 at M = 1; from
# M = 2 on the fp32 GEMM is faster, 13 vs 37 ms at M = 16).
MIN_ROWS = 2
HALF_DTYPES = (torch.bfloat16, torch.float16)
# /proc/cpuinfo flags that mean bf16 GEMMs run natively: AVX512-BF16 (vdpbf16ps), AMX-BF16
# tiles (x86), the Arm BF16 extension (aarch64 `Features`).
NATIVE_BF16_FLAGS = ("avx512_bf16", "amx_bf16", "bf16")


def native_bf16_from_cpuinfo(cpuinfo: str) -> bool | None:
    """Whether a /proc/cpuinfo text's flags (`platform_amx.cpu_flags`) list a
    NATIVE_BF16_FLAGS flag; None when it has no flags line."""
    flags = cpu_flags(cpuinfo)
    return None if flags is None else not flags.isdisjoint(NATIVE_BF16_FLAGS)


def cpu_has_native_bf16() -> bool:
    """Whether this CPU runs bf16 GEMMs natively (from /proc/cpuinfo, else torch's probes)."""
    found = native_bf16_from_cpuinfo(read_cpuinfo())
    if found is not None:
        return found
    cpu = torch.cpu
    probes = ("_is_avx512_bf16_supported", "_is_amx_tile_supported")
    return any(bool(getattr(cpu, p, lambda: False)()) for p in probes)


def _on_cpu_platform() -> bool:
    from vllm.platforms import current_platform

    return current_platform.is_cpu()


def fp32_choice(weight: torch.Tensor) -> tuple[bool, str]:
    """(whether the lm_head weight gets the fp32 path, why) under the current setting."""
    if weight.is_meta or weight.device.type != "cpu" or not _on_cpu_platform():
        return False, "the weight is not on a CPU platform"
    if weight.dtype not in HALF_DTYPES:
        return False, f"the weight is {weight.dtype}, not bf16/fp16"
    forced = settings.cpu_lm_head_fp32()  # reads the variable now; raises on a bad value
    name = settings.CPU_LM_HEAD_FP32.name
    if forced is not None:
        return forced, f"{name}={settings.CPU_LM_HEAD_FP32.raw()}"
    if cpu_has_native_bf16():
        return False, f"{name}=auto and the CPU has native bf16"
    return True, f"{name}=auto and the CPU has no native bf16 (no avx512_bf16 / amx_bf16)"


class Fp32Gemm:
    """`x @ W.T + b` in fp32 over an fp32 copy of W (N x K), made once: vLLM's oneDNN GEMM
    handle for fp32 weights where vLLM CPU has oneDNN (it packs its own copy of the weight,
    as for vLLM's fp32 linears, whose weight vLLM drops after making the handle), else
    `torch.mm` over a K x N copy."""

    def __init__(self, weight: torch.Tensor) -> None:
        w32 = weight.detach().to(torch.float32)
        self.n, self.k = w32.shape
        self.nbytes = w32.numel() * w32.element_size()
        self.handle = None
        self.w32t: torch.Tensor | None = None
        self.backend = "torch.mm"
        if _onednn_available():
            from vllm import _custom_ops as ops

            try:
                self.handle = ops.create_onednn_mm(w32.t(), 32)
                self.backend = "oneDNN"
            except RuntimeError as e:
                log_once(
                    logger,
                    ("lm_head_fp32_onednn", str(e)),
                    logging.WARNING,
                    "mxplus: oneDNN refused the fp32 lm_head GEMM (%s); torch.mm serves it",
                    e,
                )
        if self.handle is None:
            self.w32t = w32.t().contiguous()

    def __call__(self, x32: torch.Tensor, b32: torch.Tensor | None) -> torch.Tensor:
        """x32: [M, K] fp32 -> [M, N] fp32."""
        if self.handle is not None:
            from vllm import _custom_ops as ops

            return ops.onednn_mm(self.handle, x32, b32)
        assert self.w32t is not None
        return torch.mm(x32, self.w32t) if b32 is None else torch.addmm(b32, x32, self.w32t)


def _onednn_available() -> bool:
    from vllm import _custom_ops as ops
    from vllm.platforms import CpuArchEnum, current_platform

    # the condition of vLLM's own CPU dispatch (dispatch_cpu_unquantized_gemm)
    return bool(ops._supports_onednn) and (
        current_platform.get_cpu_architecture() != CpuArchEnum.POWERPC
    )


class MxplusLMHeadMethod(UnquantizedEmbeddingMethod):
    """vLLM's unquantized lm_head, with the fp32 GEMM of the module docstring where chosen
    (for calls of at least MIN_ROWS rows; fewer go to vLLM's GEMM, kept as vLLM makes it)."""

    def process_weights_after_loading(self, layer: torch.nn.Module) -> None:
        weight = layer.weight
        assert isinstance(weight, torch.Tensor)
        use_fp32, why = fp32_choice(weight)
        setattr(layer, FP32_ATTR, None)
        super().process_weights_after_loading(layer)  # vLLM's GEMM, for every case
        dtype = str(weight.dtype).removeprefix("torch.")
        if not use_fp32:
            if weight.dtype in HALF_DTYPES and weight.device.type == "cpu" and not weight.is_meta:
                log_once(
                    logger,
                    ("lm_head_fp32", False, why),
                    logging.INFO,
                    "mxplus: lm_head %s: vLLM's %s GEMM (%s)",
                    tuple(weight.shape),
                    dtype,
                    why,
                )
            return
        # A copy, never the parameter itself: a tied lm_head shares its weight with the
        # embedding, whose lookups stay in the model dtype.
        gemm = Fp32Gemm(weight)
        setattr(layer, FP32_ATTR, gemm)
        log_once(
            logger,
            ("lm_head_fp32", True, why, gemm.backend, (gemm.n, gemm.k)),
            logging.INFO,
            "mxplus: lm_head %s: fp32 GEMM (%s) over an fp32 copy of the %s weight for %d+ "
            "rows (%s); %.1f MiB more memory",
            (gemm.n, gemm.k),
            gemm.backend,
            dtype,
            MIN_ROWS,
            why,
            gemm.nbytes / 2**20,
        )

    def apply(
        self,
        layer: torch.nn.Module,
        x: torch.Tensor,
        bias: torch.Tensor | None = None,
    ) -> torch.Tensor:
        gemm: Fp32Gemm | None = getattr(layer, FP32_ATTR, None)
        if gemm is None or x.numel() < MIN_ROWS * x.shape[-1]:
            return super().apply(layer, x, bias)
        x32 = x.reshape(-1, x.shape[-1]).to(torch.float32)
        b32 = None if bias is None else bias.to(torch.float32)
        return gemm(x32, b32).to(x.dtype).reshape(*x.shape[:-1], gemm.n)
