"""Optional Triton import and the helpers the Triton kernels share.

Triton is optional: without it this module still imports, `triton.jit` becomes a stub that
raises when a kernel is launched, and `is_available()` says why the kernels cannot run.
Under `TRITON_INTERPRET=1` the kernels run on CPU tensors (slowly), which is how the tests
check them on machines without a GPU.

Every launcher starts its kernel through `launch(kernel, grid, *args, **constexprs)`, so
`capture_launches()` can record what the launchers would launch, with the GPU's tile
choices, without running anything: `vllm_mxplus.kernel_tools.aot` compiles exactly those
configurations to machine code for sm_80/90/100.
"""

from __future__ import annotations

import contextlib
import functools
import os
import types
from collections.abc import Callable, Iterator
from typing import Any, NamedTuple

import torch

from vllm_mxplus.formats.constants import ceil_div  # re-exported for the launchers

try:
    import triton
    import triton.language as tl

    HAS_TRITON = True
    _IMPORT_ERROR = ""
except ImportError as exc:  # pragma: no cover - exercised only without triton
    HAS_TRITON = False
    _IMPORT_ERROR = f"triton is not installed ({exc})"

    def _missing(*_args: Any, **_kwargs: Any) -> None:
        raise RuntimeError(f"vllm_mxplus Triton kernels unavailable: {_IMPORT_ERROR}")

    class _StubKernel:
        """Stands in for a @triton.jit function: defining it works, launching it raises."""

        def __init__(self, fn: Callable) -> None:
            self.fn = fn

        def __getitem__(self, _grid: Any) -> Callable:
            return _missing

        __call__ = _missing

    def _jit(fn: Callable | None = None, **_kwargs: Any) -> Any:
        return _StubKernel(fn) if fn is not None else _StubKernel

    triton = types.SimpleNamespace(jit=_jit, cdiv=lambda a, b: -(-a // b))
    # Kernel signatures use `tl.constexpr` as an annotation, evaluated at definition time.
    tl = types.SimpleNamespace(constexpr=int)


def interpreter_enabled() -> bool:
    """True when TRITON_INTERPRET=1 is set now (Triton reads it when a kernel is defined)."""
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


# Triton decides interpreter vs. compiler when `@triton.jit` runs, i.e. when the kernel
# modules import, right after this one: record that choice so that launches stay consistent.
INTERPRET = HAS_TRITON and interpreter_enabled()


class Launch(NamedTuple):
    """One recorded kernel launch: the @triton.jit object, grid, positional args, constexprs."""

    kernel: Any
    grid: tuple
    args: tuple
    kwargs: dict


_CAPTURE: list[Launch] | None = None
_CAPTURE_CAPABILITY: int | None = None


@contextlib.contextmanager
def capture_launches(capability: int | None = None) -> Iterator[list[Launch]]:
    """Record launches instead of running them, with the GPU's tile choices (not the
    interpreter's) and no device check: tensors may live on the meta device. capability
    (e.g. 90 for sm_90): the GPU whose choices the launchers make (`target_capability`);
    None: a GPU that has every choice (the tiles of sm_90)."""
    global _CAPTURE, _CAPTURE_CAPABILITY
    prev = _CAPTURE, _CAPTURE_CAPABILITY
    _CAPTURE, _CAPTURE_CAPABILITY = [], capability
    try:
        yield _CAPTURE
    finally:
        _CAPTURE, _CAPTURE_CAPABILITY = prev


def target_capability(device: torch.device) -> int | None:
    """The compute capability (major * 10 + minor) whose tiles a launch on `device` gets:
    inside `capture_launches(capability)` that one; else on a CUDA device its own; None under
    the interpreter or on other devices (the launchers then pick sm_90's tiles), and inside
    `capture_launches()` without one (its tensors may be fake or on the meta device: no GPU
    is asked)."""
    if _CAPTURE is not None:
        return _CAPTURE_CAPABILITY
    if interpreting() or device.type != "cuda":
        return None
    major, minor = torch.cuda.get_device_capability(device)
    return major * 10 + minor


SPLIT_K_SUM = "_finish_kernel"  # gemm_launch's split-K sum, launched after a split GEMM


def is_split_k_sum(lc: Launch) -> bool:
    """Whether a recorded launch is the split-K sum (`gemm_launch.finish_output`)."""
    return lc.kernel.__name__ == SPLIT_K_SUM


def last_gemm(launches: list[Launch]) -> Launch:
    """The last recorded launch that is not a split-K sum: the GEMM whose tile choices a
    launcher made."""
    return [lc for lc in launches if not is_split_k_sum(lc)][-1]


PDL_MIN_CAPABILITY = 90  # griddepcontrol: sm_90 and later
# the GPU's E2M1 conversion (PTX cvt.rn.satfinite.e2m1x2.f32: sm_100a and later), which the
# activation quantizer rounds with where it is (`hw_e2m1`)
HW_E2M1_MIN_CAPABILITY = 100
# constexprs that switch on instructions of later GPUs, with the capability each needs: the
# griddepcontrol instructions where `pdl_launch` says so (the decode GEMM's wait, the activation
# quantizer's trigger), the E2M1 conversion where `hw_e2m1` does (`mxplus kernels --aot`
# compiles a configuration with them off below it, as the launchers launch it)
ARCH_CONSTEXPRS = {"PDL": PDL_MIN_CAPABILITY, "TRIGGER": PDL_MIN_CAPABILITY,
                   "HW_E2M1": HW_E2M1_MIN_CAPABILITY}  # fmt: skip


def pdl_launch(device: torch.device) -> bool:
    """Whether a GEMM on `device` launches with programmatic dependent launch
    (VLLM_MXPLUS_GPU_PDL, sm_90+, a Triton whose launcher has `launch_pdl`; never under the
    interpreter): its programs start while the kernel before it runs and wait for it first
    (`gemm_blocks.wait_prior_grid`)."""
    from vllm_mxplus import settings

    cap = target_capability(device)
    return (
        cap is not None and cap >= PDL_MIN_CAPABILITY and settings.gpu_pdl() and _triton_has_pdl()
    )


def chained(device: torch.device) -> dict[str, Any]:
    """Launch keywords of a kernel inside a chain of programmatic dependent launches on
    `device`: PDL (it waits for the kernel before it, `gemm_blocks.wait_prior_grid`), TRIGGER
    (the kernel after it may start, `gemm_blocks.launch_dependents`) and Triton's
    `launch_pdl`; all off where `pdl_launch` is."""
    pdl = pdl_launch(device)
    return {"PDL": pdl, "TRIGGER": pdl, **({"launch_pdl": True} if pdl else {})}


def hw_e2m1(device: torch.device) -> bool:
    """Whether a launch on `device` rounds to E2M1 with the GPU's own conversion
    (HW_E2M1_MIN_CAPABILITY; never under the interpreter, which runs no PTX)."""
    cap = target_capability(device)
    return cap is not None and cap >= HW_E2M1_MIN_CAPABILITY


@functools.cache
def _triton_has_pdl() -> bool:  # once per process: asked at every decode launch
    if not HAS_TRITON:
        return False
    try:
        from triton.backends.nvidia.compiler import CUDAOptions
    except ImportError:  # a Triton without the CUDA backend
        return False
    return "launch_pdl" in getattr(CUDAOptions, "__dataclass_fields__", {})


def capturing() -> bool:
    return _CAPTURE is not None


def interpreting() -> bool:
    """Whether launchers should pick the interpreter's tiles (never while capturing)."""
    return INTERPRET and _CAPTURE is None


def launch(kernel: Any, grid: tuple, *args: Any, **kwargs: Any) -> None:
    """kernel[grid](*args, **kwargs), or record it inside `capture_launches()`."""
    if _CAPTURE is not None:
        _CAPTURE.append(Launch(kernel, tuple(grid), args, kwargs))
        return
    kernel[grid](*args, **kwargs)


def is_available(device: torch.device | str | None = None) -> tuple[bool, str]:
    """Whether the Triton kernels can run on `device` (default: CUDA), and why not."""
    if not HAS_TRITON:
        return False, _IMPORT_ERROR
    if _CAPTURE is not None:
        return True, "capturing launches (no kernel runs)"
    if INTERPRET:
        return True, "triton interpreter (TRITON_INTERPRET=1)"
    dev = torch.device(device) if device is not None else torch.device("cuda")
    if dev.type != "cuda":
        return False, (
            f"tensors on {dev}: the kernels were compiled for CUDA; CPU needs TRITON_INTERPRET=1 "
            "set before vllm_mxplus.backends imports triton"
        )
    if not torch.cuda.is_available():
        return False, "no CUDA device (set TRITON_INTERPRET=1 to run on CPU, slowly)"
    return True, f"triton {triton.__version__} on {torch.cuda.get_device_name(dev)}"


def check_available(tensor: torch.Tensor) -> None:
    """Raise a RuntimeError naming the reason when a kernel cannot run on tensor's device."""
    ok, reason = is_available(tensor.device)
    if not ok:
        raise RuntimeError(f"vllm_mxplus Triton kernels unavailable: {reason}")


__all__ = [
    "HAS_TRITON",
    "INTERPRET",
    "Launch",
    "capture_launches",
    "target_capability",
    "capturing",
    "ceil_div",
    "chained",
    "check_available",
    "interpreting",
    "is_available",
    "launch",
    "tl",
    "triton",
]
