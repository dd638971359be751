"""The CPU C++ kernels (`csrc/mx_linear_cpu.cpp`): built at first use, cached, loaded once.

    from vllm_mxplus.ops import cpu_kernels
    ok, why = cpu_kernels.load()          # builds on first call (~10 s), then cached
    y = cpu_kernels.mx_linear(x, "mxfp4-mbs-d", "mxfp4-mbs-s", codes, scales, mbs, k, bias,
                              torch.bfloat16)

The library is compiled with the host C++ compiler for this CPU (-march=native, so the
AVX-512 path is used where the CPU has it; a portable path otherwise) through
torch.utils.cpp_extension, into ~/.cache/vllm-mxplus/cpu_kernels/<hash> (override with
VLLM_MXPLUS_CPU_BUILD_DIR). The hash covers the source, the flags, torch's version and this
CPU's feature flags, so a cache shared between different machines never runs code built for
another CPU. VLLM_MXPLUS_CPU_MARCH=x86-64-v3 (say) builds for another target instead of
`native` (the tests use it to run the portable path). VLLM_MXPLUS_CPU_KERNELS=0 disables the kernels (the dispatch then uses the pure
torch reference backend and logs why).

Ops (namespace `mxplus_cpu`, each with a fake implementation for torch.compile):
  act_fake_quant(x, block, rule, mbs, macro)          -> fp32, bit-exact to formats.fake_quantize
  dequant_weight(codes, scales, mbs, k, block, macro)  -> fp32 [N, K], bit-exact to dequantize()
  mx_linear(x, ..., gemv_max_m)                        -> fake-quant x, then x_hat @ W_hat^T + b
"""

from __future__ import annotations

import hashlib
import logging
import os
import platform
import shutil
import threading
import time
from pathlib import Path
from typing import Optional

import torch

from vllm_mxplus.formats import MACRO_BLOCK, get_format

logger = logging.getLogger(__name__)

SOURCE = Path(__file__).resolve().parent / "csrc" / "mx_linear_cpu.cpp"
ENV_MARCH = "VLLM_MXPLUS_CPU_MARCH"  # -march for the build (default: native)
_BASE_CFLAGS = ["-O3", "-ffp-contract=off", "-fopenmp", "-DNDEBUG"]
LDFLAGS = ["-fopenmp"]
ENV_DISABLE = "VLLM_MXPLUS_CPU_KERNELS"
ENV_BUILD_DIR = "VLLM_MXPLUS_CPU_BUILD_DIR"
RULE_IDS = {"ocp": 0, "floor": 1, "oas": 2}
# Up to this many rows the linear streams the packed weight (memory-bound decode); above it,
# the weight is dequantized once per call to fp32 and torch's GEMM runs (compute-bound).
GEMV_MAX_M = 16

_lock = threading.Lock()
_state: dict[str, Optional[str]] = {"error": None, "loaded": None}


def cflags() -> list[str]:
    return [f"-march={os.environ.get(ENV_MARCH, 'native')}"] + _BASE_CFLAGS


