"""The installed vllm-mxplus version, from package metadata (the one place it is read)."""

from __future__ import annotations

import importlib.metadata

try:
    __version__ = importlib.metadata.version("vllm-mxplus")
except importlib.metadata.PackageNotFoundError:  # a source tree that was never installed
    __version__ = "0+unknown"
