"""Run a config: one lm-eval worker process per cell, resumable, with a progress bar.

A cell is (model, row, group of tasks that share few-shot / limit settings): one vLLM engine
start. Finished work is detected from the saved lm-eval JSON files under
OUT/raw/<model>/<row>/, task by task, so an interrupted study resumes where it stopped and
a task added to a config later runs alone.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import shlex
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from vllm_mxplus.evaluation.config import EvalConfig, ModelSpec, RowSpec, TaskSpec

# the directory holding the vllm_mxplus package this process runs: its workers import the same
PACKAGE_ROOT = str(Path(__file__).resolve().parents[2])

log = logging.getLogger(__name__)

# vLLM 0.32 on CPU takes 90% of RAM for its KV cache by default; no hub is reachable.
DEFAULT_ENV = {
    "VLLM_CPU_KVCACHE_SPACE": "1",
    "HF_HUB_OFFLINE": "1",
    "HF_DATASETS_OFFLINE": "1",
    "TOKENIZERS_PARALLELISM": "false",
    # One engine step of a long-window perplexity batch can take minutes on a CPU (bf16
    # without avx512_bf16, a loaded machine): vLLM's 300 s default killed such a cell.
    "VLLM_EXECUTE_MODEL_TIMEOUT_SECONDS": "7200",
}


@dataclass
class Cell:
    model: ModelSpec
    row: RowSpec
    tasks: tuple[TaskSpec, ...]
    limit: float | None
    num_fewshot: int | None
    out: Path  # the results JSON this cell writes
    model_path: str
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def name(self) -> str:
        return f"{self.model.id}/{self.row.id}: {', '.join(t.task for t in self.tasks)}"


def cell_dir(out_dir: Path, model_id: str, row_id: str) -> Path:
    return out_dir / "raw" / model_id / row_id


def saved_results(out_dir: Path, model_id: str, row_id: str) -> list[dict]:
    """Every readable lm-eval results JSON saved for (model, row), oldest first."""
    found = []
    for f in sorted(cell_dir(out_dir, model_id, row_id).glob("*.json")):
        try:
            data = json.loads(f.read_text())
        except (OSError, json.JSONDecodeError):
            log.warning("ignoring unreadable results file %s", f)
            continue
        if isinstance(data, dict) and isinstance(data.get("results"), dict):
            data.setdefault("mxplus", {})["file"] = str(f)
            found.append(data)

    def when(data: dict) -> float:  # lm-eval's own timestamp (file mtimes do not survive git)
        try:
            return float(data.get("date", 0.0))
        except (TypeError, ValueError):
            return 0.0

    return sorted(found, key=when)


def saved_limit(data: dict) -> float | None:
    lim = data.get("mxplus", {}).get("limit", data.get("config", {}).get("limit"))
    return None if lim is None else float(lim)


def task_done(data: dict, task: TaskSpec, limit: float | None) -> bool:
    """A saved file holds task's metric, measured with the same limit."""
    res = data["results"].get(task.task)
    if not isinstance(res, dict) or task.metric not in res:
        return False
    want = None if limit is None else float(limit)
    return saved_limit(data) == want


def effective_limit(task: TaskSpec, override: float | None) -> float | None:
    return override if override is not None else task.limit


def resolve_model_paths(
    cfg: EvalConfig,
    overrides: Sequence[str],
    check: bool = True,
    models: Sequence[str] | None = None,
) -> dict[str, str]:
    """--model DIR (one-model configs) or --model ID=DIR; returns model id -> path.

    check: a local path (absolute, ~ or .) must be a model dir with config.json; with
    `models`, only those models' paths are checked (the others are not run).
    """
    paths = {m.id: m.path for m in cfg.models}
    for item in overrides:
        if "=" in item and item.split("=", 1)[0] in paths:
            mid, path = item.split("=", 1)
        elif len(cfg.models) == 1:
            mid, path = cfg.models[0].id, item
        else:
            raise ValueError(
                f"--model {item}: the config has models {', '.join(paths)}; write --model ID=DIR"
            )
        paths[mid] = path
    for mid, path in paths.items():
        expanded = os.path.expanduser(path)
        if os.path.isabs(expanded) or path.startswith(("~", ".")):
            checked = check and (models is None or mid in models)
            if checked and not Path(expanded, "config.json").is_file():
                raise ValueError(f"model {mid}: {expanded} is not a model dir (no config.json)")
            paths[mid] = expanded
    return paths


