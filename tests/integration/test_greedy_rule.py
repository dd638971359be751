"""The flip rule of `integration_harness.greedy_mismatch`, on hand-made results: what it lets
through (a late flip in fewer than half the prompts) and what it fails (any difference at the
first token, a decode-path bug that parts every prompt at step 1, flips in most prompts)."""

from __future__ import annotations

from integration_harness import LOGPROB_ATOL, greedy_mismatch

N = 6
REF_TOKENS = [[10 + i, 20, 30, 40, 50, 60] for i in range(4)]
REF_LPS = [[-1.0, -1.5, -2.0, -2.5, -3.0, -3.5] for _ in range(4)]


def _result(flips: dict[int, int], token_changes: bool = False) -> dict:
    """The reference's result with prompt i parted at step flips[i] (logprob off by 0.1 nats,
    and the tokens after it changed when token_changes)."""
    toks = [list(t) for t in REF_TOKENS]
    lps = [list(lp) for lp in REF_LPS]
    for i, j in flips.items():
        lps[i][j] += 0.1
        if token_changes:
            toks[i][j:] = [t + 1 for t in toks[i][j:]]
    return {"tokens": toks, "logprobs": lps}


def test_identical_passes():
    assert greedy_mismatch(_result({}), REF_TOKENS, REF_LPS, N) is None


def test_noise_below_the_tolerance_passes():
    res = _result({})
    res["logprobs"][0][0] += LOGPROB_ATOL / 2
    assert greedy_mismatch(res, REF_TOKENS, REF_LPS, N) is None


def test_late_flips_in_half_the_prompts_pass():
    assert greedy_mismatch(_result({1: 3}), REF_TOKENS, REF_LPS, N) is None
    assert greedy_mismatch(_result({1: 3, 2: 5}, True), REF_TOKENS, REF_LPS, N) is None


def test_flips_in_most_prompts_fail():
    why = greedy_mismatch(_result({0: 2, 1: 3, 2: 5}), REF_TOKENS, REF_LPS, N)
    assert why == "only 1/4 prompts token-identical to the reference"


def test_a_difference_at_the_first_token_fails():
    why = greedy_mismatch(_result({3: 0}), REF_TOKENS, REF_LPS, N)
    assert why is not None and why.startswith("prompt 3 differs at the first token")


def test_a_decode_bug_parting_every_prompt_at_step_one_fails():
    why = greedy_mismatch(_result({i: 1 for i in range(4)}, True), REF_TOKENS, REF_LPS, N)
    assert why == "only 0/4 prompts token-identical to the reference"


def test_a_short_result_fails():
    res = _result({})
    res["tokens"][2] = res["tokens"][2][:-1]
    assert greedy_mismatch(res, REF_TOKENS, REF_LPS, N) == "prompt 2: 5 tokens, expected 6"
