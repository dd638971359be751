"""Per-call cost of a Python custom op on CPU: `torch.library.custom_op` against an op registered
to the dispatcher directly (`library.define_op`, how `linear_dispatch` is registered), and the
whole per-layer dispatch on a small cpu-packed layer (eager: `LinearDispatch.apply`; compiled
graphs: the `linear_dispatch` op) against its backend called directly.

    OMP_NUM_THREADS=1 python benchmarks/bench_dispatch_overhead.py [--calls 2000] [--repeats 7]

Each figure is the best of --repeats loops of --calls calls (µs per call). The op bodies are
the same Python function returning a new empty tensor: the difference is the registration's own cost.
The layer case is a 64 x 128 linear at 16 rows (mxfp4-mbs-s), so its kernel is short and the
Python around it shows; vLLM's CPU backend pays that per quantized linear per step (no graphs).
"""

from __future__ import annotations

import argparse
import platform
import subprocess
import time
from collections.abc import Callable

import torch


def best_us(fn: Callable[[], object], calls: int, repeats: int) -> float:
    for _ in range(min(calls, 100)):
        fn()
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        for _ in range(calls):
            fn()
        best = min(best, (time.perf_counter() - t0) / calls * 1e6)
    return best


def cpu_name() -> str:
    try:
        out = subprocess.run(["lscpu"], capture_output=True, text=True, check=False).stdout
    except OSError:
        return platform.processor() or "unknown CPU"
    for line in out.splitlines():
        if line.startswith("Model name:"):
            return line.split(":", 1)[1].strip()
    return platform.processor() or "unknown CPU"


def registration_cases() -> dict[str, Callable]:
    from vllm_mxplus.backends.library import define_op

    def body(x: torch.Tensor, n: int) -> torch.Tensor:
        return torch.empty_like(x)

    def fake(x, n):  # noqa: ANN001, ANN202 (the op's)
        return torch.empty_like(x)

    wrapped = torch.library.custom_op("mxplus_bench::wrapped", mutates_args=())(body)
    wrapped.register_fake(fake)
    direct = define_op("bench_dispatch_overhead_direct", body, fake)
    return {"python function": body, "custom_op": wrapped, "define_op": direct}


def layer_cases() -> tuple[dict[str, Callable], str]:
    from vllm_mxplus.backends.base import LinearSpec
    from vllm_mxplus.backends.linear_op import LinearDispatch
    from vllm_mxplus.backends.selection import select
    from vllm_mxplus.formats import quantize

    spec = LinearSpec(scheme="mxfp4-mbs-s", n=64, k=128, out_dtype=torch.bfloat16)
    g = torch.Generator().manual_seed(0)
    q = quantize(torch.randn(spec.n, spec.k, generator=g) * 0.05, spec.weight_format)
    chosen = select(spec, "cpu", None)
    layer = torch.nn.Module()
    layer.prefix = "bench_dispatch_overhead.layer"
    dispatch = LinearDispatch(spec, chosen)
    dispatch.process_weights_after_loading(layer, q)
    x = torch.randn(16, spec.k, generator=g).to(torch.bfloat16)
    backend = dispatch.pick(16)
    cases = {
        f"{backend.name}.apply": lambda: backend.apply(layer, x, None),
        "LinearDispatch.apply": lambda: dispatch.apply(layer, x, None),
        # what a compiled graph calls: the op itself
        "linear_dispatch op": lambda: torch.ops.vllm_mxplus.linear_dispatch.default(
            x, None, None, spec.n, spec.out_dtype, dispatch.key
        ),
    }
    return cases, backend.name


def main() -> int:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--calls", type=int, default=2000)
    ap.add_argument("--repeats", type=int, default=7)
    args = ap.parse_args()
    print(f"# {cpu_name()}; torch {torch.__version__}; threads {torch.get_num_threads()}")
    print("# python benchmarks/bench_dispatch_overhead.py  (µs per call, best of repeats)")
    x = torch.zeros(4)
    times = {
        name: best_us(lambda op=op: op(x, 1), args.calls, args.repeats)
        for name, op in registration_cases().items()
    }
    base = times["python function"]
    for name, us in times.items():
        print(f"{name:24s} {us:7.2f} us   op's own cost {us - base:6.2f} us")
    print(
        f"define_op / custom_op own cost: "
        f"{(times['define_op'] - base) / (times['custom_op'] - base):.2f}x"
    )
    cases, name = layer_cases()
    layer_times = {k: best_us(f, args.calls, args.repeats) for k, f in cases.items()}
    for k, us in layer_times.items():
        print(f"{k:24s} {us:7.2f} us")
    for k in ("LinearDispatch.apply", "linear_dispatch op"):
        print(f"{k} over {name}.apply: +{layer_times[k] - layer_times[f'{name}.apply']:.2f} us")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
