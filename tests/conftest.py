"""Shared test settings: offline hubs and a small vLLM CPU KV cache for every subprocess."""

from __future__ import annotations

import os

import pytest

VLLM_CPU_ENV = {
    "VLLM_CPU_KVCACHE_SPACE": "1",  # GiB; the default takes 90% of RAM
    "HF_HUB_OFFLINE": "1",
    "HF_DATASETS_OFFLINE": "1",
    "TOKENIZERS_PARALLELISM": "false",
}
for _k, _v in VLLM_CPU_ENV.items():
    os.environ.setdefault(_k, _v)

# Triton picks interpreter or compiler when a kernel module is first imported, which may
# happen while collecting any test directory: without CUDA, interpret (Triton has no CPU backend).
try:
    import torch

    if not torch.cuda.is_available():
        os.environ.setdefault("TRITON_INTERPRET", "1")
except ImportError:  # pragma: no cover - torch is a core dependency
    pass


def pytest_collection_modifyitems(config, items) -> None:
    """Files holding a slow or vLLM-engine test (`slow`, `vllm` markers) run first, each file
    whole and in collection order otherwise: with `scripts/test.sh`'s parallel workers
    (pytest-xdist, whole files per worker) the long files start early and the short ones
    fill in after them, where one long file left to the end ran alone on one worker."""
    heavy = {
        it.path for it in items if it.get_closest_marker("slow") or it.get_closest_marker("vllm")
    }
    items.sort(key=lambda it: it.path not in heavy)  # a stable sort: files stay whole


@pytest.fixture(scope="session")
def subprocess_env() -> dict[str, str]:
    """os.environ plus the vLLM CPU settings, for tests that start vLLM processes."""
    return {**os.environ, **VLLM_CPU_ENV}
