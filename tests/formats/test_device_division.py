"""`vllm_mxplus.formats` gives the same bits on every device. torch on CUDA divides a tensor by
a Python number as a * fp32(1 / c) (ATen's div_true_kernel_cuda), one ulp off the IEEE
quotient for some a where c is not a power of two; the first H200 run found the NVFP4 global
scale of the reference one ulp off the kernels' (and the CPU's) IEEE division, so the
self-test refused correct kernels. Emulated here on the CPU: Tensor.__truediv__ patched to
do what that CUDA kernel does with a Python divisor, every format's quantization keeps its
bits (docs/numerics.md, NVFP4: every division IEEE on every device)."""

from __future__ import annotations

import pytest
import torch

from vllm_mxplus.formats import FORMATS, quantize
from vllm_mxplus.formats.nvfp4 import div_rn

REAL_DIV = torch.Tensor.__truediv__


def _cuda_like_div(self, other):
    """What torch on CUDA computes for `tensor / python_number` (fp32: times fp32(1 / c))."""
    if isinstance(other, (int, float)) and not isinstance(other, bool) and self.is_floating_point():
        inv = REAL_DIV(
            torch.ones((), dtype=self.dtype), torch.full((), float(other), dtype=self.dtype)
        )
        return self * inv
    return REAL_DIV(self, other)


@pytest.fixture
def cuda_division(monkeypatch):
    monkeypatch.setattr(torch.Tensor, "__truediv__", _cuda_like_div)


def _rows(seed: int, m: int = 512, k: int = 256) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(m, k, generator=g) * torch.exp2(torch.randint(-20, 20, (m, 1), generator=g))
    x[0, 5], x[1, 7], x[2, :16] = float("nan"), float("inf"), 0.0
    return x


def test_the_emulated_division_is_the_one_that_differs():
    """The emulation is not IEEE (else the test below could not fail): the old NVFP4
    expressions, amax / 2688 and amax_b / 6, differ from `div_rn` for some of these rows."""
    amax = _rows(1).abs().nan_to_num(posinf=0.0).amax(-1)
    for c in (2688.0, 6.0):
        assert bool((_cuda_like_div(amax, c) != div_rn(amax, c)).any()), c
        assert torch.equal(REAL_DIV(amax, c), div_rn(amax, c))  # on the CPU both are IEEE


@pytest.mark.parametrize("fmt", sorted(FORMATS))
@pytest.mark.parametrize("per_row", [False, True], ids=["tensor", "per_row"])
def test_quantize_keeps_its_bits_under_cuda_division(fmt, per_row, monkeypatch):
    if per_row and not FORMATS[fmt].has_global_scale:
        pytest.skip("per_row: NVFP4's per-row global scale only")
    for seed in (2, 3):
        x = _rows(seed)
        want = quantize(x, fmt, per_row=per_row)
        with monkeypatch.context() as mp:
            mp.setattr(torch.Tensor, "__truediv__", _cuda_like_div)
            got = quantize(x, fmt, per_row=per_row)
        for name in ("codes", "scales", "mbs", "global_scale"):
            a, b = getattr(got, name, None), getattr(want, name, None)
            assert (a is None) == (b is None), name
            if a is not None:
                view = {1: torch.uint8, 2: torch.int16, 4: torch.int32}[a.element_size()]
                assert torch.equal(a.contiguous().view(view), b.contiguous().view(view)), (
                    fmt,
                    name,
                )


@pytest.mark.gpu
@pytest.mark.parametrize("fmt", sorted(FORMATS))
def test_formats_on_cuda_equal_the_cpu(fmt):
    """The same check on a GPU itself: quantize on CUDA, bit for bit the CPU's."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device (none here)")
    for per_row in (False, True) if FORMATS[fmt].has_global_scale else (False,):
        x = _rows(4)
        want, got = quantize(x, fmt, per_row=per_row), quantize(x.cuda(), fmt, per_row=per_row)
        for name in ("codes", "scales", "mbs", "global_scale"):
            a, b = getattr(got, name, None), getattr(want, name, None)
            assert (a is None) == (b is None), name
            if a is not None:
                view = {1: torch.uint8, 2: torch.int16, 4: torch.int32}[a.element_size()]
                assert torch.equal(a.cpu().contiguous().view(view), b.contiguous().view(view)), (
                    fmt, per_row, name,
                )  # fmt: skip
