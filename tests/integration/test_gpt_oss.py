"""gpt-oss served by vLLM with every scheme, and the serve-time `ignore` option.

A tiny random gpt-oss (tiny_models.ARCHS["gpt_oss"]: 4 experts top-2, expert biases, the
clamped interleaved swigluoai, attention sinks, sliding + full attention, hidden 192) in fp32:
- online (`--quantization NAME`), every scheme: token-identical to transformers with every
  linear and expert fake-quantized (hf_gpt_oss.py), by the rule of `greedy_mismatch`;
- from `mxplus quantize` checkpoints, every scheme: the [E, K, N] expert stacks quantized
  transposed (checkpoint/rules.py) and loaded per expert (integration/gpt_oss_model.py), the
  same reference; token- and logprob-identical to the online engine where the offline and
  online weights are the same numbers (every scheme's RTN / MBS-D);
- a checkpoint whose experts `--ignore` kept in bf16 serves them unquantized;
- `--hf-overrides '{"quantization_config": {"quant_method": "mxfp4-mbs", "ignore":
  ["re:.*experts.*"]}}'`: the experts stay unquantized, so the served tokens and logprobs are
  those of the `mxplus quantize` checkpoint (only the non-expert layers quantized, the same
  numbers) and of that reference; a bad pattern and a pattern that splits a fused layer are
  refused by name.
All engines run in one driver process.
"""

from __future__ import annotations

import pytest
from hf_gpt_oss import gpt_oss_experts_fake_quant
from integration_harness import gen_job, greedy_mismatch, run_driver
from model_matrix import PROMPTS, TOKENS
from tiny_models import build_tiny, prequantize

SCHEMES = ["mxfp4-ocp", "mxplus", "mxfp4-16-oas", "mxfp4-mbs-s", "mxfp4-mbs", "nvfp4"]
KEEP_EXPERTS = ["re:.*experts.*"]
_HF: dict = {}


def _options(**kw) -> dict:
    return {"quantization_config": {"quant_method": "mxfp4-mbs", **kw}}


def _job(job_id: str, model: str, quantization: str | None, **kw) -> dict:
    return {**gen_job(job_id, model, quantization), "prompts": PROMPTS, "max_tokens": TOKENS, **kw}


def _reference(src: str, scheme: str, quantized_experts: bool):
    from hf_reference import hf_greedy

    key = (scheme, quantized_experts)
    if key not in _HF:
        if quantized_experts:
            with gpt_oss_experts_fake_quant():
                _HF[key] = hf_greedy(src, scheme, PROMPTS, TOKENS)
        else:  # transformers' GptOssExperts untouched: linears only
            _HF[key] = hf_greedy(src, scheme, PROMPTS, TOKENS)
    return _HF[key]


@pytest.fixture(scope="module")
def gpt_oss(tmp_path_factory, subprocess_env) -> tuple[dict, str, str]:
    root = tmp_path_factory.mktemp("gpt-oss")
    src = str(build_tiny("gpt_oss", root / "gpt-oss", seed=11))
    jobs = [_job(f"online-{s}", src, s) for s in SCHEMES]
    for s in SCHEMES:
        jobs.append(_job(f"pre-{s}", str(prequantize(src, root / f"gpt-oss-{s}", s)), None))
    kept = prequantize(src, root / "gpt-oss-kept", "mxfp4-mbs", ignore=KEEP_EXPERTS)
    jobs.append(_job("pre-kept-experts", str(kept), None))
    jobs += [
        _job("ignore-experts", src, "mxfp4-mbs", hf_overrides=_options(ignore=KEEP_EXPERTS)),
        _job("ignore-bad-regex", src, "mxfp4-mbs", hf_overrides=_options(ignore=["re:("])),
        _job("ignore-part", src, "mxfp4-mbs", hf_overrides=_options(ignore=["k_proj"])),
    ]
    results, log = run_driver(jobs, root, subprocess_env, timeout=1800)
    return results, log, src


def _ok(res: dict, ref) -> None:
    assert res.get("error") is None, res.get("trace", res.get("error"))
    why = greedy_mismatch(res, *ref, TOKENS)
    assert why is None, why