def _cpu_signature() -> str:
    """This CPU's feature flags (x86 /proc/cpuinfo 'flags', else the platform string)."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith(("flags", "Features")):
                return line
    except OSError:
        pass
    return platform.processor() or platform.machine()


def build_name() -> str:
    h = hashlib.sha256()
    for part in (SOURCE.read_bytes(), " ".join(cflags() + LDFLAGS).encode(),
                 torch.__version__.encode(), _cpu_signature().encode()):
        h.update(part)
    return f"mxplus_cpu_{h.hexdigest()[:16]}"


def build_dir() -> Path:
    root = os.environ.get(ENV_BUILD_DIR)
    base = Path(root) if root else Path.home() / ".cache" / "vllm-mxplus" / "cpu_kernels"
    return base / build_name()


def _compiler() -> Optional[str]:
    return shutil.which(os.environ.get("CXX", "c++"))


def load() -> tuple[bool, str]:
    """Build (first time) and load the kernels: (True, "") or (False, why not)."""
    if os.environ.get(ENV_DISABLE, "1").strip().lower() in ("0", "false", "no", "off"):
        return False, f"disabled by {ENV_DISABLE}=0"
    if _state["loaded"]:
        return True, ""
    with _lock:
        if _state["loaded"]:
            return True, ""
        if _state["error"]:
            return False, _state["error"]
        try:
            _build_and_load()
        except Exception as e:  # noqa: BLE001 - any failure means: use the reference path
            msg = str(e).strip().splitlines()
            logger.warning("mxplus: the CPU kernels could not be built; the reference backend "
                           "serves instead. Build output:\n%s", "\n".join(msg[-40:]))
            _state["error"] = (f"building the CPU kernels failed ({type(e).__name__}: "
                               f"{msg[-1] if msg else ''}); set {ENV_DISABLE}=0 to skip them")
            return False, _state["error"]
        _state["loaded"] = build_name()
        return True, ""


def _build_and_load() -> None:
    if not SOURCE.exists():
        raise FileNotFoundError(f"{SOURCE} is missing from the installation")
    if _compiler() is None:
        raise RuntimeError("no C++ compiler found (install g++ or set CXX)")
    from torch.utils.cpp_extension import load as cpp_load

    name = build_name()
    out = build_dir()
    out.mkdir(parents=True, exist_ok=True)
    lib = out / f"{name}.so"
    fresh = not lib.exists()
    if fresh:
        logger.info("mxplus: building the CPU kernels into %s (once per machine, ~10 s)", out)
    t0 = time.time()
    cpp_load(name=name, sources=[str(SOURCE)], extra_cflags=cflags(), extra_ldflags=LDFLAGS,
             build_directory=str(out), is_python_module=False, verbose=False)
    if fresh:
        logger.info("mxplus: CPU kernels built in %.1f s", time.time() - t0)
    _register_fakes()


def _register_fakes() -> None:
    """Shape-only implementations so torch.compile / FakeTensor tracing can use the ops."""

    @torch.library.register_fake("mxplus_cpu::act_fake_quant")
    def _(x, block, rule, mbs, macro):
        return torch.empty(x.shape, dtype=torch.float32, device=x.device)

    @torch.library.register_fake("mxplus_cpu::dequant_weight")
    def _(codes, scales, mbs, k, block, macro):
        return codes.new_empty((codes.shape[0], k), dtype=torch.float32)

    @torch.library.register_fake("mxplus_cpu::mx_linear")
    def _(x, act_block, act_rule, act_mbs, macro, codes, scales, mbs, k, w_block, bias,
          out_dtype, gemv_max_m):
        return x.new_empty((*x.shape[:-1], codes.shape[0]), dtype=out_dtype)


def _require() -> None:
    ok, why = load()
    if not ok:
        raise RuntimeError(f"mxplus CPU kernels unavailable: {why}")


def _act_args(fmt: str) -> tuple[int, int, bool]:
    spec = get_format(fmt)
    if spec.scale_rule not in RULE_IDS or spec.block_max_mantissa or spec.mbs == "dynamic":
        raise ValueError(f"the CPU kernels do not fake-quantize activations as {fmt!r}")
    return spec.block_size, RULE_IDS[spec.scale_rule], spec.mbs == "static"


def _weight_block(fmt: str) -> int:
    spec = get_format(fmt)
    if spec.scale_rule not in RULE_IDS or spec.block_max_mantissa:
        raise ValueError(f"the CPU kernels do not read weights stored as {fmt!r}")
    return spec.block_size


def empty_mbs(device: torch.device | str = "cpu") -> torch.Tensor:
    """The `mbs` argument for formats without MBS bytes."""
    return torch.empty((0, 0), dtype=torch.uint8, device=device)


def act_fake_quant(x: torch.Tensor, fmt: str, macro_block: int = MACRO_BLOCK) -> torch.Tensor:
    """formats.fake_quantize(x, fmt) in fp32 (same bits), for the E8M0 activation formats."""
    _require()
    block, rule, mbs = _act_args(fmt)
    return torch.ops.mxplus_cpu.act_fake_quant(x, block, rule, mbs, macro_block)


def dequant_weight(codes: torch.Tensor, scales: torch.Tensor, mbs: Optional[torch.Tensor],
                   k: int, fmt: str, macro_block: int = MACRO_BLOCK) -> torch.Tensor:
    """QuantizedTensor.dequantize() in fp32 (same bits) for a 2-D packed weight."""
    _require()
    mbs_t = empty_mbs(codes.device) if mbs is None else mbs
    return torch.ops.mxplus_cpu.dequant_weight(codes, scales, mbs_t, k, _weight_block(fmt),
                                               macro_block)


def linear_args(weight_format: str, activation_format: str, k: int,
                macro_block: int = MACRO_BLOCK) -> tuple:
    """The constant arguments of `mxplus_cpu::mx_linear` for one layer (see `mx_linear`)."""
    a_block, a_rule, a_mbs = _act_args(activation_format)
    return a_block, a_rule, a_mbs, macro_block, k, _weight_block(weight_format)


def linear_packed(x: torch.Tensor, args: tuple, codes: torch.Tensor, scales: torch.Tensor,
                  mbs: torch.Tensor, bias: Optional[torch.Tensor], out_dtype: torch.dtype,
                  gemv_max_m: int = GEMV_MAX_M) -> torch.Tensor:
    """`mxplus_cpu::mx_linear` with a layer's `linear_args` (kernels already loaded; `mbs`
    is `empty_mbs()` for formats without MBS bytes). The per-call path of the backends."""
    a_block, a_rule, a_mbs, macro, k, w_block = args
    return torch.ops.mxplus_cpu.mx_linear(x, a_block, a_rule, a_mbs, macro, codes, scales, mbs,
                                          k, w_block, bias, out_dtype, gemv_max_m)


def mx_linear(x: torch.Tensor, weight_format: str, activation_format: str,
              codes: torch.Tensor, scales: torch.Tensor, mbs: Optional[torch.Tensor], k: int,
              bias: Optional[torch.Tensor], out_dtype: torch.dtype,
              macro_block: int = MACRO_BLOCK, gemv_max_m: int = GEMV_MAX_M) -> torch.Tensor:
    """fake_quantize(x, activation_format) @ W_hat^T + bias, fp32 accumulation, out_dtype."""
    _require()
    return linear_packed(x, linear_args(weight_format, activation_format, k, macro_block),
                         codes, scales, empty_mbs(codes.device) if mbs is None else mbs, bias,
                         out_dtype, gemv_max_m)
