"""vLLM + plugin vs the transformers fake-quant reference, per scheme and checkpoint kind.

Everything runs in fp32 (vLLM --dtype float32, transformers dtype=float32) so that the only
difference left is GEMM / attention accumulation order; greedy tokens must then be identical.
"""

from __future__ import annotations

import re
import shutil
from pathlib import Path

import pytest
from integration_harness import (
    MAX_TOKENS,
    MB32,
    PRE_SCHEMES,
    PROMPTS,
    greedy_mismatch,
    hf_reference,
)

from vllm_mxplus.formats import MACRO_BLOCK, SCHEMES

pytestmark = pytest.mark.vllm


def _check_against_reference(
    res: dict, model_dir: str, scheme: str, macro_block: int = MACRO_BLOCK
) -> None:
    """Greedy tokens identical to transformers + fake-quant linears, up to the rare
    rounding flip that `greedy_mismatch` allows."""
    assert res.get("error") is None, res.get("trace", res.get("error"))
    ref_tokens, ref_lps = hf_reference(model_dir, scheme, macro_block)
    assert len(res["tokens"]) == len(PROMPTS)
    why = greedy_mismatch(res, ref_tokens, ref_lps, MAX_TOKENS)
    assert why is None, f"{scheme}: {why}"


@pytest.mark.parametrize("scheme", list(SCHEMES))
def test_online_quantization_matches_reference(driver_run, tiny_models, scheme):
    """bf16 checkpoint + --quantization NAME: weights quantized at load."""
    results, _ = driver_run
    _check_against_reference(results[f"online-{scheme}"], tiny_models["tiny256"], scheme)


@pytest.mark.parametrize("scheme", PRE_SCHEMES)
def test_prequantized_checkpoint_matches_reference(driver_run, tiny_models, scheme):
    """`mxplus quantize` output (docs/numerics.md, Packing and checkpoint layout), detected
    from config.json with no flag."""
    results, _ = driver_run
    _check_against_reference(results[f"pre-{scheme}"], tiny_models["tiny256"], scheme)


def _tensors(model_dir: str) -> dict:
    from safetensors.torch import load_file

    return {
        k: v for f in sorted(Path(model_dir).glob("*.safetensors")) for k, v in load_file(f).items()
    }


def test_smoothed_checkpoint_matches_reference(driver_run, tiny_models, tmp_path):
    """`mxplus quantize --smooth 0.5` output: its stored norms and weights are those of the
    smoothed model (the same tensors as quantizing that model, bit for bit), and vLLM serving
    it gives the greedy tokens of transformers running the smoothed model with fake-quant."""
    import torch
    from tiny_models import prequantize

    results, _ = driver_run
    sq, smoothed = _tensors(tiny_models["tiny256-sq"]), _tensors(tiny_models["tiny256-smoothed"])
    norm = "model.layers.0.input_layernorm.weight"
    assert torch.equal(sq[norm], smoothed[norm])
    assert not torch.equal(sq[norm], _tensors(tiny_models["tiny256"])[norm])
    again = _tensors(str(prequantize(tiny_models["tiny256-smoothed"], tmp_path / "q", "mxfp4-mbs")))
    assert sq.keys() == again.keys()
    assert all(torch.equal(sq[k], again[k]) for k in sq), "not the smoothed model's tensors"
    _check_against_reference(
        results["pre-sq-mxfp4-mbs"], tiny_models["tiny256-smoothed"], "mxfp4-mbs"
    )


