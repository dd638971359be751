"""Driver of test_vllm_ray.py (a separate process: vLLM engines need `__main__` guarded).

    python ray_driver.py MODEL single|ray OUT.json

Greedy tokens of a few prompts from `vllm.LLM(MODEL)` in one process (`single`) or with
`tensor_parallel_size=2, distributed_executor_backend="ray"` on the Ray cluster at
RAY_ADDRESS (`ray`), and what each worker sees of the plugin, asked inside the worker with
`collective_rpc`: its pid, whether it runs under a Ray raylet, whether vllm_mxplus is
imported, the class vLLM returns for "mxfp4-mbs", and the quant methods of its layers.
On an exception, OUT.json holds {"error": "Type: message"} and the exit code is 1.
"""

from __future__ import annotations

import json
import os
import sys
import traceback

PROMPTS = ["the capital of france is", "one two three", "the river flows to the", "sun moon"]


def probe(worker) -> dict:  # noqa: ANN001  (runs inside each vLLM worker)
    from vllm.model_executor.layers.quantization import get_quantization_config

    cfg = get_quantization_config("mxfp4-mbs")
    model = worker.model_runner.model
    methods = sorted(
        {type(m.quant_method).__name__ for m in model.modules() if getattr(m, "quant_method", None)}
    )
    return {
        "pid": os.getpid(),
        "ray_worker": "RAY_RAYLET_PID" in os.environ,
        "plugin_imported": "vllm_mxplus" in sys.modules,
        "mxfp4-mbs": f"{cfg.__module__}.{cfg.__name__}",
        "quant_methods": methods,
    }


def main() -> int:
    model, mode, out = sys.argv[1:4]
    # collective_rpc sends `probe` (a function) to the engine core process: vLLM 0.32 pickles
    # it only when allowed (a local test, loopback only)
    os.environ.setdefault("VLLM_ALLOW_INSECURE_SERIALIZATION", "1")
    try:
        from vllm import LLM, SamplingParams

        kw: dict = {"enforce_eager": True, "max_model_len": 256, "dtype": "bfloat16"}
        if mode == "ray":
            kw.update(tensor_parallel_size=2, distributed_executor_backend="ray")
        llm = LLM(model, **kw)
        outs = llm.generate(PROMPTS, SamplingParams(temperature=0.0, max_tokens=12))
        res = {
            "tokens": [list(o.outputs[0].token_ids) for o in outs],
            "workers": llm.collective_rpc(probe),
            "driver_pid": os.getpid(),
        }
        del llm
    except Exception as e:  # noqa: BLE001  reported to the test, which shows it
        last = traceback.format_exc().strip().splitlines()[-1]
        res = {"error": f"{type(e).__name__}: {e}"[:2000], "last_line": last}
        with open(out, "w") as f:
            json.dump(res, f)
        return 1
    with open(out, "w") as f:
        json.dump(res, f)
    return 0


if __name__ == "__main__":
    sys.exit(main())
