"""How many weight rows of a real checkpoint the FP8-chunk GEMMs leave to their exact fallback.

    python benchmarks/fallback_rows.py [--model DIR] [--scheme mxfp4-mbs]

The sm_90 / sm_100 prefill pipelines (`triton-fp8-prefill`, `cutlass_prefill` on sm_90a)
serve a weight row from its FP8-chunk form only where every 128-K chunk is exact in it, and
the packed-weight FP8 GEMM (`fp8_packed_gemm`) only where, besides, every nonzero 16-block lies
within 11 binades of the chunk's largest scale; the other rows' output columns are recomputed
by the exact Triton FP4 GEMM (`backends/cutlass/gemm.py`). This script quantizes each linear
weight of a checkpoint as the plugin does at load (the scheme's weight format, MBS-D where it
has MBS) and counts both kinds of rows (`gemm.fallback_rows`), per projection kind and in all,
so the cost of the fallbacks on real weights is a measured fraction, not a guess. CPU only.
Default model: the SmolLM2-135M checkpoint `mxplus prepare` writes (its hidden size 576 is
not a multiple of 256: the packed-weight GEMM serves only its K = 1536 down projections).
"""

from __future__ import annotations

import argparse
import json
import sys
from collections import defaultdict
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def linear_weights(model_dir: Path):
    """(name, 2-D weight) of every `*proj.weight` tensor in the checkpoint's safetensors."""
    from safetensors import safe_open

    files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        raise SystemExit(f"fallback_rows: no *.safetensors in {model_dir} (run `mxplus prepare`)")
    for f in files:
        with safe_open(str(f), "pt") as sf:
            for name in sf.keys():  # noqa: SIM118 (safe_open has no __iter__)
                if name.endswith("proj.weight"):
                    yield name, sf.get_tensor(name)


def count(model_dir: Path, scheme: str) -> dict:
    from vllm_mxplus.backends.cutlass.fp8_packed_gemm import K_MULTIPLE
    from vllm_mxplus.backends.cutlass.gemm import fallback_rows
    from vllm_mxplus.formats import get_scheme, quantize

    fmt = get_scheme(scheme).weight_format
    kinds: dict[str, dict[str, int]] = defaultdict(lambda: defaultdict(int))
    for name, w in linear_weights(model_dir):
        n, k = w.shape
        q = quantize(w.to(torch.float32), fmt)
        bad, packed_bad = fallback_rows(q.codes, q.scales, q.mbs, k)
        kind = kinds[name.split(".")[-2]]
        kind["tensors"] += 1
        kind["rows"] += n
        kind["inexact_rows"] += bad.numel()
        if k % K_MULTIPLE == 0:  # the K the packed-weight GEMM serves (`gemm.packed_serves`)
            kind["packed_rows"] += n
            kind["packed_fallback_rows"] += packed_bad.numel()
    total: dict[str, int] = defaultdict(int)
    for kind in kinds.values():
        for key, v in kind.items():
            total[key] += v
    return {"model": str(model_dir), "scheme": scheme, "weight_format": fmt,
            "by_kind": {k: dict(v) for k, v in sorted(kinds.items())}, "total": dict(total)}  # fmt: skip


def _pct(a: int, b: int) -> str:
    return f"{100 * a / b:.3f}%" if b else "-"


def main(argv: list[str] | None = None) -> int:
    from vllm_mxplus.assets.smollm2 import smollm2_dir

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", type=Path, default=None, help="checkpoint directory "
                    "(default: the SmolLM2-135M bf16 checkpoint of `mxplus prepare`)")  # fmt: skip
    ap.add_argument("--scheme", default="mxfp4-mbs", help="scheme whose weight format to use")
    ap.add_argument("--json", action="store_true", help="JSON instead of a table")
    args = ap.parse_args(argv)
    res = count(args.model or smollm2_dir(), args.scheme)
    if args.json:
        print(json.dumps(res, indent=1))
        return 0
    print(f"# {res['model']}, {res['scheme']} (weights as {res['weight_format']})")
    print(f"{'kind':<12}{'rows':>9}{'FP8 form inexact':>18}{'rows it serves':>22}"
          f"{'packed-GEMM fallback':>22}")  # fmt: skip
    for kind, v in [*res["by_kind"].items(), ("all", res["total"])]:
        pr = v.get("packed_rows", 0)
        print(f"{kind:<12}{v['rows']:>9}{_pct(v['inexact_rows'], v['rows']):>18}{pr:>22}"
              f"{_pct(v.get('packed_fallback_rows', 0), pr):>22}")  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
