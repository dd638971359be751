"""Pipeline parallel (PP=2 on CPU): each stage loads, quantizes and runs its own layers.

A 4-layer tiny Llama split into two stages of two layers, served online (mxfp4-mbs quantized
at load on each stage) and from an `mxplus quantize` checkpoint: greedy output must equal
the single-process transformers fake-quant reference, which holds only if every stage got
its own layers' tensors (codes, E8M0 scales, MBS bytes) and nothing was quantized twice.
"""

from __future__ import annotations

import pytest
from integration_harness import gen_job, run_driver
from test_vllm_generate import _check_against_reference

pytestmark = pytest.mark.vllm


@pytest.fixture(scope="module")
def pp_models(tmp_path_factory) -> dict[str, str]:
    from tiny_models import build_tiny_llama, prequantize

    root = tmp_path_factory.mktemp("pp-models")
    src = build_tiny_llama(root / "tiny4", layers=4, seed=3)
    return {"src": str(src), "pre": str(prequantize(src, root / "tiny4-mbs", "mxfp4-mbs"))}


@pytest.fixture(scope="module")
def pp_run(pp_models, tmp_path_factory, subprocess_env):
    jobs = [{**gen_job("pp2-online", pp_models["src"], "mxfp4-mbs"), "pp": 2},
            {**gen_job("pp2-pre", pp_models["pre"], None), "pp": 2}]
    return run_driver(jobs, tmp_path_factory.mktemp("pp"), subprocess_env, tp=True)


@pytest.mark.parametrize("kind", ["pp2-online", "pp2-pre"])
def test_pp2_matches_single_process_reference(pp_run, pp_models, kind):
    _check_against_reference(pp_run[0][kind], pp_models["src"], "mxfp4-mbs")
