"""A GPU run's timings beside the static model's estimates of the same cases.

    python benchmarks/gpu_measured_vs_static.py [RESULT.json]

RESULT: a `scripts/gpu_check.sh` run, either its speed.json or a file of
benchmarks/results/ that holds it under "speed" (default: the newest gpu_check_*.json
there). Prints one Markdown table: per scheme and M, Llama-3-8B's four linears (one layer,
act-quant included) measured against the same linears in bf16, and the static estimate the
speed step put beside it (`benchmarks/gpu_static_model.py`, its commit named), with the ratio
measured / estimated. Then act-quant against a bf16 copy and one expert's GEMM, and, where the
file also holds the sweep step (its sweep.json, or a results file with it under "sweep"; or
pass it with --sweep), the batched decode / prefill border: the 8B layer at each M on the
decode path, on the path served and in bf16, and the largest M up to which the decode path is
ahead of the served one (what `triton.linear.BATCHED_DECODE_MAX_M` would be by measurement).
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


BORDER_CHECK = "batched decode border"  # gpu_check.py's step_sweep: its check's name


def border(sweep: dict) -> list[str]:
    """The sweep's border case as a table, then the largest M up to which the decode path is
    ahead of (or level with) the served one at every M measured."""
    case = next((c for c in sweep.get("checks", []) if c["check"].startswith(BORDER_CHECK)), None)
    if case is None:
        return []
    if not case.get("ok"):
        return [f"- FAILED {case['check']}: {str(case.get('error', ''))[:200]}"]
    out = [
        "| M | decode path µs | served µs (qkv's backend) | bf16 µs | decode / bf16 | "
        "served / bf16 |",
        "|---:|---:|---:|---:|---:|---:|",
    ]
    ms = sorted(int(key[1:]) for key in case if key.startswith("M") and key[1:].isdigit())
    for m in ms:
        r = case[f"M{m}"]
        out.append(
            f"| {m} | {r['decode_us']:.1f} | {r['served_us']:.1f} ({r['served_by'][0]}) | "
            f"{r['bf16_us']:.1f} | {r['decode_vs_bf16']:.2f}× | {r['served_vs_bf16']:.2f}× |"
        )
    ahead_to = None
    for m in ms:  # from the smallest M up to the first where the decode path is behind
        if case[f"M{m}"]["decode_us"] > case[f"M{m}"]["served_us"]:
            break
        ahead_to = m
    out.append(
        f"- the decode path is ahead of the served path up to M = {ahead_to} of those measured"
        if ahead_to is not None
        else "- the decode path is behind the served path at every M measured"
    )
    return out


def load_sweep(path: Path | None, result: Path | None) -> dict | None:
    """The sweep step's record: from `path`, else from the results file `result` (under
    "sweep") when it holds one."""
    if path is not None:
        doc = json.loads(path.read_text())
        sweep = doc.get("sweep", doc)
        if sweep.get("step") != "sweep":
            raise SystemExit(f"{path}: neither a sweep step record nor a result file holding one")
        return sweep
    if result is None:
        return None
    sweep = json.loads(result.read_text()).get("sweep")
    return sweep if isinstance(sweep, dict) and sweep.get("step") == "sweep" else None


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("result", nargs="?", type=Path, help="speed.json or a results file")
    ap.add_argument("--sweep", type=Path, help="the same run's sweep.json (the border table)")
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
    sweep = load_sweep(args.sweep, args.result)
    table = border(sweep) if sweep else []
    if table:
        print(f"\n# MEASURED: the batched decode / prefill border (sweep step, {BORDER_CHECK})\n")
        print("\n".join(table))
    return 0


if __name__ == "__main__":
    sys.exit(main())
