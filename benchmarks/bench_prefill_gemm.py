"""Prefill GEMM throughput, paper Table 4 style: the CUTLASS MXFP4-MBS kernel vs baselines.

For Llama-3.1-8B and Qwen3-8B linear shapes (N, K) x M in {128, 1024, 4096, 16384}, one run
measures TFLOP/s (2·M·N·K / time) of
  mbs      the MXFP4-MBS GEMM (sm_90a: FP8 chunk-scaled; sm_100a: block-scaled FP4 + MBS)
  no_mbs   the same kernel without MBS (sm_90a: identical kernel, scales without sigma -- MBS
           is free there; sm_100a: one full-K launch, no per-chunk epilogue)
  fp8      torch._scaled_mm FP8 E4M3 per-tensor scales
  bf16     torch.matmul in bf16 (the named baseline of every ratio)
  e2e      prefill_gemm_from_x: activation encoding from bf16 x, the GEMM and the graph-safe
           sm_90a fallback machinery (two extra GEMMs on up to 64 rows), what the backend runs
Kernel time for mbs / no_mbs: weights prepared and activations re-encoded / packed before
timing. Prints the machine, versions, and ratios mbs/bf16, mbs/no_mbs (overhead; goal <= 5%),
e2e/bf16.
Goal on H200: mbs >= 1.5x bf16 at M >= 4096. Exits 0 with a message without CUDA / extension.

    python benchmarks/bench_prefill_gemm.py [--m 128,1024] [--models llama-3.1-8b] [--iters 10]
"""

from __future__ import annotations

import argparse
import platform
import sys

import torch

SHAPES = {  # (name, N, K) of one decoder layer's linears, TP = 1
    "llama-3.1-8b": [
        ("qkv", 6144, 4096),
        ("o", 4096, 4096),
        ("gate_up", 28672, 4096),
        ("down", 4096, 14336),
    ],
    "qwen3-8b": [
        ("qkv", 6144, 4096),
        ("o", 4096, 4096),
        ("gate_up", 24576, 4096),
        ("down", 4096, 12288),
    ],
}
M_VALUES = [128, 1024, 4096, 16384]


