"""The backends wing: every way a quantized linear or MoE layer runs.

- `base.py`: the one interface (`Backend`, `LinearBackend`, `ExpertBackend`, their specs);
- `selection.py`: the registry (a priority list per layer kind and platform) and the
  selector, with `VLLM_MXPLUS_BACKEND`; `selftest.py`: the first-use self-test;
- `linear_op.py`: the per-call pick by M inside one custom op (`LinearDispatch`);
- one sub-package per family, each owning its sources, build, ops and backends:
  `reference/` (torch on `vllm_mxplus.formats` values), `cpu/` (C++), `triton/`, `cutlass/`.

Imports no vLLM; the Triton family imports Triton only when it is installed, and compiled
extensions (the C++ CPU kernels, the CUTLASS extension) load at first use.
"""

from vllm_mxplus.backends.base import (
    Backend,
    ExpertBackend,
    ExpertSpec,
    ExpertWeights,
    LinearBackend,
    LinearSpec,
    Spec,
)
from vllm_mxplus.backends.linear_op import LinearDispatch
from vllm_mxplus.backends.reference.experts import ReferenceExperts
from vllm_mxplus.backends.reference.linear import (
    ReferenceBackend,
    fake_quant_activation,
    reference_linear,
)
from vllm_mxplus.backends.selection import (
    BackendUnavailable,
    current_platform_of,
    pick,
    register_backend,
    registered_backends,
    select,
)

__all__ = [
    "Backend",
    "BackendUnavailable",
    "ExpertBackend",
    "ExpertSpec",
    "ExpertWeights",
    "LinearBackend",
    "LinearDispatch",
    "LinearSpec",
    "ReferenceBackend",
    "ReferenceExperts",
    "Spec",
    "current_platform_of",
    "fake_quant_activation",
    "pick",
    "reference_linear",
    "register_backend",
    "registered_backends",
    "select",
]