@pytest.mark.vllm
@pytest.mark.parametrize("scheme", SCHEMES)
def test_online_every_scheme_matches_reference(gpt_oss, scheme):
    """Experts quantized at load (swigluoai, biases, one NVFP4 global scale per expert's
    gate_up and down), the C++ expert kernels on the CPU."""
    results, _, src = gpt_oss
    _ok(results[f"online-{scheme}"], _reference(src, scheme, quantized_experts=True))


@pytest.mark.vllm
@pytest.mark.parametrize("scheme", SCHEMES)
def test_offline_checkpoint_every_scheme_matches_reference(gpt_oss, scheme):
    """The checkpoint's experts are quantized: the reference with fake-quantized experts, and
    the online engine's very tokens and logprobs (the same weights, stored and reloaded)."""
    results, _, src = gpt_oss
    pre, online = results[f"pre-{scheme}"], results[f"online-{scheme}"]
    _ok(pre, _reference(src, scheme, quantized_experts=True))
    assert pre["tokens"] == online["tokens"]
    for a, b in zip(pre["logprobs"], online["logprobs"]):
        assert a == pytest.approx(b, abs=1e-5)


@pytest.mark.vllm
def test_experts_run_the_cpu_kernels(gpt_oss):
    import shutil

    log = gpt_oss[1]
    if shutil.which("c++"):
        assert "mxplus nvfp4 MoE experts on cpu (capability None): backends cpu-packed" in log
    assert "does not support the expert activation" not in log


@pytest.mark.vllm
def test_ignore_experts_serves_the_non_expert_quantization(gpt_oss):
    """ignore=["re:.*experts.*"]: the same tokens and logprobs as the checkpoint whose
    experts `mxplus quantize --ignore` kept, and the reference with unquantized experts; not
    those of the fully quantized model."""
    results, _, src = gpt_oss
    got, pre = results["ignore-experts"], results["pre-kept-experts"]
    assert got.get("error") is None, got.get("trace", got.get("error"))
    assert got["tokens"] == pre["tokens"]
    for a, b in zip(got["logprobs"], pre["logprobs"]):
        assert a == pytest.approx(b, abs=1e-5)
    _ok(got, _reference(src, "mxfp4-mbs", quantized_experts=False))
    assert got["logprobs"] != results["online-mxfp4-mbs"]["logprobs"]


@pytest.mark.vllm
def test_ignore_errors_name_the_option(gpt_oss):
    results = gpt_oss[0]
    bad = results["ignore-bad-regex"].get("error") or ""
    assert "ignore" in bad and "'re:('" in bad and "invalid regular expression" in bad, bad
    part = results["ignore-part"].get("error") or ""
    assert "qkv_proj" in part and "k_proj" in part and "q_proj" in part, part
    assert "ignore all of its parts or none" in part, part


# ------------------------------------------------------------ the option, without engines
def _config(**options):
    from vllm_mxplus.integration.config import CONFIG_CLASSES

    cls = CONFIG_CLASSES["mxfp4-mbs"]
    cfg = cls.from_config({"quant_method": "mxfp4-mbs", **options})
    cfg.packed_modules_mapping = {"qkv_proj": ["q_proj", "k_proj", "v_proj"]}
    return cfg


def test_ignore_uses_the_offline_matcher():
    """The patterns of `mxplus quantize --ignore`: re: (re.search), globs on the name or a
    dotted suffix; a fused linear is kept when all its parts match."""
    cfg = _config(ignore=["re:.*experts.*", "layers.1.*", "o_proj"])
    assert not cfg.is_checkpoint_quantized
    assert cfg.experts_kept("model.layers.0.mlp.experts")
    assert cfg.is_skipped("model.layers.1.self_attn.qkv_proj")
    assert cfg.is_skipped("model.layers.0.self_attn.o_proj")
    assert not cfg.is_skipped("model.layers.0.self_attn.qkv_proj")
    assert _config(ignore=["q_proj", "k_proj", "v_proj"]).is_skipped("model.layers.0.attn.qkv_proj")
    assert not _config().experts_kept("model.layers.0.mlp.experts")


