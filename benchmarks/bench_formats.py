"""Quantize time per format on a 4096x4096 bf16 tensor on this CPU.

Prints each format's time as a ratio to torch.clone of the same tensor and to mxfp4-mbs-s,
all measured in the same run. Goal: exhaustive MBS-D within 10x of MBS-S.

    python benchmarks/bench_formats.py [--size 4096] [--repeats 3] [--threads N]

Times are medians of CPU time (time.process_time) with --threads 1 by default, because
wall time on a shared 2-core machine mostly measures the neighbours.
"""

from __future__ import annotations

import argparse
import platform
import statistics
import time

import torch

from vllm_mxplus.formats import FORMATS, quantize


def _median_time(fn, repeats: int, clock) -> float:
    fn()  # warm-up
    times = []
    for _ in range(repeats):
        t = clock()
        fn()
        times.append(clock() - t)
    return statistics.median(times)


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--size", type=int, default=4096)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--threads", type=int, default=1, help="torch threads (default 1)")
    ap.add_argument("--wall", action="store_true", help="wall-clock instead of CPU time")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    clock = time.perf_counter if args.wall else time.process_time
    g = torch.Generator().manual_seed(0)
    w = torch.randn(args.size, args.size, generator=g).bfloat16()
    print(
        f"machine: {platform.machine()} {platform.processor() or ''} | python {platform.python_version()}"
        f" | torch {torch.__version__} | threads {args.threads} | clock {'wall' if args.wall else 'cpu'}"
    )
    print(f"tensor: {args.size}x{args.size} bf16, median of {args.repeats}")
    base = _median_time(lambda: w.clone(), args.repeats, clock)
    times = {f: _median_time(lambda f=f: quantize(w, f), args.repeats, clock) for f in FORMATS}
    ref = times["mxfp4-mbs-s"]
    print(f"{'format':<14} {'seconds':>9} {'x clone':>9} {'x mbs-s':>8}")
    print(f"{'torch.clone':<14} {base:9.4f} {1.0:9.1f} {base / ref:8.2f}")
    for f, t in times.items():
        print(f"{f:<14} {t:9.4f} {t / base:9.1f} {t / ref:8.2f}")
    ratio = times["mxfp4-mbs-d"] / ref
    print(f"MBS-D / MBS-S = {ratio:.1f}x (goal <= 10x): {'met' if ratio <= 10 else 'NOT met'}")


if __name__ == "__main__":
    main()
