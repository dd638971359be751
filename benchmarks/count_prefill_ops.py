"""Aten ops per call of the sm_90a / sm_100a CUTLASS prefill path, counted on CPU.

The Python that runs on the GPU between the kernels (the sm_90a exact-row fallback, the
sm_100a operand preparation) is run for real on fake CUDA tensors (`graph_guard`); the kernels
(CUTLASS GEMMs, Triton encoders) are their custom ops' fake implementations, one op each. A
call is `CutlassPrefillBackend.apply`; the prefill custom op's body is counted by running its
implementation the same way, so

    total = ops of apply (the prefill op counted once) - 1 + ops of the op's body.

GEMM launches are the `cutlass_fp8_chunk_gemm` / `cutlass_fp4_mbs_gemm` ops among them, plus
the Triton launches of the sm_90a exact-row fallback (`triton_launches`).

    python benchmarks/count_prefill_ops.py [--m 24,512] [--json FILE]
"""

from __future__ import annotations

import argparse
import json
import sys
import types

import torch

from vllm_mxplus.backends.base import LinearSpec
from vllm_mxplus.backends.cutlass import gemm as cutlass_gemm
from vllm_mxplus.backends.cutlass.gemm import PreparedWeight
from vllm_mxplus.backends.cutlass.linear import CutlassPrefillBackend
from vllm_mxplus.backends.graph_guard import cuda_empty, fake_cuda, guarded

GEMM_OPS = ("vllm_mxplus.cutlass_fp8_chunk_gemm", "vllm_mxplus.cutlass_fp4_mbs_gemm")
VIEW_OPS = (
    "aten.view",
    "aten._unsafe_view",
    "aten.slice",
    "aten.select",
    "aten.t.",
    "aten.expand",
    "aten.unsqueeze",
    "aten.squeeze",
    "aten.transpose",
    "aten.permute",
    "aten.alias",
)


def sm90_weight(n: int, k: int, inexact_rows: int) -> PreparedWeight:
    """A fake prepared sm_90a weight [n, k] with `inexact_rows` rows on the exact fallback."""
    nc = -(-k // 128)
    idx = cuda_empty((inexact_rows,), torch.int64)
    packed = (
        cuda_empty((n, k // 2), torch.uint8),
        cuda_empty((n, -(-k // 16)), torch.uint8),
        cuda_empty((n, nc), torch.uint8),
    )
    return PreparedWeight("sm90a", n, k, True, packed=packed, fallback_idx=idx)


def _summary(ops: list[str]) -> dict:
    aten_ops = [o for o in ops if o.startswith("aten.")]
    return {
        "aten_ops": len(aten_ops),
        "views": sum(1 for o in aten_ops if o.startswith(VIEW_OPS)),
        "gemms": sum(1 for o in ops if o.startswith(GEMM_OPS)),
        "custom_ops": sum(1 for o in ops if o.startswith("vllm_mxplus.")),
    }


def count_sm90(m: int, scheme: str, n: int = 4096, k: int = 4096, inexact_w: int = 0) -> dict:
    """Ops of one CutlassPrefillBackend.apply on sm_90a (fused activation encoder)."""
    spec = LinearSpec(scheme=scheme, n=n, k=k, out_dtype=torch.bfloat16, device_type="cuda")
    with fake_cuda():
        w = sm90_weight(n, k, inexact_w)
        layer = types.SimpleNamespace(**{CutlassPrefillBackend.WEIGHT_ATTR: w})
        x = cuda_empty((m, k), torch.bfloat16)
        _, outer = guarded(CutlassPrefillBackend(spec).apply, layer, x, None, strict=False)
        fields = torch.ops.vllm_mxplus.triton_act_fp8_chunks_packed(x, spec.activation_format, 128)
        _, inner = guarded(
            cutlass_gemm.prefill_sm90_fused_impl,
            x,
            spec.activation_format,
            *fields,
            *w.sm90_operands(),
            None,
            n,
            torch.bfloat16,
            strict=False,
        )
    ops = [o for o in outer.ops if "cutlass_prefill_sm90" not in o] + inner.ops
    return {
        "arch": "sm90a",
        "scheme": scheme,
        "m": m,
        "n": n,
        "k": k,
        "inexact_weight_rows": inexact_w,
        **_summary(ops),
        "capture_violations": len(outer.violations) + len(inner.violations),
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--m", default="24,512")
    ap.add_argument("--schemes", default="mxfp4-mbs,mxfp4-16-oas")
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    rows = []
    for scheme in args.schemes.split(","):
        for m in (int(v) for v in args.m.split(",")):
            for inexact in (0, 3):
                rows.append(count_sm90(m, scheme, inexact_w=inexact))
    print(
        "| arch | scheme | M | inexact W rows | aten ops | views | GEMMs | custom ops "
        "| capture violations |"
    )
    print("|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(
            f"| {r['arch']} | {r['scheme']} | {r['m']} | {r['inexact_weight_rows']} | "
            f"{r['aten_ops']} | {r['views']} | {r['gemms']} | {r['custom_ops']} | "
            f"{r['capture_violations']} |"
        )
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
