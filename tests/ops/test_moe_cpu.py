"""Packed MoE experts on CPU (C++ kernels) against the reference experts: same routing, same
values, fp32 accumulation order only."""

from __future__ import annotations

import shutil

import pytest
import torch

from vllm_mxplus.formats import get_scheme, quantize
from vllm_mxplus.ops.moe_reference import moe_experts_reference

pytestmark = pytest.mark.skipif(shutil.which("c++") is None, reason="no C++ compiler (c++)")


@pytest.mark.parametrize(
    "scheme", ["mxfp4-mbs", "mxfp4-mbs-s", "mxfp4-16-oas", "mxfp4-ocp", "mxplus"]
)
@pytest.mark.parametrize("m", [1, 3, 40], ids=lambda m: f"M{m}")
@pytest.mark.parametrize("with_map", [False, True], ids=["all-local", "expert-map"])
def test_packed_experts_match_reference(scheme, m, with_map):
    from vllm_mxplus.ops import cpu_kernels
    from vllm_mxplus.ops.moe_cpu import PackedExperts, moe_experts_packed

    assert cpu_kernels.load()[0]
    s = get_scheme(scheme)
    g = torch.Generator().manual_seed(m)
    e, h, i, k = 5, 96, 160, 2  # K not a multiple of 128 on both GEMMs
    w13 = torch.randn(e, 2 * i, h, generator=g) * 0.1
    w2 = torch.randn(e, h, i, generator=g) * 0.1
    q13 = quantize(w13.reshape(e * 2 * i, h), s.weight_format)
    q2 = quantize(w2.reshape(e * h, i), s.weight_format)
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
        per_row=False,
        expert_map=expert_map,
    )

    def packed(q, n):
        def local_rows(t):
            return None if t is None else t.reshape(e, n, -1)[local].reshape(len(local) * n, -1)

        sub = type(q)(
            codes=q.codes.reshape(e, n, -1)[local].reshape(len(local) * n, -1),
            scales=q.scales.reshape(e, n, -1)[local].reshape(len(local) * n, -1),
            fmt=q.fmt,
            shape=torch.Size((len(local) * n, q.shape[-1])),
            mbs=local_rows(q.mbs),
            block_max_index=local_rows(q.block_max_index),
        )
        return PackedExperts.from_rows(sub, len(local), s.activation_format, 128)

    got = moe_experts_packed(x, packed(q13, 2 * i), packed(q2, h), wts, ids, expert_map=expert_map)
    assert got.dtype == torch.bfloat16 and got.shape == (m, h)
    assert not torch.equal(got, torch.zeros_like(got))
    # bf16 outputs: equal up to one bf16 rounding of the intermediate casts (h, y) that
    # fp32-accumulation-order noise can flip.
    assert torch.allclose(got.float(), want.float(), rtol=2**-6, atol=2**-6 * want.abs().max())
    same = (got == want).float().mean().item()
    assert same > 0.9, same  # almost all outputs are the very same bf16 numbers
