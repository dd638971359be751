"""The vLLM job driver (`vllm_mxplus.evaluation.vllm_jobs`) with one more job key,
"compilation_config" (passed to `vllm.LLM` as is).

    python mla_driver.py JOBS.json OUT.json

The MLA judgement (mla_judge.py) needs it: vLLM 0.32's CPU `rotary_embedding` op rotates a
3-D query [tokens, heads, rope_dim] as tokens x heads rows of ONE head each, row t*heads + h
at positions[t*heads + h] (past the step's own positions for most rows), while the 1-head key
is rotated right. DeepSeek-V2's MLA passes exactly such a query (`q[..., qk_nope_head_dim:]`,
vllm/model_executor/layers/mla.py), so on CPU every head's q_pe but the first few rows is
rotated at a wrong position, with or without quantization. The MLA engines therefore run
with that op disabled (`RoPE_NATIVE`: vLLM's own torch rotary, `forward_native`).
Kept apart from vllm_jobs.py until that driver forwards the key itself.
Engines run in this process (VLLM_ENABLE_V1_MULTIPROCESSING=0), one after another.
"""

from __future__ import annotations

import functools
import json
import subprocess
import sys
from pathlib import Path

from vllm_mxplus.evaluation import vllm_jobs

# vLLM's torch rotary instead of the CPU op (compilation_config.custom_ops syntax).
RoPE_NATIVE = {"custom_ops": ["all", "-rotary_embedding"]}

_run_job = vllm_jobs.run_job


def run_job(job: dict) -> dict:
    """vllm_jobs.run_job, with `vllm.LLM` given the job's compilation_config (if any)."""
    import vllm

    cc = job.get("compilation_config")
    if cc is None:
        return _run_job(job)
    # the key is ours alone: a vllm_jobs that learns it would pass it twice
    rest = {k: v for k, v in job.items() if k != "compilation_config"}
    llm_cls = vllm.LLM
    vllm.LLM = functools.partial(llm_cls, compilation_config=cc)  # type: ignore[misc]
    try:
        return _run_job(rest)
    finally:
        vllm.LLM = llm_cls  # type: ignore[misc]


def run(jobs: list[dict], workdir: Path, env: dict, timeout: int = 900) -> tuple[dict, str]:
    """Run jobs in one driver process; returns (results by id, log text), as
    integration_harness.run_driver does for vllm_jobs."""
    jobs_file, out_file, log_file = (workdir / n for n in ("jobs.json", "out.json", "log.txt"))
    jobs_file.write_text(json.dumps(jobs))
    env = {**env, "VLLM_ENABLE_V1_MULTIPROCESSING": "0"}
    with open(log_file, "w") as log:
        subprocess.run(
            [sys.executable, str(Path(__file__)), str(jobs_file), str(out_file)],
            env=env,
            stdout=log,
            stderr=subprocess.STDOUT,
            timeout=timeout,
            check=False,
        )
    results = json.loads(out_file.read_text()) if out_file.exists() else {}
    return results, log_file.read_text(errors="replace")


if __name__ == "__main__":
    vllm_jobs.run_job = run_job  # main() looks run_job up in its module
    vllm_jobs.main()
