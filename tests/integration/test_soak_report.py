"""The soak script's judgement and statistics (fast; the soak run itself is
`scripts/soak_server.py`, documented in docs/deploy.md)."""

from __future__ import annotations

import pytest
from integration_harness import load_script

soak = load_script("soak_server")


@pytest.mark.parametrize(
    "kind,status,accepted",
    [
        ("completion", 200, True),
        ("completion", 500, False),
        ("completion", 0, False),
        ("stream-chat", 400, False),
        ("malformed-json", 400, True),
        ("wrong-types", 422, True),
        ("nan-params", 500, False),
        ("nan-params", 200, True),
        ("nan-params", 0, False),
        ("huge-max-tokens", 200, True),
        ("huge-max-tokens", 422, True),
        ("disconnect-mid-stream", -1, True),
        ("disconnect-mid-stream", 503, False),
    ],
    ids=lambda v: str(v),
)
def test_pass_criteria(kind, status, accepted):
    assert soak.ok(soak.Result(kind, status, 0.1)) is accepted


@pytest.mark.parametrize(
    "q,want", [(0, 1.0), (50, 50.0), (99, 99.0), (100, 100.0)], ids=["p0", "p50", "p99", "p100"]
)
def test_percentile_nearest_rank(q, want):
    xs = [float(i) for i in range(100, 0, -1)]  # 1..100, unsorted
    assert soak.percentile(xs, q) == want


def test_every_kind_is_weighted_and_judged():
    assert set(soak.WEIGHTS) == set(soak.KINDS)
    assert (
        set(soak.VALID) | set(soak.INVALID) | set(soak.EDGE) | {"disconnect-mid-stream"}
    ) == set(soak.KINDS)
