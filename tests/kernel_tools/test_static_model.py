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


def test_memory_bound_decode_is_bf16_bytes_over_ours(monkeypatch):
    """With no instructions to issue (and launches free), the estimate is the memory time:
    bf16's 2 bytes per weight over the format's bytes per weight."""
    monkeypatch.setattr(gsm, "LAUNCH_S", 0.0)
    for r in gsm.decode_formats_vs_bf16(_counts(0.0), "H200"):
        nbytes = gsm.DECODE_FORMATS[r["format"]][1]
        assert r["speedup_vs_bf16"] == pytest.approx(2.0 / nbytes)
        assert r["estimate_ms"] == r["memory_ms"]


def test_issue_bound_decode_scales_with_the_count(monkeypatch):
    """Issue-bound (a large count, launches free): twice the instructions per weight, half
    the ratio; the issue time is the count times the weights over the issue rate."""
    monkeypatch.setattr(gsm, "LAUNCH_S", 0.0)
    a = gsm.decode_formats_vs_bf16(_counts(1.0), "H200")
    b = gsm.decode_formats_vs_bf16(_counts(2.0), "H200")
    weights = gsm.LAYERS * sum(n * k for _, n, k in gsm.LLAMA_8B)
    for ra, rb in zip(a, b, strict=True):
        assert ra["estimate_ms"] == ra["issue_ms"] > ra["memory_ms"]
        assert ra["issue_ms"] == pytest.approx(weights / gsm._issue_rate("H200") * 1e3)
        assert rb["speedup_vs_bf16"] == pytest.approx(ra["speedup_vs_bf16"] / 2)


