"""Shared piece of the CPU serving benchmarks: the environment of an in-process vLLM engine."""

from __future__ import annotations

import os


def in_process_engine_env(threads: int):
    """Environment for vLLM CPU engines run in this process on `threads` threads, set before
    vLLM is imported (a variable the user exported wins, but OMP_NUM_THREADS); returns torch."""
    os.environ["OMP_NUM_THREADS"] = str(threads)
    for k, v in {
        "VLLM_CPU_OMP_THREADS_BIND": "nobind",
        "VLLM_CPU_KVCACHE_SPACE": "2",
        "HF_HUB_OFFLINE": "1",
        "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
    }.items():
        os.environ.setdefault(k, v)
    import torch

    torch.set_num_threads(threads)
    return torch
