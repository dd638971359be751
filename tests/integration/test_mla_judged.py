"""MLA judged numerically: the matrix's tiny DeepSeek-V2 served by vLLM (fp32, CPU) against the
float64 reference of mla_reference.py, unquantized (the control), with an MBS and two non-MBS
schemes online, and from an `mxplus quantize` checkpoint (mla_judge.py says how and why).

All engines run in one driver process (vllm_jobs), one after another.
"""

from __future__ import annotations

import pytest
from integration_harness import run_driver
from mla_judge import (
    ENGINE_OPTIONS,
    LOGPROB_ATOL,
    REFERENCE_MLA_BACKEND,
    ROUNDING_HEADROOM,
    judge_mla,
    mla_job,
    rounding_floor,
)
from mla_reference import mla_greedy
from model_matrix import PROMPTS, TOKENS
from tiny_models import ARCHS, build_tiny, prequantize

ARCH = "deepseek_v2"
SEED = list(ARCHS).index(ARCH)  # the matrix's model (model_matrix.build_all seeds by index)
ONLINE = ("mxfp4-mbs", "mxfp4-16-oas", "nvfp4")  # MBS-H; E8M0 block 16 OAS; E4M3 + global
PRE = "mxfp4-mbs"


@pytest.fixture(scope="module")
def model(tmp_path_factory) -> str:
    return str(build_tiny(ARCH, tmp_path_factory.mktemp("mla") / ARCH, seed=SEED))


@pytest.mark.slow
def test_reference_agrees_with_transformers(model):
    """Two independent float implementations of the same model: the float64 reference and
    transformers (fp32) give the same greedy tokens and logprobs, unquantized and with
    kv_b_proj weight-only W4A4, so the reference computes DeepSeek-V2 as written."""
    from hf_reference import hf_greedy

    for scheme in (None, PRE):
        ref = mla_greedy(model, scheme, PROMPTS, TOKENS)
        hf = hf_greedy(model, scheme, PROMPTS, TOKENS)
        assert ref[0] == hf[0], scheme
        gap = rounding_floor({"tokens": hf[0], "logprobs": hf[1]}, ref)
        assert gap <= LOGPROB_ATOL / ROUNDING_HEADROOM, (scheme, gap)


def test_vllm_cpu_rotary_misrotates_a_multihead_query():
    """What the engine options work around: vLLM 0.32's CPU rotary op rotates a 3-D query
    [tokens, heads, d] as tokens x heads one-head rows, row t*heads + h at positions[t*heads
    + h]; the one-head key is right. Fails once vLLM fixes it: then drop ENGINE_OPTIONS."""
    import torch
    from vllm.config import VllmConfig, set_current_vllm_config
    from vllm.model_executor.layers.rotary_embedding import get_rope

    with set_current_vllm_config(VllmConfig()):
        rope = get_rope(
            64,
            max_position=64,
            rope_parameters={"rope_theta": 10000.0, "rope_type": "default"},
            is_neox_style=False,
            dtype=torch.float32,
        )
    heads, tokens = 4, 3
    pos = torch.arange(tokens)
    q = torch.randn(tokens, heads, 96, generator=torch.Generator().manual_seed(0))
    k = torch.randn(tokens, 1, 64, generator=torch.Generator().manual_seed(1))
    want_q, want_k = rope.forward_native(pos, q[..., 32:].clone(), k.clone())
    got_q, got_k = rope.forward_cpu(pos, q[..., 32:].clone(), k.clone())  # a view, as MLA's
    torch.testing.assert_close(got_k, want_k)
    # row 1 (token 0, head 1) is rotated at positions[1] = 1 instead of 0
    at_1 = rope.forward_native(pos[1:2], q[0:1, 1:2, 32:].clone(), None)[0]
    torch.testing.assert_close(got_q[0:1, 1:2], at_1)
    assert not torch.allclose(got_q[0, 1], want_q[0, 1], atol=1e-3)


