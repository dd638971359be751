"""Repository files that are scripts rather than package modules (scripts/, kernels/,
benchmarks/), loaded as modules by the tests that check them."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

REPO = Path(__file__).resolve().parents[1]


def load_repo_script(relpath: str, name: str | None = None) -> ModuleType:
    """REPO/relpath as a module named `name` (default: the file's stem), registered in
    sys.modules (dataclasses look their module up there)."""
    path = REPO / relpath
    name = name or path.stem
    spec = importlib.util.spec_from_file_location(name, path)
    if spec is None or spec.loader is None:
        raise ImportError(f"{path}: not a Python file that can be loaded as module {name!r}")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module