def plan(
    cfg: EvalConfig,
    out_dir: Path,
    model_paths: dict[str, str],
    rows: Sequence[str] | None = None,
    limit: float | None = None,
    models: Sequence[str] | None = None,
) -> tuple[list[Cell], int]:
    """The cells still to run, and the number of (model, row, task) results already saved.

    rows / models: only these row / model ids (default: all of the config's).
    """
    selected = [cfg.row(r) for r in rows] if rows else list(cfg.rows)
    run_models = [cfg.model(m) for m in models] if models else list(cfg.models)
    cells: list[Cell] = []
    done = 0
    for model in run_models:
        for row in selected:
            saved = saved_results(out_dir, model.id, row.id)
            pending: dict[tuple, list[TaskSpec]] = {}
            for task in cfg.tasks:
                lim = effective_limit(task, limit)
                if any(task_done(d, task, lim) for d in saved):
                    done += 1
                    continue
                key = (lim,) + task.group_key()
                pending.setdefault(key, []).append(task)
            for key, tasks in pending.items():
                lim, fewshot = key[0], key[1]
                tag = hashlib.sha1(
                    json.dumps([[t.task for t in tasks], lim, fewshot], sort_keys=True).encode()
                ).hexdigest()[:8]
                stem = f"fs{'default' if fewshot is None else fewshot}-{tag}"
                cells.append(
                    Cell(
                        model=model,
                        row=row,
                        tasks=tuple(tasks),
                        limit=lim,
                        num_fewshot=fewshot,
                        out=cell_dir(out_dir, model.id, row.id) / f"{stem}.json",
                        model_path=model_paths[model.id],
                    )
                )
    return cells, done


def model_args_for(cfg: EvalConfig, cell: Cell) -> dict[str, Any]:
    args: dict[str, Any] = {"pretrained": cell.model_path}
    args.update(cfg.model_args)
    args.update(cell.model.model_args)
    args.update(cell.row.model_args)
    if cell.row.quantization is not None:
        args["quantization"] = cell.row.quantization
    return args


def worker_spec(cfg: EvalConfig, cell: Cell) -> dict[str, Any]:
    t0 = cell.tasks[0]
    limit = cell.limit
    if limit is not None and float(limit).is_integer():
        limit = int(limit)
    return {
        "model_args": model_args_for(cfg, cell),
        "tasks": [t.task for t in cell.tasks],
        "num_fewshot": cell.num_fewshot,
        "limit": limit,
        "include_path": str(cfg.include_path) if cfg.include_path else None,
        "out": str(cell.out),
        "batch_size": cfg.lm_eval.get("batch_size", "auto"),
        "seed": cfg.lm_eval.get("seed"),
        "log_samples": bool(cfg.lm_eval.get("log_samples", False)),
        "apply_chat_template": t0.apply_chat_template,
        "fewshot_as_multiturn": t0.fewshot_as_multiturn,
        "gen_kwargs": t0.gen_kwargs,
        "meta": {
            "config": cfg.name,
            "model": cell.model.id,
            "row": cell.row.id,
            "quantization": cell.row.quantization,
        },
    }


def lm_eval_command(spec: dict[str, Any]) -> str:
    """The equivalent `lm_eval` CLI line (recorded for reproduction by hand).

    Run it from the include_path directory: local task files name their data relative to it.
    """
    margs = ",".join(f"{k}={v}" for k, v in spec["model_args"].items())
    parts = [
        "lm_eval",
        "--model",
        "vllm",
        "--model_args",
        margs,
        "--tasks",
        ",".join(spec["tasks"]),
        "--batch_size",
        str(spec["batch_size"]),
    ]
    if spec.get("num_fewshot") is not None:
        parts += ["--num_fewshot", str(spec["num_fewshot"])]
    if spec.get("limit") is not None:
        parts += ["--limit", str(spec["limit"])]
    if spec.get("include_path"):
        parts += ["--include_path", spec["include_path"]]
    if spec.get("apply_chat_template"):
        parts += ["--apply_chat_template"]
    if spec.get("fewshot_as_multiturn"):
        parts += ["--fewshot_as_multiturn"]
    if spec.get("gen_kwargs"):
        parts += ["--gen_kwargs", spec["gen_kwargs"]]
    return " ".join(shlex.quote(p) for p in parts)


