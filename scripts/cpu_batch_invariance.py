"""Whether a row's output bits depend on the batch it is served in, on the CPU backend.

    OMP_NUM_THREADS=2 python scripts/cpu_batch_invariance.py [--scheme mxfp4-mbs-s]
        [--rows 256] [--m 4,12,16,64,256] [--layer 3] [--dtype float32|bfloat16]

A diagnostic (docs/cpu_kernels.md, "Batch invariance"). SmolLM2's own decoder layer `--layer`
(its four linears' weights and the rows each reads on the calibration text, as
benchmarks/bench_cpu_linear.py --real-layer takes them) runs through `cpu-packed` three ways:
every row alone (M = 1, the integer kernels), the rows in consecutive batches of M, and the
same batches shifted by 8 rows (so each row has other 16-row tile mates). It prints, per linear
and M, how many output elements differ in bits from the rows served alone, and from the
unshifted batches of that M. With VLLM_MXPLUS_CPU_AMX_EMULATE=1 on a CPU without AMX, the AMX
path (int8 tiles from INT8_MIN_M rows, bf16 tiles from MIN_M) serves as on an AMX host; on
other hosts the integer kernels serve every M. Exit status 0 always: it measures, it does not
judge.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))

from bench_cpu_linear import REAL_ROWS, _real_operands  # noqa: E402

from vllm_mxplus.backends.base import LinearSpec  # noqa: E402
from vllm_mxplus.backends.cpu import exact_bf16  # noqa: E402
from vllm_mxplus.backends.cpu.linear import CpuPackedBackend  # noqa: E402
from vllm_mxplus.formats import get_scheme, quantize  # noqa: E402

SHIFT = 8  # rows the shifted batches start later: half a 16-row tile


def _batches(backend, layer, x: torch.Tensor, m: int, start: int = 0) -> torch.Tensor:
    """The rows of x served in consecutive batches of m rows, the first batch `start` rows."""
    cuts = [0] + ([start] if start else []) + list(range(start + m, x.shape[0], m))
    cuts.append(x.shape[0])
    return torch.cat([backend.apply(layer, x[a:b], None) for a, b in zip(cuts, cuts[1:]) if b > a])


def _differ(a: torch.Tensor, b: torch.Tensor) -> int:
    bits = torch.int32 if a.dtype == torch.float32 else torch.int16
    return int((a.view(bits) != b.view(bits)).sum())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--scheme", default="mxfp4-mbs-s")
    ap.add_argument(
        "--rows", type=int, default=256, help=f"rows of the layer's own (<= {REAL_ROWS})"
    )
    ap.add_argument("--m", default="4,12,16,64,256", help="batch sizes, comma-separated")
    ap.add_argument("--layer", type=int, default=3, help="SmolLM2 decoder layer")
    ap.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32")
    args = ap.parse_args()
    if not 1 <= args.rows <= REAL_ROWS:
        raise SystemExit(f"--rows must be in 1..{REAL_ROWS}")
    ms = [int(v) for v in args.m.split(",")]
    dtype = getattr(torch, args.dtype)
    scheme = get_scheme(args.scheme)
    amx, why = exact_bf16.host_choice()
    print(
        f"scheme {scheme.name}, output {args.dtype}, SmolLM2 layer {args.layer}, {args.rows} rows"
    )
    print(f"AMX path: {'on' if amx else 'off (' + why + ')'}")
    print("linear   outputs   M   differ from M=1   differ when shifted by 8 rows")
    for shape, (w, x) in _real_operands(args.layer).items():
        n, k = w.shape
        backend = CpuPackedBackend(LinearSpec(scheme, n=n, k=k, out_dtype=dtype))
        layer = torch.nn.Module()
        backend.process_weights_after_loading(layer, quantize(w, scheme.weight_format))
        rows = x[: args.rows].to(torch.bfloat16).to(dtype)
        alone = _batches(backend, layer, rows, 1)
        for m in ms:
            y = _batches(backend, layer, rows, m)
            # rows in whole batches of m both ways: their batch size is the same, their
            # tile mates are not
            end = max(SHIFT, min(SHIFT + (args.rows - SHIFT) // m * m, args.rows // m * m))
            full = slice(SHIFT, end)
            shifted = _batches(backend, layer, rows, m, start=SHIFT)[full]
            print(
                f"{shape:8s} {alone.numel():8d} {m:4d}   {_differ(y, alone):15d}   "
                f"{_differ(shifted, y[full]):d} of {shifted.numel()}",
                flush=True,
            )


if __name__ == "__main__":
    main()
