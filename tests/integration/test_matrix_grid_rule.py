"""The bf16 and fp32 flip rules of matrix_grid.py on made-up measurements (fast; the grid
itself is slow), and the flip rule on the grid's Phi-3 checkpoint without vLLM."""

from __future__ import annotations

from matrix_grid import (
    BF16_MAX_GAP,
    BF16_MEAN_GAP,
    FLIP_MAX_SENSITIVITY,
    bf16_mismatch,
    flip_mismatch,
)
from model_matrix import PROMPTS, TOKENS


def _res() -> dict:
    return {"tokens": [[5] * TOKENS for _ in PROMPTS]}


def _gaps(value: float = 0.0) -> list[list[float]]:
    return [[value] * TOKENS for _ in PROMPTS]


def test_near_ties_pass():
    gaps = _gaps()
    gaps[0][3] = BF16_MAX_GAP  # one flip as large as allowed, the rest agree
    assert bf16_mismatch(_res(), gaps) is None


def test_one_unlikely_token_fails():
    gaps = _gaps()
    gaps[2][7] = BF16_MAX_GAP + 0.01
    assert "prompt 2 token 7" in bf16_mismatch(_res(), gaps)


def test_many_moderate_flips_fail_on_the_mean():
    why = bf16_mismatch(_res(), _gaps(BF16_MEAN_GAP + 0.01))
    assert why is not None and "mean gap" in why


def test_a_short_continuation_fails():
    res = _res()
    res["tokens"][1] = res["tokens"][1][:-1]
    assert "prompt 1" in bf16_mismatch(res, _gaps())


# The fp32 flip rule (matrix_grid.flip_mismatch) on made-up evidence: prompt 3 near a
# rounding boundary (S = 0.2 nats), the others not (S ~ 1e-6, as measured).
S_NEAR, S_FAR = 0.2, 2e-6


def _evidence(gap3: float = 0.0, dlp3: float = 0.0) -> tuple[dict, dict]:
    """(engine result, flip_evidence-like measurements); prompt 3 token 0 is the flip."""
    res = {
        "tokens": [[5] * TOKENS for _ in PROMPTS],
        "logprobs": [[-1.0] * TOKENS for _ in PROMPTS],
    }
    ev = {
        "gaps": [[0.0] * TOKENS for _ in PROMPTS],
        "logprobs": [[-1.0] * TOKENS for _ in PROMPTS],
        "sensitivity": [S_FAR] * (len(PROMPTS) - 1) + [S_NEAR],
    }
    ev["gaps"][3][0] = gap3
    ev["logprobs"][3][0] = -1.0 - dlp3
    return res, ev


def test_flip_within_rounding_sensitivity_passes():
    # a flip 2 S below the reference's best, its logprob S off: what a rounding variant can do
    assert flip_mismatch(*_evidence(gap3=2 * S_NEAR, dlp3=S_NEAR)) is None


def test_flip_beyond_rounding_sensitivity_fails():
    why = flip_mismatch(*_evidence(gap3=2 * S_NEAR + 0.01))
    assert why is not None and "prompt 3 token 0" in why and "sensitivity" in why


def test_logprob_beyond_rounding_sensitivity_fails():
    why = flip_mismatch(*_evidence(dlp3=S_NEAR + 0.01))
    assert why is not None and "logprob" in why


def test_flip_where_the_reference_is_not_near_a_boundary_fails():
    res, ev = _evidence()
    ev["gaps"][1][4] = 0.01  # prompt 1: S ~ 1e-6, so only the token-for-token rule
    assert "prompt 1 token 4" in flip_mismatch(res, ev)
    res, ev = _evidence()
    res["logprobs"][0][2] += 0.001  # same token, logprob off by more than S + LOGPROB_ATOL
    assert "prompt 0 token 2" in flip_mismatch(res, ev)


def test_reference_too_sensitive_to_judge_fails():
    res, ev = _evidence()
    ev["sensitivity"][3] = FLIP_MAX_SENSITIVITY + 0.01
    assert "judged up to" in flip_mismatch(res, ev)


def test_flip_rule_short_continuation_fails():
    res, ev = _evidence()
    res["tokens"][2] = res["tokens"][2][:-1]
    assert "prompt 2" in flip_mismatch(res, ev)


def test_flip_rule_on_the_tiny_phi3(tmp_path):
    """flip_reference's variants on the grid's Phi-3 checkpoint (no vLLM, ~15 s): the fp32
    reference's flip of docs/models.md (prompt 3's first token: fp32 189, float64 79), and the
    rule passes float64's own greedy tokens and logprobs (another rounding of the same model)
    and fails a doubled weight's (a broken engine)."""
    from flip_reference import greedy_with_logprobs, load_variant, wrong_weight_model
    from matrix_grid import flip_evidence
    from tiny_models import ARCHS, build_tiny

    md = str(build_tiny("phi3", tmp_path / "phi3", seed=list(ARCHS).index("phi3")))
    runs = {
        "fp32": load_variant(md, "nvfp4", "fp32"),
        "fp64": load_variant(md, "nvfp4", "fp64"),
        "broken": wrong_weight_model(md, "nvfp4", "scale2"),
    }
    res = {}
    for name, model in runs.items():
        out = [greedy_with_logprobs(model, p, TOKENS) for p in PROMPTS]
        res[name] = {"tokens": [t for t, _ in out], "logprobs": [lp for _, lp in out]}
    assert res["fp64"]["tokens"][3][0] == 79  # float64: the same on every host
    # fp32's flip (189) depends on the host's fp32 GEMM summation order: seen on the Intel Xeon
    # the study ran on, not on an AMD EPYC Zen 3 (AVX2), where fp32 agrees with float64
    assert res["fp32"]["tokens"][3][0] in (189, 79)
    assert res["fp32"]["tokens"][:3] == res["fp64"]["tokens"][:3]
    assert flip_mismatch(res["fp64"], flip_evidence(md, "nvfp4", res["fp64"]["tokens"])) is None
    broken = flip_mismatch(res["broken"], flip_evidence(md, "nvfp4", res["broken"]["tokens"]))
    assert broken is not None and "token 0" in broken
