"""`register_all()`: make every scheme a vLLM quantization name. Idempotent, lazy imports.

Runs in every vLLM process through the `vllm.general_plugins` entry point.
"""

from __future__ import annotations

import logging

_REGISTERED = False


def _route_logs_to_vllm() -> None:
    """Our loggers (`vllm_mxplus.*`) print through vLLM's handler at INFO, once."""
    ours = logging.getLogger("vllm_mxplus")
    if ours.handlers:
        return
    vllm_logger = logging.getLogger("vllm")
    for handler in vllm_logger.handlers:
        ours.addHandler(handler)
    if ours.handlers:
        ours.setLevel(logging.INFO)
        ours.propagate = False


def register_all() -> list[str]:
    """Register one QuantizationConfig per scheme; returns the registered names."""
    global _REGISTERED
    from vllm_mxplus.formats import SCHEMES

    if _REGISTERED:
        return list(SCHEMES)
    from vllm.model_executor.layers.quantization import register_quantization_config

    from vllm_mxplus.integration.config import CONFIG_CLASSES

    for name, cls in CONFIG_CLASSES.items():
        register_quantization_config(name)(cls)
    _route_logs_to_vllm()
    _REGISTERED = True
    return list(SCHEMES)