def test_cutlass_sm100_mbs_pays_a_read_modify_write_per_chunk():
    """The sm_100a bound model: with MBS every 128-K chunk reads and writes the fp32 output
    once more, so its estimate is at least that traffic alone, above the one full-K launch
    without MBS (whose estimate is at least its FP4 tensor time)."""
    counts = {"act-quant mxfp4-mbs-s": gsm.Count("aq", "act_quant", "element", 100, 0, 4,
                                                 4096, 1.0, {}, 0, 0, 0, 8)}  # fmt: skip
    bw = gsm.GPUS["B200"][3]
    for m in (256, 4096):
        one = gsm.cutlass_sm100(counts, "B200", m, mbs=False)
        per_chunk = gsm.cutlass_sm100(counts, "B200", m, mbs=True)
        rmw = gsm.LAYERS * sum(k // 128 * m * n * 8 for _, n, k in gsm.LLAMA_8B) / bw
        tensor = (
            gsm.LAYERS * sum(m * n * k for _, n, k in gsm.LLAMA_8B) / (gsm.FP4_FLOPS["B200"] / 2)
        )
        assert per_chunk["estimate_ms"] >= rmw * 1e3 > 0
        assert one["estimate_ms"] >= tensor * 1e3
        assert per_chunk["estimate_ms"] > one["estimate_ms"]


def test_launches_follow_the_code_structure(monkeypatch):
    """Per layer (four linears): bf16 one launch each; the FP8 pipeline (traced) its
    activation encoder (the FP8 layout and the fallback's packed fields), the exact-rows
    reduction and the GEMM, + the weight's encoder above PACKED_WEIGHT_MAX_M unless held (the
    fallback's row list and GEMM start early: programmatic dependent launches after the
    GEMM's trigger); below it the packed-weight GEMM splits K where its tiles are fewer than
    two per SM (M = 256: 96, 64, 448, 64 tiles: all but gate_up) and sums the slices in its
    own launch (`gemm_blocks.reduce_split_tile`); sm_100's FP4 pipeline (traced) only its
    activation quantizer, every launch after it a dependent one (relative scales, GEMM,
    split-K sum, row list, rows GEMM), all of them paid with PDL off; the decode at M = 1
    quantizer and GEMM for each:
    every 8B linear's 128-column tiles (48, 32, 224, 32) are fewer than two per SM of an
    H200 (264), so it splits K, summed in its own launch too, and on sm_90+ the GEMM's launch
    is a programmatic dependent one, started while the quantizer runs (not counted; counted
    on sm_80 and with VLLM_MXPLUS_GPU_PDL=0); a prefill at M = 4096 with 64-row tiles has
    thousands of tiles and no split."""
    assert gsm.launches("bf16", 1) == 4
    assert gsm.launches("fp8", 4096) == 16 and gsm.launches("fp8", 4096, held=True) == 12
    assert gsm.launches("fp8", 256) == 12
    assert (
        gsm.launches("fp4", 256, capability=100) == gsm.launches("fp4", 4096, capability=100) == 4
    )
    assert gsm.launches("decode", 1) == gsm.launches("decode", 1, capability=100) == 4
    assert gsm.launches("decode", 1, capability=80) == 8
    assert gsm.launches("prefill", 4096, block_m=64) == 8
    monkeypatch.setenv("VLLM_MXPLUS_GPU_PDL", "0")
    assert gsm.launches("decode", 1) == 8
    # act-quant, relative scales, GEMM, row list, rows GEMM (K not split at M = 4096); the
    # FP8 pipeline's encoder, exact-rows reduction, GEMM, row list, rows GEMM
    assert gsm.launches("fp4", 4096, capability=100) == 4 * 5
    assert gsm.launches("fp8", 256) == 4 * 5


def test_launch_time_is_added_per_launch(monkeypatch):
    """The per-format decode estimate pays LAUNCH_S per launch on top of max(issue, memory):
    32 layers x 4 launches for ours (the quantizers; the GEMMs' programmatic dependent
    launches hidden), 32 x 4 for bf16."""
    monkeypatch.setattr(gsm, "LAUNCH_S", 0.0)
    free = gsm.decode_formats_vs_bf16(_counts(0.0), "H200")
    monkeypatch.setattr(gsm, "LAUNCH_S", 1e-6)
    paid = gsm.decode_formats_vs_bf16(_counts(0.0), "H200")
    for f, p in zip(free, paid, strict=True):
        assert p["estimate_ms"] - f["estimate_ms"] == pytest.approx(gsm.LAYERS * 4 * 1e-3)
        assert p["bf16_estimate_ms"] - f["bf16_estimate_ms"] == pytest.approx(gsm.LAYERS * 4 * 1e-3)


def test_packed_fp32_arithmetic_bounds_before_the_issue_slots():
    """A loop of 100 instructions per warp whose FP32 work takes 160 lane cycles (e.g. 80
    FFMA2) is held by the FP32 lanes: 160 cycles per iteration, not 100; without packed
    work the issue slots count."""
    c = gsm.Count("k", "prefill", "MAC", 100, 100, 8, 1 << 21, 100 * 8 / (1 << 21), {}, 0, 0, 0,
                  128, fp32_cycles=160)  # fmt: skip
    assert c.cycles_per_unit == pytest.approx(160 * 8 / (1 << 21))
    c.fp32_cycles = 64
    assert c.cycles_per_unit == c.per_unit


def test_mbs_promotion_ceiling_by_hand():
    """B200: per output element and 128-K chunk the FP4 MMA takes 128 / 4.5e15 s, the
    promotion's 2 FP32 operations 2 / (148 x 128 x 1.965e9) s: 1.889x the MMA, so MBS costs
    at least +89% over the MMA without it and reaches at most 2.12x bf16's peak (no MBS: 4x,
    FP4's peak over bf16's). H200: the FP8 MMA takes 128 / 0.9895e15 s, the promotion
    0.462x that: hidden when overlapped, both at FP8's 2.0x."""
    b = gsm.mbs_promotion_ceiling("B200")
    assert b["mma"] == "FP4"
    assert b["promotion_over_mma"] == pytest.approx(1.8889, abs=1e-4)
    assert b["min_mbs_overhead"] == pytest.approx(0.8889, abs=1e-4)
    assert b["max_mbs_vs_bf16"] == pytest.approx(2.1177, abs=1e-4)
    assert b["max_no_mbs_vs_bf16"] == pytest.approx(4.0)
    h = gsm.mbs_promotion_ceiling("H200")
    assert h["mma"] == "FP8" and h["promotion_over_mma"] == pytest.approx(0.4622, abs=1e-4)
    assert h["min_mbs_overhead"] == 0.0 and h["max_mbs_vs_bf16"] == pytest.approx(2.0010, abs=1e-4)


def test_serial_bound_of_a_loop_that_waits_for_its_own_mma():
    """A loop that waits for its own MMA pays issue + tensor per step, shared only by the
    programs resident on an SM; one that keeps the MMA in flight adds no bound."""
    c = gsm.Count("k", "prefill", "MAC", 100, 100, 8, 1 << 21, 1e-4, {}, 200, 0, 0, 128,
                  waits_own_mma=True, programs_per_sm=1)  # fmt: skip
    assert gsm.serial_s(c, 3.0, 2.0) == 5.0
    c2 = gsm.Count("k", "prefill", "MAC", 100, 100, 8, 1 << 21, 1e-4, {}, 200, 0, 0, 128,
                   waits_own_mma=True, programs_per_sm=2)  # fmt: skip
    assert gsm.serial_s(c2, 3.0, 2.0) == 2.5
    c3 = gsm.Count("k", "prefill", "MAC", 100, 100, 8, 1 << 21, 1e-4, {}, 200, 0, 0, 128)
    assert gsm.serial_s(c3, 3.0, 2.0) == 0.0
