"""Triton set-up for tests/backends: the interpreter off-GPU, real kernels on CUDA.

Triton chooses interpreter or compiler when a kernel is decorated, i.e. when
a module of vllm_mxplus.backends.triton is first imported, so TRITON_INTERPRET must be set before that
(no GPU on the CI machines: only TRITON_INTERPRET=1). With CUDA present the kernels compile
for the GPU and the same tests run on CUDA tensors.
"""

from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


def _interpreted() -> bool:
    from vllm_mxplus.backends.triton.launch import INTERPRET

    return INTERPRET


@pytest.fixture(scope="session")
def ck():
    """The C++ CPU kernels, built and loaded (tests that use it skip without a C++ compiler
    by their own mark): a machine with a compiler must build them, so a broken build fails."""
    from vllm_mxplus.backends.cpu import kernels as cpu_kernels

    ok, why = cpu_kernels.load()
    assert ok, why
    return cpu_kernels


@pytest.fixture(scope="session")
def triton_device() -> torch.device:
    """Where the Triton kernels run in this session: CUDA when compiled, else the interpreter."""
    from vllm_mxplus.backends.triton.launch import is_available

    dev = torch.device("cpu" if _interpreted() else "cuda")
    ok, reason = is_available(dev)
    if not ok:
        pytest.skip(f"Triton kernels unavailable: {reason}")
    return dev


@pytest.fixture(scope="session")
def cuda_device() -> torch.device:
    """For @pytest.mark.gpu tests: skips with the reason when no compiled CUDA kernels."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device (none here)")
    if _interpreted():
        pytest.skip("TRITON_INTERPRET=1 is set: GPU tests need compiled kernels")
    return torch.device("cuda")