def test_ignore_part_of_a_fused_layer_is_refused():
    with pytest.raises(ValueError, match=r"matches model\.layers\.0\.attn\.q_proj but not"):
        _config(ignore=["q_proj"]).is_skipped("model.layers.0.attn.qkv_proj")


@pytest.mark.parametrize(
    "bad,match",
    [
        (["re:("], r"ignore: --ignore 're:\(': invalid regular expression"),
        ("experts", "ignore must be a list of strings"),
        ([3], "ignore must be a list of strings"),
    ],
)
def test_bad_ignore_option_is_named(bad, match):
    with pytest.raises(ValueError, match=match):
        _config(ignore=bad)


def test_checkpoint_that_keeps_expert_stacks_serves_them_unquantized():
    """`mxplus quantize` on gpt-oss lists the fused stacks (after vLLM's name mapper:
    experts.w13_weight / w2_weight); one of the two is not enough."""
    from vllm_mxplus.integration.config import CONFIG_CLASSES

    cls = CONFIG_CLASSES["mxfp4-mbs"]
    stacks = ["model.layers.0.mlp.experts.w13_weight", "model.layers.0.mlp.experts.w2_weight"]
    assert cls(True, stacks).experts_kept("model.layers.0.mlp.experts")
    assert not cls(True, stacks).experts_kept("model.layers.1.mlp.experts")
    assert not cls(True, stacks[:1]).experts_kept("model.layers.0.mlp.experts")
    hf = ["model.layers.0.mlp.experts.gate_up_proj", "model.layers.0.mlp.experts.down_proj"]
    assert cls(True, hf).experts_kept("model.layers.0.mlp.experts")


def test_unsupported_activation_points_at_the_ignore_option():
    import types

    import torch

    from vllm_mxplus.integration.fused_moe import MxplusFusedMoEMethod

    method = MxplusFusedMoEMethod.__new__(MxplusFusedMoEMethod)  # no vLLM MoE config needed
    method.quant_config = _config()
    method.scheme = method.quant_config.scheme
    method.moe = types.SimpleNamespace(activation=types.SimpleNamespace(value="relu2_no_mul"))
    layer = types.SimpleNamespace(layer_name="model.layers.0.mlp.experts")
    want = (
        r"model\.layers\.0\.mlp\.experts: .* 'relu2_no_mul' \(supported: silu, gelu, "
        r"gelu_tanh, swigluoai\); .* --hf-overrides '\{\"quantization_config\": "
        r"\{\"quant_method\": \"mxfp4-mbs\", \"ignore\": \[\"re:\.\*experts\.\*\"\]\}\}'"
    )
    with pytest.raises(NotImplementedError, match=want):
        method.create_weights(layer, 4, 64, 64, torch.float32, weight_loader=None)


@pytest.mark.vllm
@pytest.mark.slow
def test_tp2_matches_the_unsharded_reference(gpt_oss, tmp_path_factory, subprocess_env):
    """TP=2, online nvfp4 and two checkpoints: w13 N-sharded by whole gate / up pairs (vLLM's
    gpt-oss loader online, integration/fused_moe.py's per-expert loader for a checkpoint), w2
    K-sharded (with MX+'s block-max indices; the MBS schemes' 128-wide macro blocks do not
    split this model's intermediate 128 over two ranks, refused by name), w2_bias on rank 0 only, each expert's NVFP4
    global scale from the whole weight (max over ranks online, stored offline), the down
    projection's activation rows with the whole row's global scale."""
    from pathlib import Path

    src = gpt_oss[2]
    pre = {s: str(Path(src).parent / f"gpt-oss-{s}") for s in ("nvfp4", "mxplus")}
    res, _ = run_driver(
        [_job("tp-nvfp4", src, "nvfp4", tp=2)]
        + [_job(f"tp-pre-{s}", path, None, tp=2) for s, path in pre.items()],
        tmp_path_factory.mktemp("gpt-oss-tp"),
        subprocess_env,
        tp=True,
    )
    _ok(res["tp-nvfp4"], _reference(src, "nvfp4", quantized_experts=True))
    for s in pre:
        _ok(res[f"tp-pre-{s}"], _reference(src, s, quantized_experts=True))
