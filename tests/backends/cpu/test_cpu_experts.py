"""Packed MoE experts on CPU (C++ kernels) against the reference experts: same routing, same
values, fp32 accumulation order only."""

from __future__ import annotations

import dataclasses
import shutil

import pytest
import torch

from vllm_mxplus.backends.reference.experts import moe_experts_reference
from vllm_mxplus.backends.reference.linear import nvfp4_row_global_scale
from vllm_mxplus.formats import (
    QuantizedTensor,
    get_format,
    get_scheme,
    quantize,
    quantize_nvfp4_logical,
)

pytestmark = pytest.mark.skipif(shutil.which("c++") is None, reason="no C++ compiler (c++)")


def _nvfp4_per_row(w: torch.Tensor, shards: int) -> QuantizedTensor:
    """NVFP4 experts [E, N, K] as vLLM holds them: one global scale per logical weight
    (w13: gate and up apart), given per row [E*N, 1]."""
    e, n, k = w.shape
    amax = w.reshape(e, shards, n // shards, k).abs().amax((-1, -2))
    return quantize_nvfp4_logical(w.reshape(e * n, k), amax.reshape(-1), [n // shards] * e * shards)


def _halved_row_scale(h: torch.Tensor) -> torch.Tensor:
    """A stand-in for the TP reduction: global scales of rows twice as large as h's."""
    return nvfp4_row_global_scale(h) * 2


@pytest.mark.parametrize(
    "scheme",
    [
        "mxfp4-mbs",
        "mxfp4-mbs-s",
        "mxfp4-16-oas",
        "mxfp4-ocp",
        "mxplus",
        "nvfp4",
        "nvfp4-per-row",
        "nvfp4-tp-rows",
    ],
)
@pytest.mark.parametrize("m", [1, 3, 40], ids=lambda m: f"M{m}")
@pytest.mark.parametrize("with_map", [False, True], ids=["all-local", "expert-map"])
def test_packed_experts_match_reference(scheme, m, with_map):
    """nvfp4: one global scale for all experts; -per-row: one per logical weight (as loaded);
    -tp-rows: also the down projection's inputs quantized with given row scales (TP)."""
    from vllm_mxplus.backends.cpu import kernels as cpu_kernels
    from vllm_mxplus.backends.cpu.experts_math import PackedExperts, moe_experts_packed

    assert cpu_kernels.load()[0]
    variant = scheme
    scheme = scheme.split("-per-row")[0].split("-tp-rows")[0]
    s = get_scheme(scheme)
    per_row = get_format(s.activation_format).has_global_scale
    g = torch.Generator().manual_seed(m)
    e, h, i, k = 5, 96, 160, 2  # K not a multiple of 128 on both GEMMs
    w13 = torch.randn(e, 2 * i, h, generator=g) * 0.1
    w2 = torch.randn(e, h, i, generator=g) * 0.1
    w13[1, i:] *= 30  # expert 1's up projection: a global scale far from the others'
    if variant == scheme:
        q13 = quantize(w13.reshape(e * 2 * i, h), s.weight_format)
        q2 = quantize(w2.reshape(e * h, i), s.weight_format)
    else:
        q13, q2 = _nvfp4_per_row(w13, 2), _nvfp4_per_row(w2, 1)
    row_scale = _halved_row_scale if variant.endswith("tp-rows") else None
    x = torch.randn(m, h, generator=g).to(torch.bfloat16)
    ids = torch.stack([torch.randperm(e, generator=g)[:k] for _ in range(m)])
    wts = torch.softmax(torch.randn(m, k, generator=g), -1)
    expert_map = torch.tensor([0, -1, 1, 2, 3]) if with_map else None  # expert 1 elsewhere
    local = [0, 2, 3, 4] if with_map else list(range(e))

    def rows(q, n):
        return q.dequantize().reshape(e, n, -1)[local]

    want = moe_experts_reference(
        x,
        rows(q13, 2 * i),
        rows(q2, h),
        wts,
        ids,
        s.activation_format,
        per_row=per_row,
        macro_block=s.macro_block,
        expert_map=expert_map,
        row_global_scale=row_scale,
    )

    def packed(q, n):
        def local_rows(t):
            return None if t is None else t.reshape(e, n, -1)[local].reshape(len(local) * n, -1)

        sub = dataclasses.replace(
            q,
            codes=q.codes.reshape(e, n, -1)[local].reshape(len(local) * n, -1),
            scales=q.scales.reshape(e, n, -1)[local].reshape(len(local) * n, -1),
            shape=torch.Size((len(local) * n, q.shape[-1])),
            mbs=local_rows(q.mbs),
            block_max_index=local_rows(q.block_max_index),
            global_scale=(
                q.global_scale
                if q.global_scale is None or q.global_scale.numel() == 1
                else local_rows(q.global_scale)
            ),
        )
        return PackedExperts.from_rows(sub, len(local), s.activation, s.macro_block)

    got = moe_experts_packed(
        x,
        packed(q13, 2 * i),
        packed(q2, h),
        wts,
        ids,
        expert_map=expert_map,
        row_global_scale=row_scale,
    )
    assert got.dtype == torch.bfloat16 and got.shape == (m, h)
    assert not torch.equal(got, torch.zeros_like(got))
    # bf16 outputs: equal up to one bf16 rounding of the intermediate casts (h, y) that
    # fp32-accumulation-order noise can flip.
    assert torch.allclose(got.float(), want.float(), rtol=2**-6, atol=2**-6 * want.abs().max())
    same = (got == want).float().mean().item()
    assert same > 0.9, same  # almost all outputs are the very same bf16 numbers
