"""Fixtures for tests/checkpoint."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from ckpt_helpers import make_llama

import vllm_mxplus.checkpoint.quantizer as quantizer_mod


@pytest.fixture(scope="session")
def llama_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Untied tiny llama: K = 64 (attention, gate/up) and K = 100 (down_proj)."""
    return make_llama(tmp_path_factory.mktemp("src") / "llama")


@pytest.fixture
def random_tokens(monkeypatch: pytest.MonkeyPatch) -> None:
    """Calibration tokens as random ids (the tiny models' tokenizer is a stub)."""

    def fake(src, calib=None, nsamples=32, seqlen=512):  # noqa: ANN001, ANN202
        g = torch.Generator().manual_seed(0)
        return torch.randint(0, 96, (nsamples, seqlen), generator=g)

    monkeypatch.setattr(quantizer_mod, "calibration_tokens", fake)


@pytest.fixture
def calibrated(llama_dir: Path, tmp_path: Path, random_tokens: None):
    """(scheme, method[, macro_block]) -> (checkpoint dir, report): the tiny llama quantized
    by a calibrated method on random calibration tokens (4 x 16)."""
    from vllm_mxplus.checkpoint import quantize_checkpoint
    from vllm_mxplus.formats import MACRO_BLOCK

    def run(scheme: str, method: str, macro_block: int = MACRO_BLOCK):  # noqa: ANN202
        dst = tmp_path / f"{scheme}-{method}-mb{macro_block}"
        report = quantize_checkpoint(
            llama_dir,
            dst,
            scheme,
            method=method,
            nsamples=4,
            seqlen=16,
            macro_block=macro_block,
            progress=False,
        )
        return dst, report

    return run
