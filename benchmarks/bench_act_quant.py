"""Activation quantizer throughput as a ratio to torch.clone of the same input (same GPU).

Bytes moved: the kernel reads x once and writes codes, scales, MBS (and, for nvfp4, the
global scale); clone reads and writes x. GB/s of each and quantizer/clone bandwidth ratio.

  python benchmarks/bench_act_quant.py [--formats mxfp4-mbs-s,nvfp4] [--dtype bf16]
"""

from __future__ import annotations

import argparse

import torch
from _gpu_common import banner, bench_ms, nbytes, require_cuda

SHAPES = [(1, 4096), (16, 4096), (1024, 4096), (8192, 4096), (4096, 14336), (8192, 576)]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--formats", default="mxfp4-mbs-s,mxfp4-16-oas,mxfp4-ocp,nvfp4")
    ap.add_argument("--dtype", default="bf16", choices=["bf16", "fp16"])
    args = ap.parse_args()
    require_cuda("bench_act_quant")
    from vllm_mxplus.backends.triton.act_quant import act_quant

    banner("act_quant vs torch.clone (baseline), GB/s and ratio")
    dtype = torch.bfloat16 if args.dtype == "bf16" else torch.float16
    print(
        f"{'format':14s} {'M':>6s} {'K':>6s} {'quant us':>9s} {'GB/s':>7s} "
        f"{'clone us':>9s} {'GB/s':>7s} {'ratio':>6s}"
    )
    for fmt in args.formats.split(","):
        for m, k in SHAPES:
            x = torch.randn(m, k, device="cuda", dtype=dtype)
            outs = act_quant(x, fmt, macro_block=128)
            t_q = bench_ms(lambda: act_quant(x, fmt, macro_block=128))
            t_c = bench_ms(lambda: x.clone())
            gb_q = (nbytes(x) + nbytes(*outs)) / t_q / 1e6
            gb_c = 2 * nbytes(x) / t_c / 1e6
            print(
                f"{fmt:14s} {m:6d} {k:6d} {t_q * 1e3:9.1f} {gb_q:7.0f} "
                f"{t_c * 1e3:9.1f} {gb_c:7.0f} {gb_q / gb_c:6.2f}"
            )


if __name__ == "__main__":
    main()
