"""vLLM in compiled mode with TWO linear backends on the CPU, recording which M each served.

    python dispatch_driver.py MODEL OUT.json

The CPU registry normally holds one backend serving every M (no per-call choice). Here it
holds a decode-only copy of the C++ backend (M <= 16), so the selector appends the reference
for M >= 17 and every quantized linear goes through `vllm_mxplus::linear_dispatch`. The
engine runs in this process (VLLM_ENABLE_V1_MULTIPROCESSING=0), so the recording backends
are the ones vLLM calls. Written: {"eager"|"compiled": {"decode_m": [...], "ref_m": [...],
"tokens": [[...]], "error": str|null}}.
"""

from __future__ import annotations

import gc
import json
import os
import sys
import traceback

DECODE_MAX_M = 16
LONG_PROMPT = " ".join(["one two three four five six seven eight nine ten"] * 3)  # > 16 tokens
PROMPTS = [LONG_PROMPT, "hello world", "the capital of france is"]


def main() -> None:
    model, out_path = sys.argv[1], sys.argv[2]
    from vllm import LLM, SamplingParams
    from vllm.distributed import cleanup_dist_env_and_memory

    from vllm_mxplus.backends import selection as dispatch
    from vllm_mxplus.backends.cpu.linear import CpuPackedBackend
    from vllm_mxplus.backends.reference.linear import ReferenceBackend

    seen: dict[str, list[int]] = {"decode_m": [], "ref_m": []}

    class RecordingDecode(CpuPackedBackend):
        name, min_m, max_m = "cpu-decode-test", 1, DECODE_MAX_M

        def apply(self, layer, x, bias, act_global_scale=None):
            seen["decode_m"].append(x.numel() // x.shape[-1])
            return super().apply(layer, x, bias, act_global_scale)

    ref_apply = ReferenceBackend.apply

    def recording_ref_apply(self, layer, x, bias, act_global_scale=None):
        seen["ref_m"].append(x.numel() // x.shape[-1])
        return ref_apply(self, layer, x, bias, act_global_scale)

    ReferenceBackend.apply = recording_ref_apply
    dispatch._REGISTRY["linear"]["cpu"] = [RecordingDecode]

    results = {}
    for mode, eager in (("eager", True), ("compiled", False)):
        seen["decode_m"].clear()
        seen["ref_m"].clear()
        try:
            llm = LLM(
                model=model,
                quantization="mxfp4-mbs",
                dtype="float32",
                enforce_eager=eager,
                max_model_len=256,
                max_num_seqs=8,
                max_num_batched_tokens=256,
                seed=0,
            )
            after_load = {k: len(v) for k, v in seen.items()}
            outs = llm.generate(
                PROMPTS,
                SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True),
                use_tqdm=False,
            )
            results[mode] = {
                "error": None,
                "tokens": [list(o.outputs[0].token_ids) for o in outs],
                # only the calls made while generating (start-up runs dummy batches too)
                "decode_m": sorted(set(seen["decode_m"][after_load["decode_m"] :])),
                "ref_m": sorted(set(seen["ref_m"][after_load["ref_m"] :])),
            }
            del llm
        except Exception as e:
            results[mode] = {
                "error": f"{type(e).__name__}: {e}",
                "trace": traceback.format_exc()[-4000:],
            }
        gc.collect()
        cleanup_dist_env_and_memory()
        with open(out_path, "w") as f:
            json.dump(results, f)
    sys.stdout.flush()
    os._exit(0)  # skip interpreter teardown (SIGABRT seen at vLLM shutdown)


if __name__ == "__main__":
    main()
