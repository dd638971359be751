"""vLLM + plugin vs the transformers fake-quant reference, per scheme and checkpoint kind.

Everything runs in fp32 (vLLM --dtype float32, transformers dtype=float32) so that the only
difference left is GEMM / attention accumulation order; greedy tokens must then be identical.
"""

from __future__ import annotations

import re
import shutil

import pytest
from integration_harness import MAX_TOKENS, PRE_SCHEMES, PROMPTS, hf_reference

from vllm_mxplus.formats import SCHEMES

pytestmark = pytest.mark.vllm

# W4A4 makes greedy decoding of a random tiny model chaotic (docs/numerics.md, QSNR): vLLM and
# transformers differ by fp32 accumulation order (~1e-6 nats on the chosen tokens), and now
# and then that noise moves one activation across a 4-bit rounding boundary (a "flip"), after
# which logprobs jump by ~0.1 nats and the sequences may part. So the check is:
# - before the first flip, tokens are identical and |dlogprob| <= LOGPROB_ATOL;
# - at least MIN_IDENTICAL of the prompts have no flip at all: all 32 tokens identical.
# A real bug (wrong scale, misplaced shard, wrong format) breaks every prompt at step 0.
LOGPROB_ATOL = 1e-4  # nats; observed <= 2.4e-6 before a flip
MIN_IDENTICAL = len(PROMPTS) - 1


def _check_against_reference(res: dict, model_dir: str, scheme: str) -> None:
    assert res.get("error") is None, res.get("trace", res.get("error"))
    ref_tokens, ref_lps = hf_reference(model_dir, scheme)
    assert len(res["tokens"]) == len(PROMPTS)
    identical = 0
    for i, prompt in enumerate(PROMPTS):
        toks, lps = res["tokens"][i], res["logprobs"][i]
        assert len(toks) == MAX_TOKENS
        flip = next(
            (
                j
                for j in range(MAX_TOKENS)
                if toks[j] != ref_tokens[i][j] or abs(lps[j] - ref_lps[i][j]) > LOGPROB_ATOL
            ),
            MAX_TOKENS,
        )
        assert flip > 0, (
            f"{scheme}: prompt {prompt!r} differs at the first token: "
            f"{toks[0]} vs {ref_tokens[i][0]}, logprob {lps[0]:.6f} vs "
            f"{ref_lps[i][0]:.6f}"
        )
        identical += flip == MAX_TOKENS and toks == ref_tokens[i]
    assert identical >= MIN_IDENTICAL, (
        f"{scheme}: only {identical}/{len(PROMPTS)} prompts token-identical to the reference"
    )


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


def test_missing_scale_tensor_is_named(driver_run):
    err = driver_run[0]["bad-missing"]["error"]
    assert err and "model.layers.0.self_attn.k_proj.weight_scale" in err and "missing" in err


def test_misshapen_scale_tensor_is_named(driver_run):
    err = driver_run[0]["bad-shape"]["error"]
    assert err and "model.layers.1.mlp.down_proj.weight_scale" in err
    assert "(256, 7)" in err


def test_flag_contradicting_checkpoint_is_refused(driver_run):
    err = driver_run[0]["bad-flag"]["error"]
    assert err and "mxfp4-mbs" in err and "nvfp4" in err


def test_unknown_scheme_name_is_refused(driver_run):
    err = driver_run[0]["bad-name"]["error"]
    assert err and "mxfp4-bogus" in err
