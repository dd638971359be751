"""benchmarks/bench_cpu_linear.py: the streamed mode's rotation and vLLM's bf16 baseline."""

from __future__ import annotations

import sys

import pytest
import torch
from repo_scripts import load_repo_script

bench = load_repo_script("benchmarks/bench_cpu_linear.py", "bench_cpu_linear_under_test")


def test_copies_cover_twice_the_l3(monkeypatch):
    monkeypatch.setattr(bench, "_l3_bytes", lambda: 32 << 20)
    for nbytes in (1, 14 << 20, 50 << 20, 63 << 20, 64 << 20, 1 << 30):
        n = bench._copies(nbytes)
        assert n >= 2
        assert n * nbytes >= 2 * (32 << 20)
        # one copy fewer would not cover it (or the floor of 2 holds)
        assert n == 2 or (n - 1) * nbytes < 2 * (32 << 20)


def test_rotating_calls_each_item_in_turn():
    seen: list[int] = []
    run = bench._rotating([10, 20, 30], lambda item: seen.append(item) or item)
    assert [run() for _ in range(7)] == [10, 20, 30, 10, 20, 30, 10]
    assert seen == [10, 20, 30, 10, 20, 30, 10]


def test_vllm_baseline_is_the_same_linear():
    pytest.importorskip("vllm")
    g = torch.Generator().manual_seed(0)
    w = (torch.randn(96, 256, generator=g) * 0.05).to(torch.bfloat16)
    x = torch.randn(5, 256, generator=g).to(torch.bfloat16)
    f = bench._vllm_bf16_linear(w)
    assert f is not None
    y = f(x)
    want = x.float() @ w.float().t()
    assert y.shape == (5, 96) and y.dtype == torch.bfloat16
    # both sides are the exact product of bf16 values summed in fp32; the output rounds once
    # to bf16 (relative 2^-8), the fp32 sums differ in order by at most K u |x||w|
    bound = 2.0**-8 * want.abs() + 256 * 2.0**-24 * (x.float().abs() @ w.float().abs().t())
    assert torch.all((y.float() - want).abs() <= bound + 1e-30)


def test_stream_run_prints_every_column(monkeypatch, capsys):
    pytest.importorskip("vllm")
    from vllm_mxplus.backends.cpu import kernels as cpu_kernels

    ok, why = cpu_kernels.load()
    if not ok:
        pytest.skip(f"CPU kernels not built here: {why}")
    monkeypatch.setitem(bench.SHAPES, "smollm2", [(64, 128)] * 4)
    monkeypatch.setattr(bench, "_l3_bytes", lambda: 1 << 16)  # a few copies, not hundreds
    argv = ["bench_cpu_linear.py", "--scheme", "mxfp4-mbs-s", "--m", "1,4", "--shapes", "qkv"]
    monkeypatch.setattr(sys, "argv", [*argv, "--stream", "--min-iters", "1", "--min-time", "0"])
    assert bench.main() == 0
    out = capsys.readouterr().out
    assert "caches  : streamed" in out
    rows = [line.split() for line in out.splitlines() if line.startswith("smollm2")]
    assert [r[3] for r in rows] == ["1", "4"]
    for r in rows:
        bf16, vllm, packed = float(r[4]), float(r[5]), float(r[8])
        assert bf16 > 0 and vllm > 0 and packed > 0  # timed, not nan
        # the ratio printed to 2 decimals from the times printed to 1 (us): within what those
        # roundings allow (a loaded box's one-iteration times can make it 0.01, not ~1)
        lo, hi = (vllm - 0.05) / (packed + 0.05), (vllm + 0.05) / max(packed - 0.05, 1e-9)
        assert lo - 0.0051 <= float(r[10]) <= hi + 0.0051, (r, lo, hi)
    assert "vllm/packed = " in out and "--stream" in out.splitlines()[-1]


def test_real_layer_reads_smollm2s_own_operands():
    """--real-layer L: SmolLM2's layer-L weights, stacked as vLLM stacks them (q|k|v,
    gate|up), and the rows its linears read, in the benchmark's shapes."""
    pytest.importorskip("transformers")
    from vllm_mxplus.assets import prepare_smollm2

    real = bench._real_operands(2)
    assert list(real) == list(bench.SHAPE_NAMES)
    for name, (n, k) in zip(bench.SHAPE_NAMES, bench.SHAPES["smollm2"]):
        w, x = real[name]
        assert w.shape == (n, k) and x.shape == (bench.REAL_ROWS, k), name
        assert w.dtype == x.dtype == torch.float32 and torch.isfinite(x).all(), name
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(prepare_smollm2()), torch_dtype=torch.bfloat16)
    attn, mlp = model.model.layers[2].self_attn, model.model.layers[2].mlp
    assert torch.equal(real["qkv"][0][576:768], attn.k_proj.weight.float())
    assert torch.equal(real["gate_up"][0][1536:], mlp.up_proj.weight.float())
    # the MLP's rows are the attention's plus its output, normalized: not the same rows
    assert not torch.equal(real["qkv"][1], real["gate_up"][1])
    with pytest.raises(SystemExit, match="--real-layer 99"):
        bench._real_operands(99)
