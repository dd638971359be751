"""Run a list of vLLM generation jobs in ONE process and write their results as JSON.

    python -m vllm_mxplus.evaluation.vllm_jobs JOBS.json OUT.json

Used by the integration tests (tests/integration/integration_harness.run_driver) and
eval/gptq/gptq_serve_check.py (greedy tokens and logprobs of served checkpoints).

Engine start-up (imports, spawn) dominates on a 2-core CI box, so a caller batches every
engine it needs into one run: with VLLM_ENABLE_V1_MULTIPROCESSING=0 the engines are
built one after another in this process (a few seconds each). Tensor-parallel jobs need the
multiprocess executor and run in a separate driver invocation.

A job: {"id", "model", "quantization" (or null), "dtype", "prompts" (strings, or lists of
token ids: some tokenizer classes that transformers forces by model type cannot encode the
test vocabulary), "max_tokens", "tp" (default 1), "pp" (default 1), "logprobs" (default 1),
"eager" (default true; false = vLLM's torch.compile mode), "backend" (distributed executor,
default vLLM's choice), "hf_overrides" (config fields set over the checkpoint's, default none),
"compilation_config" and "attention_config" (passed to `vllm.LLM` as they are, default none)}.
A result: {"tokens": [[int]], "logprobs": [[float]] (of the chosen tokens), "error": str or
null, "load_s", "gen_s"}.
"""

from __future__ import annotations

import gc
import json
import os
import sys
import time
import traceback
from pathlib import Path
from typing import Any

# job keys handed to vllm.LLM unchanged when set
PASSED_AS_IS = ("hf_overrides", "compilation_config", "attention_config")


def run_job(job: dict) -> dict:
    from vllm import LLM, SamplingParams

    t0 = time.time()
    try:
        llm = LLM(
            model=job["model"],
            quantization=job.get("quantization"),
            dtype=job["dtype"],
            enforce_eager=job.get("eager", True),
            max_model_len=256,
            max_num_seqs=8,
            max_num_batched_tokens=256,
            seed=0,
            tensor_parallel_size=job.get("tp", 1),
            pipeline_parallel_size=job.get("pp", 1),
            distributed_executor_backend=job.get("backend"),
            **{key: job[key] for key in PASSED_AS_IS if job.get(key)},
        )
    except Exception as e:  # noqa: BLE001 - load failures are results too (bad checkpoints)
        return {"error": f"{type(e).__name__}: {e}", "trace": traceback.format_exc()[-4000:]}
    t1 = time.time()
    sp = SamplingParams(
        max_tokens=job["max_tokens"],
        temperature=0.0,
        ignore_eos=True,
        logprobs=job.get("logprobs", 1),
    )
    prompts: list[Any] = [
        p if isinstance(p, str) else {"prompt_token_ids": p} for p in job["prompts"]
    ]
    try:
        outs = llm.generate(prompts, sp, use_tqdm=False)
    except Exception as e:  # noqa: BLE001 - e.g. an engine vLLM's CPU build loads, cannot run
        del llm
        return {"error": f"{type(e).__name__}: {e}", "trace": traceback.format_exc()[-4000:]}
    tokens: list[list[int]] = []
    logprobs: list[list[float]] = []
    for o in outs:
        c = o.outputs[0]
        tokens.append(list(c.token_ids))
        logprobs.append([lp[t].logprob for t, lp in zip(c.token_ids, c.logprobs or [])])  # type: ignore[index]
    del llm
    return {
        "tokens": tokens,
        "logprobs": logprobs,
        "error": None,
        "load_s": t1 - t0,
        "gen_s": time.time() - t1,
    }


def main() -> None:
    if len(sys.argv) != 3:
        print(
            "usage: python -m vllm_mxplus.evaluation.vllm_jobs JOBS.json OUT.json", file=sys.stderr
        )
        raise SystemExit(2)
    jobs = json.loads(Path(sys.argv[1]).read_text())
    from vllm.distributed import cleanup_dist_env_and_memory

    results = {}
    for job in jobs:
        results[job["id"]] = run_job(job)
        gc.collect()
        cleanup_dist_env_and_memory()
        with open(sys.argv[2], "w") as f:  # partial results survive a crash at shutdown
            json.dump(results, f)
    sys.stdout.flush()
    os._exit(0)  # skip interpreter teardown (vLLM 0.32 CPU sometimes SIGABRTs at shutdown)


if __name__ == "__main__":
    main()
