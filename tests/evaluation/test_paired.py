"""vllm_mxplus.evaluation.paired: paired tests between rows on the same items."""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pytest

from vllm_mxplus.evaluation import paired
from vllm_mxplus.evaluation.worker import per_item_metrics


def test_mcnemar_exact_against_the_binomial_tail() -> None:
    a = np.array([1] * 9 + [0] * 1 + [1] * 20 + [0] * 20, dtype=float)
    b = np.array([0] * 9 + [1] * 1 + [1] * 20 + [0] * 20, dtype=float)
    only_a, only_b, p = paired.mcnemar(a, b)
    assert (only_a, only_b) == (9, 1)
    # P(X <= 1) for X ~ Bin(10, 1/2), doubled: 2 * 11 / 1024
    assert p == pytest.approx(2 * 11 / 1024)
    assert paired.mcnemar(a, a) == (0, 0, 1.0)


def test_holm_adjustment() -> None:
    # sorted p 0.01, 0.02, 0.04 -> 0.03, 0.04, 0.04 (monotone), back in input order
    assert paired.holm([0.04, 0.01, 0.02]) == pytest.approx([0.04, 0.03, 0.04])
    assert paired.holm([0.5, 0.9]) == pytest.approx([1.0, 1.0])


def test_bootstrap_separates_a_real_difference_from_none() -> None:
    rng = np.random.default_rng(1)
    base = [rng.integers(0, 2, 200).astype(float) for _ in range(3)]
    better = []
    for x in base:  # flip 30 % of the wrong items to right: a real, paired gain
        y = x.copy()
        wrong = np.flatnonzero(y == 0)
        y[wrong[: int(0.3 * len(wrong))]] = 1.0
        better.append(y)
    gain = paired.paired_bootstrap(better, base, iters=2000, seed=0)
    expected = float(np.mean([(y - x).mean() for x, y in zip(base, better, strict=True)]))
    assert gain.diff == pytest.approx(expected)
    assert gain.lo > 0 and gain.p < 0.01
    noise = [rng.permutation(x) for x in base]  # same marginal rates, no pairing
    same = paired.paired_bootstrap(base, base, iters=500, seed=0)
    assert same.diff == 0 and same.p == 1.0
    shuffled = paired.paired_bootstrap(noise, base, iters=2000, seed=0)
    assert shuffled.lo < 0 < shuffled.hi and shuffled.p > 0.05
    with pytest.raises(ValueError, match="aligned"):
        paired.paired_bootstrap(base, base[:2])


def test_perplexity_is_lm_evals_aggregation_and_its_paired_difference() -> None:
    from lm_eval.api.metrics import perplexity as lm_eval_perplexity

    ll = np.log(np.array([0.5, 0.25, 0.125]))
    assert paired.perplexity(ll) == pytest.approx(lm_eval_perplexity(list(ll)))
    d = paired.paired_bootstrap_ppl(ll - 0.1, ll, iters=500)
    assert d.diff == pytest.approx(math.exp(-(ll - 0.1).mean()) - math.exp(-ll.mean()))
    assert d.lo > 0  # every item worse by the same amount


def test_per_item_values_roundtrip_and_same_item_check(tmp_path: Path) -> None:
    samples = {
        "piqa": [
            {
                "doc_id": 1,
                "doc_hash": "h1",
                "metrics": ["acc", "acc_norm"],
                "acc": 0,
                "acc_norm": 1,
            },
            {
                "doc_id": 0,
                "doc_hash": "h0",
                "metrics": ["acc", "acc_norm"],
                "acc": 1,
                "acc_norm": 1,
            },
        ]
    }
    items = per_item_metrics(samples)
    assert items == {
        "piqa": {
            "doc_id": [0, 1],
            "doc_hash": ["h0", "h1"],
            "acc": [1.0, 0.0],
            "acc_norm": [1.0, 1.0],
        }
    }
    rows = []
    for row, hashes in (("a", ["h0", "h1"]), ("b", ["h0", "hX"])):
        d = tmp_path / row
        d.mkdir()
        entry = {**items["piqa"], "doc_hash": hashes}
        (d / "fs0.json").write_text(
            json.dumps(
                {"results": {}, "date": 1.0, "mxplus": {"limit": 2, "items": {"piqa": entry}}}
            )
        )
        got = paired.load_row_items(d, limit=2)
        assert got is not None and list(got.values["piqa"]["acc"]) == [1.0, 0.0]
        assert paired.load_row_items(d, limit=50) is None  # another subset size: not this study
        rows.append(got)
    with pytest.raises(ValueError, match="different document text"):
        paired.check_same_items(rows, ["piqa"])
