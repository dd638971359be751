"""Greedy completions from vLLM (CPU or GPU) with the vllm-mxplus plugin: a smoke check.

    python scripts/generate.py MODEL_DIR [--quantization mxfp4-mbs] [--max-tokens 24]

A checkpoint written by `mxplus quantize` is detected with no --quantization; a bf16 one is
quantized at load when --quantization names a scheme.
"""

from __future__ import annotations

import argparse
import gc
import os

PROMPTS = [
    "The capital of France is",
    "The theory of relativity was developed by",
    "Water boils at a temperature of",
]


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("model")
    ap.add_argument("--quantization", default=None, help="scheme name (default: from config.json)")
    ap.add_argument("--max-tokens", type=int, default=24)
    args = ap.parse_args()
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from vllm import LLM, SamplingParams

    llm = LLM(
        model=args.model,
        quantization=args.quantization,
        enforce_eager=True,
        max_model_len=512,
        dtype="bfloat16",
    )
    outs = llm.generate(PROMPTS, SamplingParams(temperature=0.0, max_tokens=args.max_tokens))
    for o in outs:
        print(f"{o.prompt!r} -> {o.outputs[0].text!r}")
    # shut the engine down before interpreter exit (a vLLM 0.32 CPU engine aborted at teardown)
    del llm
    gc.collect()


if __name__ == "__main__":
    main()
