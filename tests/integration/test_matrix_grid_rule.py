"""The bf16 rule of matrix_grid.py on made-up gaps (fast; the grid itself is slow)."""

from __future__ import annotations

from matrix_grid import BF16_MAX_GAP, BF16_MEAN_GAP, bf16_mismatch
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
