"""One quantized linear on CPU: the cpu-packed backend (C++ kernels) vs bf16 F.linear and vs
the pure-torch reference backend, in one run.

    python benchmarks/bench_cpu_linear.py [--scheme mxfp4-mbs] [--model smollm2|llama8b|all]
                                          [--m 1,4,16,64] [--threads N]

For each linear shape (N, K) of the model and each row count M it prints the median wall
time of:
  bf16      torch.nn.functional.linear on bf16 weights (the unquantized baseline)
  reference ReferenceBackend.apply (fp32 dequantized weight, torch activation fake-quant)
  packed    CpuPackedBackend.apply (packed FP4 weight, C++ fake-quant + GEMV / GEMM)
and the ratios bf16/packed (>= 1: packed is faster than bf16) and reference/packed.
Weight bytes per element: bf16 2, reference 4, packed ~0.57.
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import time

import torch

SHAPES = {
    # SmolLM2-135M: qkv, o, gate_up, down (hidden 576, FFN 1536, 9 + 3 + 3 heads of 64)
    "smollm2": [(960, 576), (576, 576), (3072, 576), (576, 1536)],
    # Llama-3.1-8B: qkv, o, gate_up, down
    "llama8b": [(6144, 4096), (4096, 4096), (28672, 4096), (4096, 14336)],
}


def _median_us(fn, min_time: float = 0.3, min_iters: int = 5) -> float:
    fn()
    times = []
    t_end = time.perf_counter() + min_time
    while len(times) < min_iters or time.perf_counter() < t_end:
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1e6


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--scheme", default="mxfp4-mbs")
    ap.add_argument("--model", default="smollm2", choices=[*SHAPES, "all"])
    ap.add_argument("--m", default="1,4,16,64", help="comma-separated row counts")
    ap.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)

    from vllm_mxplus.formats import quantize
    from vllm_mxplus.ops import cpu_kernels
    from vllm_mxplus.ops.backend import LinearSpec
    from vllm_mxplus.ops.cpu_backend import CpuPackedBackend
    from vllm_mxplus.ops.reference import ReferenceBackend

    ok, why = cpu_kernels.load()
    if not ok:
        raise SystemExit(f"CPU kernels unavailable: {why}")
    print(f"machine : {platform.machine()} {platform.processor() or ''} cores={os.cpu_count()} "
          f"torch_threads={torch.get_num_threads()} load={os.getloadavg()[0]:.1f} "
          f"cpu={torch.backends.cpu.get_cpu_capability()}")
    print(f"versions: torch {torch.__version__}; scheme {args.scheme}; build {cpu_kernels.build_name()}")
    models = list(SHAPES) if args.model == "all" else [args.model]
    ms = [int(v) for v in args.m.split(",")]
    print(f"{'model':8s} {'N':>6s} {'K':>6s} {'M':>4s} {'bf16 us':>9s} {'ref us':>9s} "
          f"{'packed us':>9s} {'bf16/packed':>11s} {'ref/packed':>10s}")
    g = torch.Generator().manual_seed(0)
    tot = {"bf16": 0.0, "ref": 0.0, "packed": 0.0}
    for model in models:
        for n, k in SHAPES[model]:
            w = torch.randn(n, k, generator=g) * 0.02
            spec = LinearSpec(scheme=args.scheme, n=n, k=k, out_dtype=torch.bfloat16)
            q = quantize(w, spec.weight_format)
            ref_layer, packed_layer = torch.nn.Module(), torch.nn.Module()
            ref, packed = ReferenceBackend(), CpuPackedBackend()
            ok, why = packed.can_implement(spec)
            if not ok:
                raise SystemExit(why)
            ref.process_weights_after_loading(ref_layer, q, spec)
            packed.process_weights_after_loading(packed_layer, q, spec)
            wb = w.to(torch.bfloat16)
            for m in ms:
                x = torch.randn(m, k, generator=g).to(torch.bfloat16)
                t_b = _median_us(lambda: torch.nn.functional.linear(x, wb))
                t_r = _median_us(lambda: ref.apply(ref_layer, x, None, spec))
                t_p = _median_us(lambda: packed.apply(packed_layer, x, None, spec))
                tot["bf16"] += t_b
                tot["ref"] += t_r
                tot["packed"] += t_p
                print(f"{model:8s} {n:6d} {k:6d} {m:4d} {t_b:9.1f} {t_r:9.1f} {t_p:9.1f} "
                      f"{t_b / t_p:11.2f} {t_r / t_p:10.2f}", flush=True)
            del ref_layer, packed_layer
    print(f"sum over rows: bf16/packed = {tot['bf16'] / tot['packed']:.2f}x, "
          f"reference/packed = {tot['ref'] / tot['packed']:.2f}x")
    print("rerun: python benchmarks/bench_cpu_linear.py " + " ".join(
        f"--{a} {v}" for a, v in (("scheme", args.scheme), ("model", args.model), ("m", args.m))))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
