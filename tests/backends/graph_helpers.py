"""CUDA-graph helpers shared by the GPU tests of tests/backends."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch


def replay_with(op: Callable[[torch.Tensor], Any], x: torch.Tensor, fresh: torch.Tensor) -> Any:
    """op(x) captured in a CUDA graph (compiled outside the capture), x refilled with fresh
    and the graph replayed: op's output, which must now hold op(fresh)."""
    op(x)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = op(x)
    x.copy_(fresh)
    graph.replay()
    return out
