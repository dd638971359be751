"""Fixtures for tests/checkpoint."""

from __future__ import annotations

from pathlib import Path

import pytest
from ckpt_helpers import make_llama


@pytest.fixture(scope="session")
def llama_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Untied tiny llama: K = 64 (attention, gate/up) and K = 100 (down_proj)."""
    return make_llama(tmp_path_factory.mktemp("src") / "llama")