def run_cell(
    cfg: EvalConfig,
    cell: Cell,
    out_dir: Path,
    timeout: float | None = None,
    python: str = sys.executable,
) -> tuple[bool, float, Path]:
    """Run one worker process; returns (results file written, wall seconds, log path)."""
    spec = worker_spec(cfg, cell)
    spec["meta"]["lm_eval_command"] = lm_eval_command(spec)
    logs = out_dir / "logs"
    logs.mkdir(parents=True, exist_ok=True)
    stem = f"{cell.model.id}__{cell.row.id}__{cell.out.stem}"
    spec_path = logs / f"{stem}.spec.json"
    spec_path.write_text(json.dumps(spec, indent=2))
    log_path = logs / f"{stem}.log"
    env = {**os.environ, **DEFAULT_ENV, **cfg.env}
    for k in DEFAULT_ENV:  # a value the user exported wins over our default
        if k in os.environ:
            env[k] = os.environ[k]
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [PACKAGE_ROOT, os.environ.get("PYTHONPATH")]))
    t0 = time.time()
    with open(log_path, "w") as fh:
        fh.write(f"# {spec['meta']['lm_eval_command']}\n")
        fh.flush()
        # Own process group: the worker leaves with os._exit, and vLLM's engine-core and
        # worker processes (same group) must not outlive it (each holds GBs of memory).
        proc = subprocess.Popen(
            # -P: no working directory first on sys.path, so the worker imports the package
            # this process imported (PACKAGE_ROOT), e.g. a clean worktree's, never the cwd's.
            [python, "-P", "-m", "vllm_mxplus.evaluation.worker", str(spec_path)],
            env=env,
            stdout=fh,
            stderr=subprocess.STDOUT,
            cwd=spec["include_path"] or None,
            start_new_session=True,
        )
        try:
            rc = proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            rc = -1
            fh.write(f"\n# mxplus eval: cell timed out after {timeout} s\n")
        finally:
            _kill_group(proc)
    wall = time.time() - t0
    ok = cell.out.is_file()
    if ok and rc != 0:
        log.warning("%s: worker exited with %s after writing its results (kept)", cell.name, rc)
    return ok, wall, log_path


def _kill_group(proc: subprocess.Popen) -> None:
    """SIGTERM, then SIGKILL, whatever is left of the worker's process group."""
    import signal

    for sig, grace in ((signal.SIGTERM, 5.0), (signal.SIGKILL, 0.0)):
        try:
            os.killpg(proc.pid, sig)
        except (ProcessLookupError, PermissionError):
            break
        deadline = time.time() + grace
        while time.time() < deadline:
            try:
                os.killpg(proc.pid, 0)
            except (ProcessLookupError, PermissionError):
                return
            time.sleep(0.2)
    with contextlib.suppress(subprocess.TimeoutExpired):
        proc.wait(timeout=5)


def tail(path: Path, n: int = 15) -> str:
    try:
        lines = path.read_text(errors="replace").splitlines()
    except OSError:
        return ""
    return "\n".join(lines[-n:])


def run_all(
    cfg: EvalConfig,
    out_dir: Path,
    cells: list[Cell],
    *,
    progress: bool = True,
    timeout: float | None = None,
    on_cell: Callable[[Cell, bool, float], None] | None = None,
) -> list[Cell]:
    """Run cells in order with a progress bar; returns the cells that failed."""
    from tqdm import tqdm

    failed: list[Cell] = []
    bar = tqdm(
        total=len(cells), disable=not progress, unit="cell", dynamic_ncols=True, file=sys.stderr
    )
    for cell in cells:
        if cell.out.is_file():  # another `mxplus eval` on the same OUT finished it meanwhile
            bar.write(f"{cell.name}: already saved by another run, skipped")
            bar.update(1)
            continue
        bar.set_description(f"{cell.model.id}/{cell.row.id}")
        bar.set_postfix_str(",".join(t.task for t in cell.tasks)[:60])
        ok, wall, log_path = run_cell(cfg, cell, out_dir, timeout=timeout)
        msg = f"{cell.name}: {'done' if ok else 'FAILED'} in {wall:.0f} s (log {log_path})"
        if ok:
            bar.write(msg)
        else:
            failed.append(cell)
            bar.write(msg + "\n" + tail(log_path))
        if on_cell:
            on_cell(cell, ok, wall)
        bar.update(1)
    bar.close()
    return failed
