"""Decode GEMM time at M = 1, 4, 16 as a ratio to bf16 F.linear on the same GPU.

Shapes are K x N (in_features x out_features) of Llama-style layers. The Triton kernel reads
the packed FP4 weights (K/2 bytes per row) plus block scales and MBS bytes; F.linear reads
the bf16 weights (2K bytes per row). Ratio = F.linear time / kernel time (> 1: faster).
The activation quantizer is timed separately (it runs once per layer input).

  python benchmarks/bench_decode_gemm.py [--pairs mbs,oas16,ocp32]
"""

from __future__ import annotations

import argparse

import torch
import torch.nn.functional as F
from _gpu_common import banner, bench_ms, require_cuda

SHAPES = [(4096, 4096), (4096, 14336), (14336, 4096), (4096, 12288), (12288, 4096)]
MS = (1, 4, 16)
PAIRS = {  # name: (weight format, activation format)
    # MBS-D weights share MBS-S's layout and cost; -s weights avoid the slow offline search.
    "mbs": ("mxfp4-mbs-s", "mxfp4-mbs-s"),
    "oas16": ("mxfp4-16-oas", "mxfp4-16-oas"),
    "ocp32": ("mxfp4-ocp", "mxfp4-ocp"),
}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--pairs", default=",".join(PAIRS))
    args = ap.parse_args()
    require_cuda("bench_decode_gemm")
    from vllm_mxplus.backends.triton.act_quant import act_quant
    from vllm_mxplus.backends.triton.decode_gemm import decode_gemm
    from vllm_mxplus.formats import quantize

    banner("decode_gemm vs bf16 F.linear (baseline); ratio = t_linear / t_kernel")
    print(
        f"{'pair':6s} {'K':>6s} {'N':>6s} {'M':>3s} {'gemm us':>8s} {'w GB/s':>7s} "
        f"{'linear us':>9s} {'ratio':>6s} {'+quant us':>9s} {'ratio':>6s}"
    )
    for pair in args.pairs.split(","):
        wf, xf = PAIRS[pair]
        for k, n in SHAPES:
            w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * 0.02
            qw = quantize(w, wf)
            w_bytes = sum(t.numel() for t in (qw.codes, qw.scales, qw.mbs) if t is not None)
            for m in MS:
                x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
                xc, xs, xm, _ = act_quant(x, xf, macro_block=128)
                t_g = bench_ms(
                    lambda: decode_gemm(xc, xs, xm, qw.codes, qw.scales, qw.mbs, k, macro_block=128)
                )
                t_l = bench_ms(lambda: F.linear(x, w))

                def full():
                    c, s, mb, _ = act_quant(x, xf, macro_block=128)
                    return decode_gemm(c, s, mb, qw.codes, qw.scales, qw.mbs, k, macro_block=128)

                t_f = bench_ms(full)
                print(
                    f"{pair:6s} {k:6d} {n:6d} {m:3d} {t_g * 1e3:8.1f} "
                    f"{w_bytes / t_g / 1e6:7.0f} {t_l * 1e3:9.1f} {t_l / t_g:6.2f} "
                    f"{t_f * 1e3:9.1f} {t_l / t_f:6.2f}"
                )


if __name__ == "__main__":
    main()
