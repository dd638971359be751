"""The arithmetic of `benchmarks/gpu_static_model.py`'s per-format decode estimate, on made-up
counts whose answer follows from the bounds alone (no compiler needed)."""

from __future__ import annotations

import pytest

from benchmarks import gpu_static_model as gsm


def _counts(per_weight: float) -> dict[str, gsm.Count]:
    return {
        case: gsm.Count(case, "decode", "weight", 90, 0, 4, 16384, per_weight, {}, 0, 0, 0, 16)
        for case, _ in gsm.DECODE_FORMATS.values()
    }


def test_memory_bound_decode_is_bf16_bytes_over_ours():
    """With no instructions to issue, the estimate is the memory time: bf16's 2 bytes per
    weight over the format's bytes per weight."""
    for r in gsm.decode_formats_vs_bf16(_counts(0.0), "H200"):
        nbytes = gsm.DECODE_FORMATS[r["format"]][1]
        assert r["speedup_vs_bf16"] == pytest.approx(2.0 / nbytes)
        assert r["estimate_ms"] == r["memory_ms"]


def test_issue_bound_decode_scales_with_the_count():
    """Issue-bound (a large count): twice the instructions per weight, half the ratio; the
    issue time is the count times the weights over the issue rate."""
    a = gsm.decode_formats_vs_bf16(_counts(1.0), "H200")
    b = gsm.decode_formats_vs_bf16(_counts(2.0), "H200")
    weights = gsm.LAYERS * sum(n * k for _, n, k in gsm.LLAMA_8B)
    for ra, rb in zip(a, b, strict=True):
        assert ra["estimate_ms"] == ra["issue_ms"] > ra["memory_ms"]
        assert ra["issue_ms"] == pytest.approx(weights / gsm._issue_rate("H200") * 1e3)
        assert rb["speedup_vs_bf16"] == pytest.approx(ra["speedup_vs_bf16"] / 2)
