"""NVFP4 activation global scales of row-parallel shards: the whole row's max over the TP
ranks through vLLM's all-gather (a collective its compiled graphs and CUDA graphs take), never
an eager all_reduce in the forward (integration/params.py `tp_row_max`). End to end with TP = 2
on CPU: tests/integration/test_vllm_tp.py (pre-quantized nvfp4)."""

from __future__ import annotations

import pytest
import torch
import vllm.distributed

from vllm_mxplus.backends.graph_guard import cuda_empty, fake_cuda, guarded
from vllm_mxplus.integration.params import tp_row_max

RANKS = 2


def _gather_two_ranks(t: torch.Tensor, dim: int = -1) -> torch.Tensor:
    """What vLLM's all-gather returns on 2 ranks when the other rank holds 2*t + 1."""
    return torch.cat([t, 2 * t + 1], dim=dim)


@pytest.fixture
def two_ranks(monkeypatch):
    monkeypatch.setattr(vllm.distributed, "tensor_model_parallel_all_gather", _gather_two_ranks)

    def no_eager_collective(*a, **k):
        raise AssertionError("an eager all_reduce in the forward")

    monkeypatch.setattr(torch.distributed, "all_reduce", no_eager_collective)


def test_row_max_over_ranks_exactly(two_ranks):
    g = torch.rand(7, 1) * 3 - 1
    got = tp_row_max(g, RANKS)
    assert got.shape == (7, 1)
    assert torch.equal(got, torch.maximum(g, 2 * g + 1))


def test_one_rank_is_a_no_op(two_ranks):
    g = torch.rand(3, 1)
    assert tp_row_max(g, 1) is g


@pytest.mark.parametrize("m", [1, 16, 24, 512])
def test_capturable_at_every_batch_size(two_ranks, m):
    with fake_cuda():
        g = cuda_empty((m, 1))
        out, guard = guarded(tp_row_max, g, RANKS)
        assert out.shape == (m, 1) and out.device.type == "cuda"
        assert not guard.violations
