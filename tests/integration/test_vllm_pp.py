"""Pipeline parallel (PP=2 on CPU): each stage loads, quantizes and runs its own layers.

A 4-layer tiny Llama split into two stages of two layers, served online (mxfp4-mbs quantized
at load on each stage) and from an `mxplus quantize` checkpoint: greedy output must equal
the single-process transformers fake-quant reference, which holds only if every stage got
its own layers' tensors (codes, E8M0 scales, MBS bytes) and nothing was quantized twice.

vLLM 0.32's CPU build loads a PP=2 engine but its second stage dies at the first step, also
without quantization (the unquantized control job): then the test records vLLM's error and
xfails; the GPU path is documented in docs/deploy.md.
"""

from __future__ import annotations

import pytest
from integration_harness import gen_job, run_driver
from test_vllm_generate import _check_against_reference

pytestmark = pytest.mark.vllm

# Where vLLM 0.32's CPU worker fails with PP > 1 (gpu_model_runner, second stage):
# `assert self.intermediate_tensors is not None`.
VLLM_CPU_PP_FAILURE = "sync_and_gather_intermediate_tensors"


@pytest.fixture(scope="module")
def pp_models(tmp_path_factory) -> dict[str, str]:
    from tiny_models import build_tiny_llama, prequantize

    root = tmp_path_factory.mktemp("pp-models")
    src = build_tiny_llama(root / "tiny4", layers=4, seed=3)
    return {"src": str(src), "pre": str(prequantize(src, root / "tiny4-mbs", "mxfp4-mbs"))}


@pytest.fixture(scope="module")
def pp_run(pp_models, tmp_path_factory, subprocess_env):
    jobs = [
        {**gen_job("pp2-none", pp_models["src"], None), "pp": 2},
        {**gen_job("pp2-online", pp_models["src"], "mxfp4-mbs"), "pp": 2},
        {**gen_job("pp2-pre", pp_models["pre"], None), "pp": 2},
    ]
    return run_driver(jobs, tmp_path_factory.mktemp("pp"), subprocess_env, tp=True)


@pytest.mark.parametrize("kind", ["pp2-online", "pp2-pre"])
def test_pp2_matches_single_process_reference(pp_run, pp_models, kind):
    results, log = pp_run
    if results["pp2-none"].get("error"):
        # vLLM itself cannot run PP here: the quantized engines must fail the same way.
        assert VLLM_CPU_PP_FAILURE in log, log[-3000:]
        assert results[kind].get("error"), results[kind]
        pytest.xfail(
            "vLLM 0.32 CPU cannot run pipeline_parallel_size=2, also unquantized: "
            f"{results['pp2-none']['error']} (worker: assert "
            "self.intermediate_tensors is not None in "
            f"{VLLM_CPU_PP_FAILURE})"
        )
    _check_against_reference(results[kind], pp_models["src"], "mxfp4-mbs")
