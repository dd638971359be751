"""The dense (GPU) form of the MBS-D search: the brute force's bytes, and one pass of kernels
with no host sync (run on fake CUDA tensors under the capture guard), where the gathered CPU
form syncs on every chunk."""

from __future__ import annotations

import pytest
import torch

from vllm_mxplus.backends.graph_guard import (
    GraphCaptureViolation,
    cuda_empty,
    fake_cuda,
    guarded,
)
from vllm_mxplus.formats import mbs_dynamic, mbs_dynamic_bruteforce, mbs_search

from .test_mbs import _cases

CASES = list(_cases())


@pytest.mark.parametrize("name,x", CASES, ids=[c[0] for c in CASES])
def test_dense_equals_bruteforce(name, x):
    assert torch.equal(mbs_dynamic(x, 128, dense=True), mbs_dynamic_bruteforce(x, 128))


def test_dense_marks_only_the_blocks_the_definition_must_decide():
    """Out-of-range blocks are marked; all-zero and non-finite blocks get 0 unmarked."""
    x = torch.randn(6, 128)
    x[1] *= 1e-35  # below the safe range
    x[2] = 0.0
    x[3, 5] = float("nan")
    x[4, 9] = float("inf")
    out, need = mbs_search.mbs_dynamic_dense(x, 128)
    assert need.tolist() == [False, True, False, False, False, False]
    assert out[2:5].tolist() == [0, 0, 0]
    assert torch.equal(mbs_dynamic(x, 128, dense=True), mbs_dynamic_bruteforce(x, 128))


def test_dense_rescoring_and_the_definition_for_too_many_ties(monkeypatch):
    """Lone powers of two tie at m = 0 and 128: re-scored to the smaller m; with room for only
    one candidate, each block is marked and decided by the definition, with the same bytes."""
    x = torch.zeros(64, 128)
    x[:, 9] = 2.0 ** torch.randint(-5, 5, (64,)).float()
    assert bool((mbs_dynamic(x, 128, dense=True) == 0).all())
    monkeypatch.setattr(mbs_search, "MAX_RESCORE", 1)
    _, need = mbs_search.mbs_dynamic_dense(x, 128)
    assert bool(need.all())
    assert torch.equal(mbs_dynamic(x, 128, dense=True), mbs_dynamic_bruteforce(x, 128))


def test_dense_weighted_equals_gathered():
    """The calibrated (input-weighted) byte: dense and gathered forms agree."""
    g = torch.Generator().manual_seed(11)
    x = torch.randn(16, 384, generator=g)
    d = torch.rand(384, generator=g) * 4
    assert torch.equal(
        mbs_dynamic(x, 128, weights=d, dense=True), mbs_dynamic(x, 128, weights=d, dense=False)
    )


def test_dense_chunks_agree(monkeypatch):
    """Several chunks per tensor: the same bytes as one."""
    x = next(x for name, x in CASES if name == "outliers")
    whole = mbs_dynamic(x, 128, dense=True)
    monkeypatch.setattr(mbs_search, "DENSE_CHUNK_ELEMS", 5 * 128)
    assert torch.equal(mbs_dynamic(x, 128, dense=True), whole)


def test_dense_pass_has_no_host_sync_on_cuda():
    """The dense pass over a [4096, 1024] CUDA weight (fake) runs under the capture guard:
    no sync, no host copy, at any chunk count."""
    with fake_cuda():
        w = cuda_empty((4096 * 8, 128))
        (out, need), guard = guarded(mbs_search.mbs_dynamic_dense, w, 128)
        assert out.shape == need.shape == (4096 * 8,)
        assert out.device.type == "cuda" and guard.count() > 100


def test_the_guard_catches_the_gathered_form():
    """The check above can fail: the CPU form's `nonzero` per chunk is a host sync."""
    with fake_cuda():
        w = cuda_empty((64, 128))
        with pytest.raises(GraphCaptureViolation):
            guarded(mbs_search._pick, w, 128, 16)
