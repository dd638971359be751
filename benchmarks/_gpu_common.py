"""Shared pieces of the GPU benchmarks: the CUDA check, the machine banner, a timer."""

from __future__ import annotations

import platform
import sys
from collections.abc import Callable

import torch


def nbytes(*ts) -> int:
    return sum(t.numel() * t.element_size() for t in ts if t is not None)


def require_cuda(name: str) -> None:
    """Exit cleanly (status 0) with a message when there is no CUDA device."""
    if not torch.cuda.is_available():
        print(f"{name}: no CUDA device on this machine; nothing to measure (skipped).")
        sys.exit(0)


def banner(name: str) -> None:
    import triton

    dev = torch.cuda.get_device_properties(0)
    print(f"# {name}")
    print(
        f"# machine: {platform.node()} | {dev.name} ({dev.multi_processor_count} SMs, "
        f"{dev.total_memory / 2**30:.0f} GiB) | cc {dev.major}.{dev.minor}"
    )
    print(
        f"# versions: python {platform.python_version()} | torch {torch.__version__} | "
        f"cuda {torch.version.cuda} | triton {triton.__version__}"
    )


def bench_ms(fn: Callable[[], object], warmup: int = 10, rep: int = 50) -> float:
    """Median milliseconds per call via triton.testing.do_bench (L2 flushed between runs)."""
    from triton.testing import do_bench

    return float(do_bench(fn, warmup=warmup, rep=rep, return_mode="median"))
