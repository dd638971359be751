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

With the hub offline (HF_DATASETS_OFFLINE / HF_HUB_OFFLINE, `mxplus eval`'s default), tasks
whose data `mxplus prepare` has put in the asset cache (ARC, HellaSwag, PIQA, WinoGrande,
LAMBADA, MMLU) load it from there with lm-eval's own task definitions
(vllm_mxplus.evaluation.offline_data); the copies used are listed under
mxplus.offline_data in the output.
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

from vllm_mxplus.evaluation.offline_data import hub_offline, use_local_benchmarks


def run_spec(spec: dict, offline_used: dict[str, str] | None = None) -> dict:
    """Run lm-eval's simple_evaluate with the vLLM backend; returns its results dict.

    offline_used: filled with the prepared local datasets loaded instead of the hub.
    """
    import contextlib

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
        log_samples=bool(spec.get("log_samples", False)),
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
    local = use_local_benchmarks(used=offline_used) if hub_offline() else contextlib.nullcontext()
    with local:
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


def per_item_metrics(samples: dict) -> dict[str, dict[str, list]]:
    """task -> {"doc_id": [...], metric: [...]} from lm-eval's logged samples, for paired
    tests between rows on the same items (vllm_mxplus.evaluation.paired). A metric's per-item
    value is what lm-eval aggregates: 0/1 for acc / acc_norm, the loglikelihood of the target
    for LAMBADA's perplexity."""
    out: dict[str, dict[str, list]] = {}
    for task, recs in samples.items():
        recs = sorted(recs, key=lambda r: r["doc_id"])
        if not recs:
            continue
        names = [
            k
            for k, v in recs[0].items()
            if k in recs[0].get("metrics", ()) and isinstance(v, (int, float))
        ]
        entry: dict[str, list] = {
            "doc_id": [r["doc_id"] for r in recs],
            "doc_hash": [r.get("doc_hash") for r in recs],
        }
        for name in names:
            entry[name] = [float(r[name]) for r in recs]
        out[task] = entry
    return out


def write_results(
    results: dict, spec: dict, wall_s: float, offline_data: dict[str, str] | None = None
) -> Path:
    from lm_eval.utils import handle_non_serializable

    out = Path(spec["out"])
    out.parent.mkdir(parents=True, exist_ok=True)
    results = dict(results)
    items = per_item_metrics(results.pop("samples", None) or {})
    results["mxplus"] = {
        **spec.get("meta", {}),
        "wall_s": round(wall_s, 1),
        "limit": spec.get("limit"),
        "num_fewshot": spec.get("num_fewshot"),
        "tasks": list(spec["tasks"]),
        "source": spec.get("_source", {}),
        "offline_data": offline_data or {},
    }
    if items:
        results["mxplus"]["items"] = items
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
    offline_used: dict[str, str] = {}
    results = run_spec(spec, offline_used)
    if results is None:  # lm-eval returns None on non-zero ranks only
        print("worker: lm-eval returned no results", file=sys.stderr)
        return 1
    out = write_results(results, spec, time.time() - t0, offline_used)
    print(f"worker: wrote {out} ({time.time() - t0:.0f} s)", flush=True)
    return 0


if __name__ == "__main__":
    rc = main()
    sys.stdout.flush()
    sys.stderr.flush()
    # Skip interpreter teardown: vLLM 0.32 CPU engines have aborted there; the
    # results file is already on disk.
    os._exit(rc)