def time_ms(fn, iters: int) -> float:
    """Median of `iters` CUDA-event timings after 3 warm-up calls."""
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(iters):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return sorted(times)[len(times) // 2]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--m", default=",".join(map(str, M_VALUES)))
    ap.add_argument("--models", default=",".join(SHAPES))
    ap.add_argument("--iters", type=int, default=10)
    args = ap.parse_args(argv)

    if not torch.cuda.is_available():
        print("bench_prefill_gemm: no CUDA device; nothing to measure")
        return 0
    from vllm_mxplus.backends.cutlass import build as cutlass_ext
    from vllm_mxplus.backends.cutlass import gemm as cutlass_gemm
    from vllm_mxplus.formats import quantize

    ok, why = cutlass_ext.is_available()
    if not ok:
        print(
            f"bench_prefill_gemm: CUTLASS extension unavailable ({why}); "
            "build it with: python -m vllm_mxplus.backends.cutlass.build"
        )
        return 0
    arch = cutlass_ext.arch_of()
    print(
        f"machine: {platform.node()} | {torch.cuda.get_device_name()} ({arch}) | "
        f"torch {torch.__version__} cuda {torch.version.cuda} | python "
        f"{platform.python_version()}"
    )
    print(
        f"{'model':14s} {'layer':8s} {'M':>6s} {'N':>6s} {'K':>6s} | TFLOP/s: {'mbs':>7s} "
        f"{'no_mbs':>7s} {'fp8':>7s} {'bf16':>7s} {'e2e':>7s} | mbs/bf16 mbs/fp8 overhead "
        f"e2e/bf16"
    )
    dev = torch.device("cuda")
    ratios = []
    for model in args.models.split(","):
        for layer, n, k in SHAPES[model]:
            # Kernel time does not depend on which MBS bytes were chosen: MBS-S is quicker
            # to quantize than the exhaustive MBS-D search at these sizes.
            qw = quantize(torch.randn(n, k, device=dev), "mxfp4-mbs-s")
            w = cutlass_gemm.prepare_weight(qw, arch)
            w_bf16 = qw.dequantize(torch.bfloat16)
            w_fp8 = w_bf16.to(torch.float8_e4m3fn)
            one = torch.ones((), device=dev)
            for m in map(int, args.m.split(",")):
                x = torch.randn(m, k, device=dev, dtype=torch.bfloat16)
                qx = quantize(x, "mxfp4-mbs-s")
                fns = _kernels(arch, qx, qw, w, k)
                fns["fp8"] = lambda: torch._scaled_mm(
                    x.to(torch.float8_e4m3fn), w_fp8.t(), one, one, out_dtype=torch.bfloat16
                )
                fns["bf16"] = lambda: torch.matmul(x, w_bf16.t())
                fns["e2e"] = lambda: cutlass_gemm.prefill_gemm_from_x(x, "mxfp4-mbs-s", w, None)
                flop = 2.0 * m * n * k
                tf = {name: flop / time_ms(fn, args.iters) / 1e9 for name, fn in fns.items()}
                ov = tf["no_mbs"] / tf["mbs"] - 1.0
                ratios.append((m, tf["mbs"] / tf["bf16"], ov))
                print(
                    f"{model:14s} {layer:8s} {m:6d} {n:6d} {k:6d} | {'':8s} {tf['mbs']:7.1f} "
                    f"{tf['no_mbs']:7.1f} {tf['fp8']:7.1f} {tf['bf16']:7.1f} {tf['e2e']:7.1f} | "
                    f"{tf['mbs'] / tf['bf16']:7.2f}x {tf['mbs'] / tf['fp8']:6.2f}x "
                    f"{100 * ov:+6.1f}% {tf['e2e'] / tf['bf16']:7.2f}x"
                )
    big = [r for m, r, _ in ratios if m >= 4096]
    if big:
        print(
            f"summary: mbs/bf16 at M>=4096: min {min(big):.2f}x, mean {sum(big) / len(big):.2f}x "
            f"(goal >= 1.5x on H200); MBS overhead mean "
            f"{100 * sum(o for *_, o in ratios) / len(ratios):+.1f}% (goal <= 5%)"
        )
    return 0


def _kernels(arch, qx, qw, w, k):
    """Timed closures of the MBS kernel and of the same kernel without MBS (inputs prepared)."""
    from vllm_mxplus.backends.cutlass import ops as co
    from vllm_mxplus.backends.cutlass.fp8_chunks import encode_fp8_chunks

    bf16 = torch.bfloat16
    if arch == "sm90a":
        xl = encode_fp8_chunks(qx.codes, qx.scales, qx.mbs, k)
        no_mbs_scale = xl.scale * (1.0 + xl.mbs.t().float() / 256.0)  # drop sigma
        return {
            "mbs": lambda: co.fp8_chunk_gemm(
                xl.fp8, xl.scale, w.layout.fp8, w.layout.scale, None, bf16
            ),
            "no_mbs": lambda: co.fp8_chunk_gemm(
                xl.fp8, no_mbs_scale, w.layout.fp8, w.layout.scale, None, bf16
            ),
        }
    pad = torch.nn.functional.pad
    kp = w.codes.shape[1] * 2
    codes = pad(qx.codes, (0, kp // 2 - qx.codes.shape[1])).contiguous()
    sf = co.pack_scales_sm100(qx.scales, kp)
    sf_full = co.pack_scales_sm100(qx.scales, kp, kp)  # one full-K "chunk"
    w_sf_full = co.pack_scales_sm100(pad(qw.scales, (0, 0, 0, w.codes.shape[0] - w.n)), kp, kp)
    sig = co.sigma_chunks(qx.mbs, qx.codes.shape[0], k, codes.device)
    return {
        "mbs": lambda: co.fp4_mbs_gemm(codes, sf, w.codes, w.sf, sig, w.sigma(), None, True, bf16),
        "no_mbs": lambda: co.fp4_mbs_gemm(
            codes, sf_full, w.codes, w_sf_full, sig, w.sigma(), None, False, bf16
        ),
    }


if __name__ == "__main__":
    sys.exit(main())