@pytest.mark.parametrize("amx", [False, True], ids=["no-amx", "amx-tiles"])
def test_engine_options_pick_the_reference_mla_backend_on_every_cpu(monkeypatch, amx):
    """The judged engines name vLLM's CPU_MLA backend, so a CPU with AMX tiles (where vLLM
    would pick its bf16-only AMX MLA backend and refuse fp32) serves them like any other CPU;
    without the option an AMX host gets AMX_MLA. The host's AMX is simulated
    (torch.cpu._is_amx_tile_supported), so this runs on every x86 CPU."""
    import torch
    from vllm.config import AttentionConfig
    from vllm.platforms.cpu import CpuPlatform
    from vllm.platforms.interface import CpuArchEnum
    from vllm.v1.attention.backends.registry import AttentionBackendEnum
    from vllm.v1.attention.selector import AttentionSelectorConfig

    monkeypatch.setattr(torch.cpu, "_is_amx_tile_supported", lambda: amx)
    monkeypatch.setattr(
        CpuPlatform, "get_cpu_architecture", classmethod(lambda cls: CpuArchEnum.X86)
    )
    sel = AttentionSelectorConfig(
        head_size=576, dtype=torch.float32, kv_cache_dtype=None, block_size=16, use_mla=True
    )
    named = AttentionConfig(**ENGINE_OPTIONS["attention_config"]).backend
    assert named == AttentionBackendEnum.CPU_MLA and REFERENCE_MLA_BACKEND["backend"] == "CPU_MLA"
    assert CpuPlatform.get_attn_backend_cls(named, sel) == AttentionBackendEnum.CPU_MLA.get_path()
    default = CpuPlatform.get_attn_backend_cls(None, sel)
    want = AttentionBackendEnum.AMX_MLA if amx else AttentionBackendEnum.CPU_MLA
    assert default == want.get_path()


@pytest.fixture(scope="module")
def engines(model, tmp_path_factory, subprocess_env) -> dict:
    pre = prequantize(model, tmp_path_factory.mktemp("mla-pre") / PRE, PRE)
    jobs = [mla_job("control", model, None, PROMPTS, TOKENS)]
    # the engine as the matrix ran it: vLLM's CPU rotary op (still the reference MLA backend)
    jobs.append({k: v for k, v in jobs[0].items() if k != "compilation_config"} | {"id": "cpu-op"})
    jobs += [mla_job(f"online-{s}", model, s, PROMPTS, TOKENS) for s in ONLINE]
    jobs.append(mla_job(f"pre-{PRE}", pre, None, PROMPTS, TOKENS))
    results, log = run_driver(
        jobs, tmp_path_factory.mktemp("mla-driver"), subprocess_env, timeout=1500
    )
    missing = [j["id"] for j in jobs if j["id"] not in results]
    assert not missing, f"driver produced no result for {missing}; log tail:\n{log[-3000:]}"
    return results


@pytest.mark.vllm
def test_control_agrees_to_fp32_rounding(engines, model):
    """Unquantized vLLM (with ENGINE_OPTIONS) equals the float64 reference up to its fp32
    rounding, well inside the tolerance the quantized runs are judged with."""
    res = engines["control"]
    assert judge_mla(res, model, None, PROMPTS, TOKENS) == ("ok", "")
    floor = rounding_floor(res, mla_greedy(model, None, PROMPTS, TOKENS))
    assert floor <= LOGPROB_ATOL / ROUNDING_HEADROOM, floor


@pytest.mark.vllm
def test_cpu_rotary_op_is_what_the_matrix_saw(engines, model):
    """Without the torch rotary the unquantized engine already parts from the reference at the
    first token (the matrix's "vLLM and transformers differ without quantization")."""
    status, why = judge_mla(engines["cpu-op"], model, None, PROMPTS, TOKENS)
    assert status == "mismatch" and "first token" in why, (status, why)


@pytest.mark.vllm
@pytest.mark.parametrize("job", [f"online-{s}" for s in ONLINE] + [f"pre-{PRE}"])
def test_quantized_mla_matches_reference(engines, model, job):
    scheme = job.split("-", 1)[1]
    assert judge_mla(engines[job], model, scheme, PROMPTS, TOKENS) == ("ok", "")


@pytest.mark.vllm
def test_a_wrong_kv_b_proj_rule_is_caught(engines, model):
    """The judgement can fail where MLA numerics could go wrong: a reference that quantizes
    kv_b_proj's input (W4A4 like the other linears) parts from vLLM at the first token."""
    ref = mla_greedy(model, PRE, PROMPTS, TOKENS, weight_only=())
    res = engines[f"online-{PRE}"]
    gaps = [abs(lps[0] - r[0]) for lps, r in zip(res["logprobs"], ref[1])]
    assert min(gaps) > 10 * LOGPROB_ATOL, gaps
