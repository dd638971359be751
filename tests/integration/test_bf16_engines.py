"""bf16 engines in both of vLLM's process layouts: what dies on Intel AMX hosts without the
plugin's AMX permission request (`vllm_mxplus.platform_amx`).

vLLM CPU 0.32 runs bf16 attention with AMX tiles where the CPU has them (a tiny Llama with
head_dim 64 is enough), and Linux kills a process that uses tiles without having asked
(SIGILL, exit -4). The plugin asks in every process it is loaded into, so these engines must
generate in a fresh process with VLLM_ENABLE_V1_MULTIPROCESSING=0 (engine in the driver
process) and with the default multiprocess engine (engine core in a spawned child).
`vllm serve` of the same bf16 model is `test_vllm_server.py`. On a CPU without AMX these are
plain bf16 generation tests.
"""

from __future__ import annotations

import math

import pytest
from integration_harness import MAX_TOKENS, PROMPTS, gen_job, run_driver

pytestmark = [pytest.mark.vllm, pytest.mark.slow]

TIMEOUT_S = 900


def _bf16_jobs(model: str) -> list[dict]:
    jobs = [
        dict(gen_job("bf16-mxfp4-mbs", model, "mxfp4-mbs"), dtype="bfloat16"),
        dict(gen_job("bf16-unquantized", model, None), dtype="bfloat16"),
    ]
    return jobs


@pytest.fixture(scope="module")
def bf16_runs(tiny_models, tmp_path_factory, subprocess_env) -> dict[str, tuple[dict, str]]:
    model = tiny_models["tiny256"]  # hidden 256, 4 heads: head_dim 64, saved in bf16
    jobs = _bf16_jobs(model)
    return {
        "in-process": run_driver(
            jobs, tmp_path_factory.mktemp("bf16-inproc"), subprocess_env, timeout=TIMEOUT_S
        ),
        "multiprocess": run_driver(
            jobs,
            tmp_path_factory.mktemp("bf16-mp"),
            subprocess_env,
            timeout=TIMEOUT_S,
            multiprocess=True,
        ),
    }


def _check_generated(res: dict | None, log: str) -> None:
    assert res is not None, f"the driver died before this job (SIGILL?):\n{log[-3000:]}"
    assert res.get("error") is None, res.get("trace", res.get("error"))
    assert len(res["tokens"]) == len(PROMPTS)
    assert all(len(t) == MAX_TOKENS for t in res["tokens"])
    assert all(not math.isnan(lp) and lp <= 0.0 for lps in res["logprobs"] for lp in lps)


@pytest.mark.parametrize("mode", ["in-process", "multiprocess"])
@pytest.mark.parametrize("job", ["bf16-mxfp4-mbs", "bf16-unquantized"])
def test_bf16_engine_generates(bf16_runs, mode, job):
    results, log = bf16_runs[mode]
    _check_generated(results.get(job), log)


def test_multiprocess_model_ran_in_a_child_process(bf16_runs):
    """The quantized layers were built in vLLM's worker process, not the driver: the plugin
    (and with it the AMX request) ran there."""
    _, log = bf16_runs["multiprocess"]
    lines = [ln for ln in log.splitlines() if "mxplus mxfp4-mbs on cpu" in ln]
    assert lines and all(not ln.startswith("(MainProcess") for ln in lines), lines


@pytest.mark.parametrize("job", ["bf16-mxfp4-mbs", "bf16-unquantized"])
def test_process_layouts_agree_on_the_first_tokens(bf16_runs, job):
    """Same model, same greedy decoding: both layouts start the same way. W4A4 on a random
    tiny model is chaotic (docs/numerics.md, QSNR), so only the first tokens are compared; a
    broken layout (wrong weights in the child, garbage attention) differs at step 0."""
    a, b = (bf16_runs[m][0].get(job) for m in ("in-process", "multiprocess"))
    if not (a and b and a.get("tokens") and b.get("tokens")):
        pytest.skip("a run failed; test_bf16_engine_generates says why")
    first = [x[:2] == y[:2] for x, y in zip(a["tokens"], b["tokens"])]
    assert sum(first) >= len(PROMPTS) - 1, (a["tokens"], b["tokens"])
