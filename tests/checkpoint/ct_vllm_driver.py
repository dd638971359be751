"""Serve a compressed-tensors checkpoint with vLLM's in-tree method on CPU (a subprocess of
test_ckpt_ct_vllm.py): `python ct_vllm_driver.py MODEL OUT.json [--emulate]`.

vLLM 0.32's CPU platform lists no NVFP4 / MXFP4 linear kernel, so the in-tree method fails
at load ("Failed to find a kernel that can implement the NVFP4 linear layer"). --emulate adds
vLLM's own pure-torch `EmulationNvFp4LinearKernel` (listed for ROCm) to the CPU list, so the
unchanged compressed-tensors method loads and runs the checkpoint. OUT.json gets the quant
config class, greedy tokens, and for layer 0's o_proj the loaded parameters and its output
on a fixed input (lists), or the error.
"""

from __future__ import annotations

import json
import sys
import traceback

import torch

PROMPT = [1, 5, 7, 9, 11]
MAX_TOKENS = 6
# the tiny model's tokenizer is a stub: token ids in, token ids out
ENGINE_ARGS = {
    "skip_tokenizer_init": True,
    "dtype": "float32",
    "enforce_eager": True,
    "max_model_len": 64,
    "max_num_seqs": 2,
}


def _probe(model: torch.nn.Module) -> dict:
    layer = model.model.layers[0].self_attn.o_proj
    g = torch.Generator().manual_seed(0)
    x = torch.randn(3, layer.input_size_per_partition, generator=g)
    y = layer.quant_method.apply(layer, x)
    params = {n: p.detach() for n, p in layer.named_parameters()}
    return {
        "method": type(layer.scheme).__name__,
        "weight": params["weight"].view(torch.uint8).tolist(),
        "weight_scale": params["weight_scale"].view(torch.uint8).tolist(),
        "weight_global_scale": float(params["weight_global_scale"]),
        "input_global_scale_inv": float(params["input_global_scale_inv"]),
        "x": x.tolist(),
        "y": y.tolist(),
    }


def main(model_dir: str, out: str, emulate: bool) -> None:
    res: dict = {}
    try:
        if emulate:
            from vllm.model_executor.kernels import linear as kernels
            from vllm.platforms import PlatformEnum

            kernels._POSSIBLE_NVFP4_KERNELS[PlatformEnum.CPU] = [kernels.EmulationNvFp4LinearKernel]
        from vllm import LLM, SamplingParams
        from vllm.inputs import TokensPrompt

        llm = LLM(model=model_dir, **ENGINE_ARGS)
        res["quantization"] = llm.llm_engine.vllm_config.model_config.quantization
        res["layer"] = llm.apply_model(_probe)[0]
        sp = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, detokenize=False)
        gen = llm.generate([TokensPrompt(prompt_token_ids=PROMPT)], sp, use_tqdm=False)
        res["tokens"] = list(gen[0].outputs[0].token_ids)
    except Exception as e:  # reported to the test, which judges it
        res["error"] = f"{type(e).__name__}: {e}"
        res["trace"] = traceback.format_exc()[-4000:]
    with open(out, "w") as f:
        json.dump(res, f)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], "--emulate" in sys.argv[3:])
