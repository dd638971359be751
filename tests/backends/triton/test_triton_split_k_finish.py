"""The split-K sum: in a second launch (`gemm_launch.finish_output`) or inside the GEMM's own
(`gemm_blocks.reduce_split_tile`), the fp32 partials of the K slices summed in slice order,
then the bias, then the cast, bit for bit the same fold done step by step in torch, for
every output dtype and bias dtype, ragged sizes included."""

from __future__ import annotations

import pytest
import torch

from vllm_mxplus.backends.triton import decode_gemm as decode_gemm_mod
from vllm_mxplus.backends.triton import gemm_launch
from vllm_mxplus.backends.triton.gemm_blocks import reduce_split_tile
from vllm_mxplus.backends.triton.gemm_launch import (
    FINISH_BLOCK,
    MAX_SPLIT_K,
    SPLIT_COUNTERS,
    finish_output,
    plan_split_k,
    split_counters,
)
from vllm_mxplus.backends.triton.launch import tl, triton


def _fold(out: torch.Tensor, bias: torch.Tensor | None, out_dtype: torch.dtype) -> torch.Tensor:
    acc = out[0].clone()
    for s in range(1, out.shape[0]):
        acc = acc + out[s]
    if bias is not None:
        acc = acc + bias.to(torch.float32)
    return acc.to(out_dtype)


