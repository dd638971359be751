"""A GPU run's timings beside the static model's estimates of the same cases.

    python benchmarks/gpu_measured_vs_static.py [RESULT.json]

RESULT: a `scripts/gpu_check.sh` run, either its speed.json or a file of
benchmarks/results/ that holds it under "speed" (default: the newest gpu_check_*.json
there). Prints one Markdown table: per scheme and M, Llama-3-8B's four linears (one layer,
act-quant included) measured against the same linears in bf16, and the static estimate the
speed step put beside it (`benchmarks/gpu_static_model.py`, its commit named), with the ratio
measured / estimated. Then act-quant against a bf16 copy and one expert's GEMM.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results"


def load(path: Path | None) -> tuple[dict, dict]:
    """(the run's header, its speed step) from `path` or the newest result file."""
    if path is None:
        runs = sorted(RESULTS.glob("gpu_check_*.json"), key=lambda p: p.stat().st_mtime)
        if not runs:
            raise SystemExit(f"no gpu_check_*.json in {RESULTS}: pass a speed.json")
        path = runs[-1]
    doc = json.loads(path.read_text())
    speed = doc.get("speed", doc)
    if speed.get("step") != "speed":
        raise SystemExit(f"{path}: neither a speed step record nor a result file holding one")
    head = {k: doc.get(k) for k in ("commit", "machine", "command", "timing_method")}
    head["file"] = str(path.relative_to(ROOT) if path.is_relative_to(ROOT) else path)
    return head, speed


def rows(speed: dict) -> list[str]:
    out = [
        "| scheme | M | kernels (qkv) | measured µs | bf16 µs | measured ratio | "
        "estimated µs | estimated ratio | measured / estimated |",
        "|---|---:|---|---:|---:|---:|---:|---:|---:|",
    ]
    for c in speed.get("checks", []):
        if "M" not in c or not c.get("ok"):
            continue
        scheme = c["check"].split()[0]
        est = c.get("static_estimate")
        e_us = f"{est['ms'] * 1e3:.1f}" if est else "-"
        e_ratio = f"{est['speedup_vs_bf16']:.2f}×" if est else "-"
        over = f"{c['measured_over_estimate']:.1f}" if est else "-"
        out.append(
            f"| {scheme} | {c['M']} | {c['linears']['qkv']['backend']} | {c['ms'] * 1e3:.1f} | "
            f"{c['bf16_ms'] * 1e3:.1f} | {c['speedup_vs_bf16']:.2f}× | {e_us} | {e_ratio} | {over} |"
        )
    return out


def extras(speed: dict) -> list[str]:
    out = []
    for c in speed.get("checks", []):
        if c["check"].startswith("act-quant") and c.get("ok"):
            for case, r in c["results"].items():
                out.append(f"- act-quant {case}: {r['ms'] * 1e3:.1f} µs, a bf16 copy "
                           f"{r['copy_ms'] * 1e3:.1f} µs: {r['over_copy']:.2f}× the copy")  # fmt: skip
        if c["check"].startswith("one expert") and c.get("ok"):
            est = c.get("static_estimate") or {}
            out.append(f"- one expert's w13 GEMM at 64 tokens: {c['ms'] * 1e3:.1f} µs, bf16 "
                       f"{c['bf16_ms'] * 1e3:.1f} µs: {c['speedup_vs_bf16']:.2f}× (estimated "
                       f"{est.get('speedup_vs_bf16', float('nan')):.2f}×)")  # fmt: skip
        if not c.get("ok"):
            out.append(f"- FAILED {c['check']}: {str(c.get('error', ''))[:200]}")
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("result", nargs="?", type=Path, help="speed.json or a results file")
    args = ap.parse_args(argv)
    head, speed = load(args.result)
    est = speed.get("static_estimate_from") or {}
    print(f"# MEASURED: {head['machine'] or speed.get('device')}, commit {head['commit']} "
          f"({head['file']})")  # fmt: skip
    print(f"# {head['timing_method'] or 'CUDA-graph replay'}")
    print(f"# estimates: STATIC ESTIMATE from `{est.get('command')}` at commit "
          f"{est.get('commit')} (Triton {est.get('triton')})\n")  # fmt: skip
    print("\n".join(rows(speed)))
    print()
    print("\n".join(extras(speed)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
