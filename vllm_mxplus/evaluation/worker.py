"""One lm-eval call in its own process: `python -m vllm_mxplus.evaluation.worker SPEC.json`.

The runner starts one worker per cell (model x row x task group) so that every vLLM engine
lives in a fresh process: an engine that crashes or hangs at teardown (a vLLM 0.32 CPU
engine once died with SIGABRT after printing its results) cannot take the study with it.
The worker writes the lm-eval results JSON atomically, then leaves with os._exit(0) so that
teardown problems cannot turn a finished cell into a failure; the runner judges the cell by
that file, not by the exit code alone.

SPEC keys: model_args (dict for lm-eval's vllm model), tasks (list), num_fewshot, limit,
include_path, out (results JSON path), batch_size, seed, apply_chat_template,
fewshot_as_multiturn, gen_kwargs, meta (dict stored under "mxplus" in the output).
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path


def run_spec(spec: dict) -> dict:
    """Run lm-eval's simple_evaluate with the vLLM backend; returns its results dict."""
    import lm_eval
    from lm_eval.tasks import TaskManager

    include = spec.get("include_path")
    task_manager = TaskManager(include_path=include) if include else TaskManager()
    kwargs = dict(
        model="vllm",
        model_args=spec["model_args"],
        tasks=list(spec["tasks"]),
        num_fewshot=spec.get("num_fewshot"),
        limit=spec.get("limit"),
        batch_size=spec.get("batch_size", "auto"),
        task_manager=task_manager,
        log_samples=False,
        apply_chat_template=spec.get("apply_chat_template", False),
        fewshot_as_multiturn=spec.get("fewshot_as_multiturn", False),
        gen_kwargs=spec.get("gen_kwargs"),
    )
    seed = spec.get("seed")
    if seed is not None:
        kwargs.update(
            random_seed=seed,
            numpy_random_seed=seed,
            torch_random_seed=seed,
            fewshot_random_seed=seed,
        )
    return lm_eval.simple_evaluate(**kwargs)


def source_revision() -> dict:
    """The git commit of the vllm_mxplus sources this worker ran, and whether they differed."""
    import subprocess

    pkg = Path(__file__).resolve().parents[1]
    try:
        head = subprocess.run(
            ["git", "-C", str(pkg), "rev-parse", "HEAD"], capture_output=True, text=True, timeout=10
        ).stdout.strip()
        dirty = subprocess.run(
            ["git", "-C", str(pkg), "status", "--porcelain", "--", "."],
            capture_output=True,
            text=True,
            timeout=10,
        ).stdout.split("\n")
    except (OSError, subprocess.SubprocessError):
        return {}
    if not head:
        return {}
    return {"git_commit": head, "modified_files": [line[3:] for line in dirty if line.strip()]}


def write_results(results: dict, spec: dict, wall_s: float) -> Path:
    from lm_eval.utils import handle_non_serializable

    out = Path(spec["out"])
    out.parent.mkdir(parents=True, exist_ok=True)
    results = dict(results)
    results.pop("samples", None)
    results["mxplus"] = {
        **spec.get("meta", {}),
        "wall_s": round(wall_s, 1),
        "limit": spec.get("limit"),
        "num_fewshot": spec.get("num_fewshot"),
        "tasks": list(spec["tasks"]),
        "source": spec.get("_source", {}),
    }
    tmp = out.with_name(f".{out.name}.tmp-{os.getpid()}")
    tmp.write_text(json.dumps(results, indent=2, default=handle_non_serializable))
    os.replace(tmp, out)
    return out


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) != 1:
        print("usage: python -m vllm_mxplus.evaluation.worker SPEC.json", file=sys.stderr)
        return 2
    spec = json.loads(Path(argv[0]).read_text())
    spec["_source"] = source_revision()  # at start: the code this engine loads
    t0 = time.time()
    results = run_spec(spec)
    if results is None:  # lm-eval returns None on non-zero ranks only
        print("worker: lm-eval returned no results", file=sys.stderr)
        return 1
    out = write_results(results, spec, time.time() - t0)
    print(f"worker: wrote {out} ({time.time() - t0:.0f} s)", flush=True)
    return 0


if __name__ == "__main__":
    rc = main()
    sys.stdout.flush()
    sys.stderr.flush()
    # Skip interpreter teardown: vLLM 0.32 CPU engines have aborted there; the
    # results file is already on disk.
    os._exit(rc)
