"""Where a vLLM CPU decode step goes: torch.profiler over one batched generate.

    OMP_NUM_THREADS=1 python benchmarks/profile_serve_step.py [--scheme mxfp4-mbs-s | bf16]
        [--streams 16] [--prompt-tokens 128] [--tokens 32] [--threads 1] [--rows 25]
        [--llama8b-shaped] [--compile]

One vLLM engine (in-process; eager, or with --compile vLLM's default torch.compile mode) on
the embedded SmolLM2 (`mxplus prepare`) or, with
--llama8b-shaped, on bench_serve_cpu.py's random 2-layer Llama with Llama-3-8B linear shapes
(built on the fly; `--streams 4 --prompt-tokens 8 --tokens 64` is its decode case), --streams
prompts of --prompt-tokens tokens, --tokens greedy tokens each, profiled after a warm-up; it
prints the tokens/s under the profiler (lower than without it) and the ops by CPU self time,
so each share is that of the profiled step: the plugin's linears appear as
`vllm_mxplus::cpu_mx_linear`, vLLM's bf16 lm_head as `_C::onednn_mm`. A diagnostic, not a
benchmark: compare rates with bench_vs_llamacpp.py / bench_serve_cpu.py, which run unprofiled.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from pathlib import Path


def main() -> int:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--scheme", default="mxfp4-mbs-s", help="a scheme, or bf16 (unquantized)")
    ap.add_argument("--streams", type=int, default=16)
    ap.add_argument("--prompt-tokens", type=int, default=128)
    ap.add_argument("--tokens", type=int, default=32)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--rows", type=int, default=25, help="ops to list")
    ap.add_argument(
        "--llama8b-shaped",
        action="store_true",
        help="a random 2-layer Llama with Llama-3-8B linear shapes instead of SmolLM2",
    )
    ap.add_argument(
        "--compile",
        action="store_true",
        help="vLLM's default compiled mode (torch.compile) instead of eager: the plugin's "
        "linears then appear as the op the compiled graph calls",
    )
    args = ap.parse_args()
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from _cpu_engine import in_process_engine_env

    in_process_engine_env(args.threads)
    from bench_serve_cpu import _smollm2_dir
    from torch.profiler import ProfilerActivity, profile
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    tmp = tempfile.TemporaryDirectory()
    if args.llama8b_shaped:
        # the tiny random checkpoints are test fixtures (tests/integration/tiny_models.py)
        sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests" / "integration"))
        import tiny_models

        model = str(
            tiny_models.build_tiny_llama(
                Path(tmp.name) / "llama3-8b-shaped-2layer",
                hidden=4096,
                intermediate=14336,
                layers=2,
                heads=32,
                kv_heads=8,
                init_std=0.02,
            )
        )
        vocab = 512
    else:
        model = _smollm2_dir()
        vocab = 40000
    if model is None:
        raise SystemExit("SmolLM2 not prepared: run `mxplus prepare` first")
    llm = LLM(
        model=model,
        quantization=None if args.scheme == "bf16" else args.scheme,
        dtype="bfloat16",
        enforce_eager=not args.compile,
        max_model_len=512 if args.llama8b_shaped else 1024,  # the random model: 512 positions
        max_num_seqs=args.streams,
        seed=0,
        max_num_batched_tokens=2048,
        enable_prefix_caching=False,
    )
    prompts = [
        TokensPrompt(
            prompt_token_ids=[
                (i * 7919 + s * 104729 + 13) % (vocab - 8) + 4 for i in range(args.prompt_tokens)
            ]
        )
        for s in range(args.streams)
    ]
    llm.generate(prompts, SamplingParams(max_tokens=2), use_tqdm=False)  # warm-up
    sp = SamplingParams(max_tokens=args.tokens, temperature=0.0, ignore_eos=True)
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        t0 = time.perf_counter()
        llm.generate(prompts, sp, use_tqdm=False)
        dt = time.perf_counter() - t0
    print(
        f"{args.scheme}, {args.streams} streams: {args.streams * args.tokens / dt:.1f} tokens/s "
        f"under the profiler, load {os.getloadavg()}"
    )
    print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=args.rows))
    sys.stdout.flush()
    os._exit(0)  # vLLM CPU 0.32 has aborted at engine shutdown after printing results


if __name__ == "__main__":
    raise SystemExit(main())
