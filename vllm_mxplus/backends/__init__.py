"""Fast paths and their dispatch: the reference backend, the backend registry, fake quant.

Imports neither vLLM nor Triton at import time; kernel backends register by import path.
"""

from vllm_mxplus.backends.base import LinearBackend, LinearSpec
from vllm_mxplus.backends.reference.linear import (
    ReferenceBackend,
    fake_quant_activation,
    reference_linear,
)
from vllm_mxplus.backends.selection import (
    LinearDispatch,
    current_platform_of,
    register_backend,
    registered_backends,
    select,
)

__all__ = [
    "LinearBackend",
    "LinearDispatch",
    "LinearSpec",
    "ReferenceBackend",
    "current_platform_of",
    "fake_quant_activation",
    "reference_linear",
    "register_backend",
    "registered_backends",
    "select",
]