def test_macro_block_32_checkpoint_matches_reference(driver_run, tiny_models):
    """`mxplus quantize --macro-block 32`: the checkpoint records it, its MBS bytes are one
    per 32 elements, and vLLM (no flag) serves it with the greedy tokens of transformers with
    fake-quant at macro block 32; at 128 the reference's tokens differ."""
    import json

    results, _ = driver_run
    d = Path(tiny_models["tiny256-mb32"])
    qcfg = json.loads((d / "config.json").read_text())["quantization_config"]
    assert qcfg["macro_block_size"] == MB32
    mbs = _tensors(str(d))["model.layers.0.mlp.down_proj.weight_mbs"]
    assert mbs.shape[-1] == 512 // MB32  # down_proj K = intermediate 512
    _check_against_reference(
        results["pre-mb32-mxfp4-mbs"], tiny_models["tiny256"], "mxfp4-mbs", MB32
    )
    assert (
        hf_reference(tiny_models["tiny256"], "mxfp4-mbs", MB32)[0]
        != hf_reference(tiny_models["tiny256"], "mxfp4-mbs")[0]
    )


def test_online_macro_block_from_hf_overrides_matches_reference(driver_run, tiny_models):
    """`--quantization mxfp4-mbs --hf-overrides '{"quantization_config": {"quant_method":
    "mxfp4-mbs", "macro_block_size": 32}}'`: a bf16 checkpoint quantized at load with macro
    block 32 serves the reference's tokens at 32 (which differ from those at 128)."""
    results, _ = driver_run
    _check_against_reference(
        results["online-mb32-mxfp4-mbs"], tiny_models["tiny256"], "mxfp4-mbs", MB32
    )


def test_unknown_online_option_is_refused_by_name(driver_run):
    results, _ = driver_run
    err = results["bad-option"].get("error") or ""
    assert "'macro_block' is not an option of --quantization mxfp4-mbs" in err, err
    assert "macro_block_size" in err  # what the option is called


def test_torch_compile_mode_matches_reference(driver_run, tiny_models):
    """vLLM's default (compiled, not --enforce-eager) mode traces our ops through their fake
    implementations and runs them: same tokens as the reference."""
    results, log = driver_run
    assert log.count("Warming up model for the compilation") == 1  # only this job compiles
    _check_against_reference(results["compiled-mxfp4-mbs"], tiny_models["tiny256"], "mxfp4-mbs")


@pytest.mark.parametrize("kind", ["online320", "pre320"])
def test_hidden_size_not_multiple_of_128(driver_run, tiny_models, kind):
    """hidden 320 / intermediate 576: every linear has a partial macro block."""
    results, _ = driver_run
    _check_against_reference(results[f"{kind}-mxfp4-mbs"], tiny_models["tiny320"], "mxfp4-mbs")


def test_backend_choice_logged_once_per_scheme(driver_run):
    """The selector logs its choice once, not once per layer or per engine."""
    _, log = driver_run
    for scheme in SCHEMES:
        lines = re.findall(rf"mxplus {re.escape(scheme)} on cpu .*", log)
        assert len(lines) == 1, (scheme, lines)
        if shutil.which("c++") is None:  # no compiler: the reference, with the reason
            assert "no C++ compiler found" in lines[0], lines[0]
        else:  # the C++ kernels serve every scheme and M: no fp32 weight copy is kept
            assert lines[0].endswith("backends cpu-packed"), lines[0]


@pytest.mark.parametrize(
    "job,fragments",
    [
        # a missing or misshapen checkpoint tensor is named
        ("bad-missing", ("model.layers.0.self_attn.k_proj.weight_scale", "missing")),
        ("bad-shape", ("model.layers.1.mlp.down_proj.weight_scale", "(256, 7)")),
        # a flag contradicting the checkpoint is refused, naming both methods (vLLM's own
        # ModelConfig check fires before any loader; the plugin's "drop --quantization"
        # message, for paths that reach its loader, is tested in test_errors.py)
        ("bad-flag", ("mxfp4-mbs", "nvfp4")),
        ("bad-name", ("mxfp4-bogus",)),  # an unknown scheme name is refused
    ],
)
def test_refusal_names_the_problem(driver_run, job, fragments):
    err = driver_run[0][job]["error"]
    assert err and all(f in err for f in fragments), err