@pytest.mark.parametrize(
    "split,m,n", [(2, 1, 40), (5, 3, 333), (16, 16, 4096 // 8), (9, 1, FINISH_BLOCK + 7)]
)
@pytest.mark.parametrize("out_dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("bias_dtype", [None, torch.bfloat16, torch.float32])
def test_finish_is_the_ordered_fold(split, m, n, out_dtype, bias_dtype, triton_device):
    g = torch.Generator().manual_seed(split * 1000 + n)
    # magnitudes 2^-20..2^20 so that the order of the additions shows in the bits
    out = torch.randn(split, m, n, generator=g) * torch.exp2(
        torch.randint(-20, 21, (split, m, n), generator=g).float()
    )
    bias = None if bias_dtype is None else torch.randn(n, generator=g).to(bias_dtype)
    want = _fold(out, bias, out_dtype)
    dev = triton_device
    got = finish_output(out.to(dev), None if bias is None else bias.to(dev), out_dtype).cpu()
    assert got.dtype == out_dtype and got.shape == (m, n)
    view = {2: torch.int16, 4: torch.int32}[got.element_size()]
    assert torch.equal(got.view(view), want.view(view))


def test_two_d_output_is_only_cast(triton_device):
    y = torch.randn(3, 5).to(triton_device)
    assert finish_output(y, None, torch.float32) is y
    assert finish_output(y, None, torch.bfloat16).dtype == torch.bfloat16


def test_empty_output(triton_device):
    out = torch.zeros(4, 0, 8, device=triton_device)
    assert finish_output(out, None, torch.bfloat16).shape == (0, 8)


# ------------------------------------------------------------ the sum inside the GEMM's launch
@triton.jit
def _slices_kernel(part_ptr, bias_ptr, y_ptr, cnt_ptr, M, N, stride_os, stride_om, stride_ym,
                   HAS_BIAS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                   MAX_SPLIT: tl.constexpr):  # fmt: skip
    """Each (column tile, K slice, row tile) program reads its slice's given partial tile as
    its accumulator and hands it to `reduce_split_tile`, as a split GEMM would."""
    pid_n, pid_s, pid_m = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    m0, n0 = pid_m * BLOCK_M, pid_n * BLOCK_N
    rows, cols = m0 + tl.arange(0, BLOCK_M), n0 + tl.arange(0, BLOCK_N)
    src = pid_s.to(tl.int64) * stride_os + rows.to(tl.int64)[:, None] * stride_om + cols[None, :]
    acc = tl.load(part_ptr + src, mask=(rows < M)[:, None] & (cols < N)[None, :], other=0.0)
    reduce_split_tile(part_ptr, acc, bias_ptr, y_ptr, cnt_ptr, m0, n0, M, N, pid_s, stride_os,
                      stride_om, stride_ym, HAS_BIAS, BLOCK_M, BLOCK_N, MAX_SPLIT)  # fmt: skip


@pytest.mark.parametrize("split,m,n", [(2, 1, 40), (5, 3, 333), (16, 17, 200)])
@pytest.mark.parametrize("bias_dtype", [None, torch.float32])
def test_in_launch_sum_is_the_ordered_fold(split, m, n, bias_dtype, triton_device):
    """`gemm_blocks.reduce_split_tile`: the last slice of each tile sums the planes in slice
    order, then the bias, bit for bit the fold above (magnitudes 2^-20..2^20, so another
    order shows), over ragged tiles; every counter is back at 0 afterwards. (Under the
    interpreter the programs run one by one, so the last slice is the last program; on a GPU
    `gpu_check.sh` runs these tests where the slices arrive in any order.)"""
    g = torch.Generator().manual_seed(split * 100 + n)
    out = torch.randn(split, m, n, generator=g) * torch.exp2(
        torch.randint(-20, 21, (split, m, n), generator=g).float()
    )
    bias = None if bias_dtype is None else torch.randn(n, generator=g).to(bias_dtype)
    want = _fold(out, bias, torch.float32)
    dev = triton_device
    part = out.to(dev)
    y = torch.full((m, n), float("nan"), device=dev)
    counters = split_counters(dev)
    block_m, block_n = 16, 64
    grid = (-(-n // block_n), split, -(-m // block_m))
    b = bias.to(dev) if bias is not None else y
    _slices_kernel[grid](part, b, y, counters, m, n, part.stride(0), part.stride(1), y.stride(0),
                         HAS_BIAS=bias is not None, BLOCK_M=block_m, BLOCK_N=block_n,
                         MAX_SPLIT=MAX_SPLIT_K)  # fmt: skip
    assert torch.equal(y.cpu().view(torch.int32), want.view(torch.int32))
    assert not counters.cpu().any(), "a tile's counter was not set back to 0"


def test_in_launch_plan_and_fallback(monkeypatch, triton_device):
    """`plan_split_k(in_launch=True)` hands the kernel y and the counters where it splits; with
    no counters (a stream first seen during a CUDA-graph capture) or too many tiles it plans
    the second launch instead, and one split needs neither."""
    dev = triton_device
    sk = plan_split_k(3, 40, 1024, 128, 1, 4, None, torch.bfloat16, dev, in_launch=True)
    assert sk.split == 4 and sk.y is not None and sk.counters is split_counters(dev)
    assert tuple(sk.y.shape) == (3, 40) and tuple(sk.out.shape) == (4, 3, 40)
    too_many = plan_split_k(3, 40, 1024, 128, SPLIT_COUNTERS + 1, 4, None, torch.bfloat16, dev,
                            in_launch=True)  # fmt: skip
    assert too_many.split == 4 and too_many.y is None and too_many.counters is None
    one = plan_split_k(3, 40, 1024, 128, 1, 1, None, torch.bfloat16, dev, in_launch=True)
    assert one.split == 1 and one.counters is None
    # more slices than the in-launch sum unrolls (an explicit split_k, e.g. gpu_check's sweep)
    wide = plan_split_k(3, 40, 8192, 128, 1, 2 * MAX_SPLIT_K, None, torch.bfloat16, dev,
                        in_launch=True)  # fmt: skip
    assert wide.split == 2 * MAX_SPLIT_K and wide.counters is None
    monkeypatch.setattr(gemm_launch, "split_counters", lambda device: None)
    sk = plan_split_k(3, 40, 1024, 128, 1, 4, None, torch.bfloat16, dev, in_launch=True)
    assert sk.split == 4 and sk.y is None and sk.counters is None


@pytest.mark.parametrize("pair", ["mbs-s", "oas16"])
@pytest.mark.parametrize("split_k", [2, 5])
def test_decode_gemm_sums_in_launch_bit_for_bit(pair, split_k, monkeypatch, triton_device):
    """The decode GEMM with its slices summed in its own launch gives the bits of the same
    launch summed by `finish_output` (bias, bf16 output, ragged N, two row tiles), and leaves
    the counters at 0."""
    from tests.backends.triton.test_triton_decode_gemm import operands, run

    qx, qw = operands(20, 1201, 80, pair, triton_device, seed=split_k)
    bias = torch.randn(80).to(torch.bfloat16).to(triton_device)
    kw = {"bias": bias, "out_dtype": torch.bfloat16, "split_k": split_k}
    launched = []
    real = gemm_launch.plan_split_k

    def spy(*a, **k):
        sk = real(*a, **k)
        launched.append(sk)
        return sk

    monkeypatch.setattr(decode_gemm_mod, "plan_split_k", spy)
    in_launch = run(qx, qw, 1201, **kw)
    assert launched[-1].counters is not None
    monkeypatch.setattr(gemm_launch, "split_counters", lambda device: None)
    second = run(qx, qw, 1201, **kw)
    assert launched[-1].counters is None
    assert torch.equal(in_launch.view(torch.int16), second.view(torch.int16))
    assert not launched[0].counters.cpu().any()


@pytest.mark.gpu
@pytest.mark.parametrize("m", [1, 16])
def test_gpu_in_launch_sum_holds_under_concurrency(m, monkeypatch, cuda_device):
    """On a GPU the K slices of a tile run at the same time on different SMs and arrive in any
    order: an 8B-shaped decode GEMM (4096 x 4096, 32 tiles, split 8 and 16) summed in its
    own launch, 20 times in a row and once inside a CUDA graph replayed 5 times, gives the
    bits of the same launch summed by `finish_output` every time (a missing fence or a
    counter left non-zero shows up as a differing or NaN output here), and leaves the
    counters at 0."""
    from tests.backends.triton.test_triton_decode_gemm import operands, run
    from vllm_mxplus.backends.graph_guard import capture_graph

    qx, qw = operands(m, 4096, 4096, "mbs-s", cuda_device, seed=m)
    bias = torch.randn(4096, device=cuda_device).to(torch.bfloat16)
    for split in (8, 16):
        kw = {"bias": bias, "out_dtype": torch.bfloat16, "split_k": split}
        with monkeypatch.context() as mp:
            mp.setattr(gemm_launch, "split_counters", lambda device: None)
            want = run(qx, qw, 4096, **kw).view(torch.int16)
        for _ in range(20):
            assert torch.equal(run(qx, qw, 4096, **kw).view(torch.int16), want)
        graph, out = capture_graph(lambda _x, kw=kw: run(qx, qw, 4096, **kw), qx.codes)
        for _ in range(5):
            graph.replay()
            torch.cuda.synchronize()
            assert torch.equal(out.view(torch.int16), want)
    assert not torch.cat([c for c in gemm_launch._COUNTERS.values() if c.is_cuda]).any()
