"""Test-only helpers of the CUTLASS prefill path (kept out of the package)."""

from __future__ import annotations

import pytest
import torch

from vllm_mxplus.backends.base import LinearSpec
from vllm_mxplus.backends.cutlass import gemm as cutlass_gemm
from vllm_mxplus.backends.cutlass.fp8_chunks import CHUNK, Fp8ChunkLayout
from vllm_mxplus.backends.cutlass.linear import CutlassPrefillBackend
from vllm_mxplus.formats import get_scheme


def emulated_fp8_gemm(
    a_fp8: torch.Tensor,
    a_scale: torch.Tensor,
    b_fp8: torch.Tensor,
    b_scale: torch.Tensor,
    bias: torch.Tensor | None,
    out_dtype: torch.dtype = torch.bfloat16,
) -> torch.Tensor:
    """The sm_90a kernel's arithmetic in fp64: sum_c sa[c,m] sb[c,n] (A_c B_c^T), + bias,
    rounded once to out_dtype (the bf16 epilogue, or the fp32 one then a cast)."""
    a = a_fp8.to(torch.float64).view(a_fp8.shape[0], -1, CHUNK)
    b = b_fp8.to(torch.float64).view(b_fp8.shape[0], -1, CHUNK)
    part = torch.einsum("mck,nck->cmn", a, b)
    acc = (part * a_scale.double()[:, :, None] * b_scale.double()[:, None, :]).sum(0)
    if bias is not None:
        acc = acc + bias.double()
    kernel = torch.bfloat16 if out_dtype == torch.bfloat16 else torch.float32
    return acc.to(kernel).to(out_dtype)


@pytest.fixture
def emulated_sm90(monkeypatch):
    """Route the sm_90a GEMM of cutlass_gemm to the fp64 emulation (CPU tests)."""
    monkeypatch.setattr(cutlass_gemm, "fp8_chunk_gemm", emulated_fp8_gemm)
    return emulated_fp8_gemm


def dequantize_folded(layout: Fp8ChunkLayout) -> torch.Tensor:
    """fp8 · scale, what the kernel multiplies by (fp32(1/F) folded): equal to x_hat within
    one fp32 rounding."""
    return (layout.fp8.to(torch.float32) * layout.scale.t().repeat_interleave(CHUNK, -1))[
        :, : layout.k
    ]


def scheme_supported(scheme: str) -> bool:
    """Whether a scheme's formats are ones the CUTLASS backend runs."""
    s = get_scheme(scheme)
    spec = LinearSpec(scheme=scheme, n=1, k=1, out_dtype=torch.bfloat16)
    return s is not None and CutlassPrefillBackend.can_implement(spec)[0]


def _bits(t: torch.Tensor) -> torch.Tensor:
    if t.dtype == torch.float8_e4m3fn:
        return t.view(torch.uint8)
    if t.dtype == torch.float32:
        return t.view(torch.int32)
    return t


def assert_same_bits(name: str, got: torch.Tensor, want: torch.Tensor) -> None:
    """Bitwise equality; names the first mismatching coordinates."""
    assert got.shape == want.shape, f"{name}: shape {tuple(got.shape)} != {tuple(want.shape)}"
    assert got.dtype == want.dtype, f"{name}: dtype {got.dtype} != {want.dtype}"
    g, w = _bits(got.contiguous().cpu()), _bits(want.contiguous().cpu())
    bad = (g != w).nonzero()
    assert bad.numel() == 0, (
        f"{name}: {bad.shape[0]} mismatches, first at {tuple(bad[0].tolist())}: "
        f"got {g[tuple(bad[0])].item()} want {w[tuple(bad[0])].item()}"
    )
