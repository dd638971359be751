"""MoE experts: vLLM FusedMoE method vs the transformers fake-quant reference.

Tiny random Qwen3-MoE (8 experts, top-2, norm_topk_prob) and Mixtral (4 experts, top-2)
models in fp32: vLLM + plugin must be token-identical to transformers with every expert and
every attention linear fake-quantized (`apply_fake_quant`), online and from the offline
quantizer's checkpoints (per-expert 2-D tensors, router kept in high precision).
All single-process engines run in one driver process; TP=2 is a separate, slow process.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from integration_harness import PROMPTS, gen_job, greedy_mismatch, run_driver

# Engines are the cost (2-core CI): the paper's format and the NVFP4 baseline online on
# Qwen3-MoE, MBS on Mixtral, and one offline-quantizer checkpoint per tensor set that
# needs its own MoE loader path (E8M0 + MBS bytes; NVFP4 e4m3 + per-expert fp32 globals).
ONLINE = [("q3", "mxfp4-mbs"), ("q3", "nvfp4"), ("mx", "mxfp4-mbs")]
PRE = [("q3", "mxfp4-mbs"), ("mx", "nvfp4")]
MOE_TOKENS = 16
_HF: dict = {}


def _job(job_id: str, model: str, quantization, tp: int = 1) -> dict:
    return {**gen_job(job_id, model, quantization, tp), "max_tokens": MOE_TOKENS}


def _check_against_reference(res: dict, model_dir: str, scheme: str) -> None:
    """Greedy tokens identical to transformers + fake-quant experts and linears.

    The flip rule of `greedy_mismatch`: a rare 4-bit rounding flip from accumulation-order
    noise may part a prompt late (fewer than half of them); a real bug (wrong scale, misplaced
    expert / shard, wrong routing weights) breaks every prompt at the first token.
    """
    from hf_reference import hf_greedy

    assert res.get("error") is None, res.get("trace", res.get("error"))
    key = (model_dir, scheme)
    if key not in _HF:
        _HF[key] = hf_greedy(model_dir, scheme, PROMPTS, MOE_TOKENS)
    ref_tokens, ref_lps = _HF[key]
    why = greedy_mismatch(res, ref_tokens, ref_lps, MOE_TOKENS)
    assert why is None, f"{scheme}: {why}"


def _build(root: Path) -> dict[str, str]:
    import torch
    from tiny_models import build_tiny_mixtral, build_tiny_qwen3_moe, tamper_checkpoint

    from vllm_mxplus.checkpoint.quantizer import quantize_checkpoint

    m = {
        "q3": str(build_tiny_qwen3_moe(root / "q3")),
        "mx": str(build_tiny_mixtral(root / "mx", layers=1, seed=1, dtype=torch.float32)),
    }
    for model, scheme in PRE:
        dst = root / f"{model}-{scheme}"
        quantize_checkpoint(m[model], dst, scheme, progress=False)
        m[f"{model}-{scheme}"] = str(dst)
    # a pre-quantized checkpoint that lost one expert's down_proj scales
    bad = root / "q3-bad"
    quantize_checkpoint(m["q3"], bad, "mxfp4-mbs", progress=False)
    tamper_checkpoint(bad, drop=["model.layers.1.mlp.experts.5.down_proj.weight_scale"])
    m["q3-bad"] = str(bad)
    return m


@pytest.fixture(scope="module")
def moe_models(tmp_path_factory) -> dict[str, str]:
    return _build(tmp_path_factory.mktemp("moe"))


@pytest.fixture(scope="module")
def moe_run(moe_models, tmp_path_factory, subprocess_env) -> tuple[dict, str]:
    m = moe_models
    jobs = [_job(f"online-{mod}-{s}", m[mod], s) for mod, s in ONLINE]
    jobs += [_job(f"pre-{mod}-{s}", m[f"{mod}-{s}"], None) for mod, s in PRE]
    jobs.append(_job("pre-q3-bad", m["q3-bad"], None))
    return run_driver(jobs, tmp_path_factory.mktemp("moe-driver"), subprocess_env)


@pytest.mark.parametrize("model,scheme", ONLINE, ids=[f"{a}-{b}" for a, b in ONLINE])
@pytest.mark.vllm
def test_moe_online_matches_reference(moe_run, moe_models, model, scheme):
    """bf16/fp32 checkpoint + --quantization NAME: every expert quantized at load."""
    _check_against_reference(moe_run[0][f"online-{model}-{scheme}"], moe_models[model], scheme)


@pytest.mark.parametrize("model,scheme", PRE, ids=[f"{a}-{b}" for a, b in PRE])
@pytest.mark.vllm
def test_moe_offline_quantizer_output_matches_reference(moe_run, moe_models, model, scheme):
    """`mxplus quantize` output (per-expert tensors) loads with no flag and matches."""
    _check_against_reference(moe_run[0][f"pre-{model}-{scheme}"], moe_models[model], scheme)


@pytest.mark.vllm  # shares the engine run's models
def test_moe_router_stays_unquantized_in_checkpoint(moe_models):
    from safetensors import safe_open

    d = Path(moe_models["q3-mxfp4-mbs"])
    names = set()
    for f in d.glob("*.safetensors"):
        with safe_open(f, "pt") as h:
            names |= set(h.keys())
    assert "model.layers.0.mlp.gate.weight" in names
    assert "model.layers.0.mlp.experts.7.up_proj.weight_mbs" in names
    assert not any(n.startswith("model.layers.0.mlp.gate.weight_") for n in names)


@pytest.mark.vllm
def test_moe_missing_expert_tensor_is_named(moe_run):
    err = moe_run[0]["pre-q3-bad"]["error"]
    assert err and "down_proj.weight_scale" in err and "7 of 8" in err, err


@pytest.mark.vllm
@pytest.mark.slow
def test_moe_tp2_experts_sharded(tmp_path_factory, subprocess_env):
    """TP=2: w13 N-sharded, w2 K-sharded (128 per rank: whole macro blocks); online
    mxfp4-mbs and pre-quantized nvfp4 (per-expert global scales, activation row amax
    reduced over ranks) equal the unsharded reference."""
    from tiny_models import build_tiny_qwen3_moe

    from vllm_mxplus.checkpoint.quantizer import quantize_checkpoint

    root = tmp_path_factory.mktemp("moe-tp")
    src = str(
        build_tiny_qwen3_moe(
            root / "q3tp", hidden=256, moe_intermediate=256, layers=1, experts=4, seed=2
        )
    )
    quantize_checkpoint(src, root / "q3tp-nvfp4", "nvfp4", progress=False)
    jobs = [
        _job("tp-online-mbs", src, "mxfp4-mbs", tp=2),
        _job("tp-pre-nvfp4", str(root / "q3tp-nvfp4"), None, tp=2),
        # 64 of 128 expert columns per rank: not whole macro blocks -> clear error
        _job(
            "tp-bad",
            str(
                build_tiny_qwen3_moe(
                    root / "q3odd", hidden=256, moe_intermediate=128, layers=1, experts=4
                )
            ),
            "mxfp4-mbs",
            tp=2,
        ),
    ]
    res, log = run_driver(jobs, root, subprocess_env, tp=True)
    _check_against_reference(res["tp-online-mbs"], src, "mxfp4-mbs")
    _check_against_reference(res["tp-pre-nvfp4"], src, "nvfp4")
    # the worker's ValueError reaches the driver only as "Engine core initialization failed"
    assert res["tp-bad"]["error"], res["tp-bad"]
    assert (
        "model.layers.0.mlp.experts: expert intermediate size per TP partition 64 "
        "(moe_intermediate_size=128) is not a multiple of 128"
    ) in log


@pytest.mark.parametrize("scheme", ["mxfp4-mbs", "nvfp4"])
def test_moe_reference_equals_per_token_linears(scheme):
    """ops.moe_reference (all rows at once) == each (token, expert) through reference_linear
    with the scheme's fake-quant weights: batching over experts changes no number.
    (Runs no engine; fast.)"""
    import torch

    from vllm_mxplus.backends.reference.experts import moe_experts_reference
    from vllm_mxplus.backends.reference.linear import reference_linear
    from vllm_mxplus.formats import get_format, get_scheme, quantize

    torch.manual_seed(0)
    s = get_scheme(scheme)
    per_row = get_format(s.activation_format).has_global_scale
    e, h, i, m, k = 4, 96, 160, 33, 2  # K not a multiple of 128 on both GEMMs

    def fq(w):
        return quantize(w, s.weight_format).dequantize(torch.float32)

    gate, up, down = torch.randn(e, i, h), torch.randn(e, i, h), torch.randn(e, h, i)
    w13 = torch.stack([torch.cat([fq(gate[x]), fq(up[x])]) for x in range(e)])
    w2 = torch.stack([fq(down[x]) for x in range(e)])
    x = torch.randn(m, h)
    ids = torch.stack([torch.randperm(e)[:k] for _ in range(m)])
    wts = torch.softmax(torch.randn(m, k), -1)
    got = moe_experts_reference(
        x, w13, w2, wts, ids, s.activation_format, per_row=per_row, macro_block=s.macro_block
    )

    def lin(a: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        return reference_linear(
            a,
            w,
            None,
            s.activation_format,
            per_row=per_row,
            out_dtype=torch.float32,
            macro_block=s.macro_block,
        )

    want = torch.zeros(m, h)
    for t in range(m):
        for j in range(k):
            ex = int(ids[t, j])
            gu = lin(x[t : t + 1], w13[ex])
            act = torch.nn.functional.silu(gu[:, :i]) * gu[:, i:]
            want[t] += wts[t, j] * lin(act, w2[ex])[0]
    # fp32 GEMM accumulation order (rows batched vs one row) is the only difference
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-3)


@pytest.mark.vllm
def test_moe_execution_path_is_logged(moe_run):
    """Every scheme runs the packed C++ experts on CPU (the reference only without a
    compiler, with the reason)."""
    import shutil

    log = moe_run[1]
    for scheme in ("mxfp4-mbs", "nvfp4"):
        if shutil.which("c++"):
            assert (
                f"mxplus {scheme} MoE experts on cpu (capability None): backends cpu-packed" in log
            )
        else:
            assert f"mxplus {scheme} MoE experts on cpu (capability None): falling back" in log
