"""vLLM's compiled mode takes the right backend for every M (`vllm_mxplus::linear_dispatch`).

vLLM compiles the model once at its largest batch with the token count dynamic and Dynamo's
guards dropped. With two candidates per linear (a decode backend for M <= 16, the reference
above), a choice made in Python at trace time would send every call to the traced branch;
inside the custom op each call is routed by its own M. `dispatch_driver.py` records the M
each backend served while generating, in eager and in compiled mode.
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
from integration_harness import HERE

pytestmark = [pytest.mark.vllm, pytest.mark.slow]


@pytest.fixture(scope="module")
def routed(tiny_models, tmp_path_factory, subprocess_env) -> tuple[dict, str]:
    work = tmp_path_factory.mktemp("compiled-dispatch")
    out, log = work / "out.json", work / "log.txt"
    env = {**subprocess_env, "VLLM_ENABLE_V1_MULTIPROCESSING": "0"}
    with open(log, "w") as f:
        subprocess.run(
            [sys.executable, str(HERE / "dispatch_driver.py"), tiny_models["tiny256"], str(out)],
            env=env,
            stdout=f,
            stderr=subprocess.STDOUT,
            timeout=900,
            check=False,
        )
    results = json.loads(out.read_text()) if out.exists() else {}
    return results, log.read_text(errors="replace")


@pytest.mark.parametrize("mode", ["eager", "compiled"])
def test_each_call_routed_by_its_own_m(routed, mode):
    results, log = routed
    res = results.get(mode)
    assert res is not None, log[-3000:]
    assert res["error"] is None, res.get("trace")
    assert res["decode_m"] and max(res["decode_m"]) <= 16, res  # decode steps: M = 1..3
    assert res["ref_m"] and min(res["ref_m"]) >= 17, res  # the long prompt's prefill
    assert all(len(t) == 8 for t in res["tokens"])


def test_compiled_mode_really_compiled(routed):
    _, log = routed
    assert log.count("Warming up model for the compilation") == 1, log[-3000:]
    assert (
        "mxplus mxfp4-mbs on cpu (capability None): backends cpu-decode-test (M <= 16)"
        " > reference (M >= 17)" in log
    )
