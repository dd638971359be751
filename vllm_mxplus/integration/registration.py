"""`register_all()`: make every scheme a vLLM quantization name. Idempotent, lazy imports.

Runs in every vLLM process through the `vllm.general_plugins` entry point.
"""

from __future__ import annotations

import logging

_REGISTERED = False


class _ForwardToVllm(logging.Handler):
    """Hands our records to vLLM's logger at emit time: vLLM may configure its handlers
    after the plugin is registered, so copying them at registration time can copy none."""

    def emit(self, record: logging.LogRecord) -> None:
        logging.getLogger("vllm").handle(record)


def _route_logs_to_vllm() -> None:
    """Our loggers (`vllm_mxplus.*`) print through vLLM's handlers at INFO, once."""
    ours = logging.getLogger("vllm_mxplus")
    if any(isinstance(h, _ForwardToVllm) for h in ours.handlers):
        return
    ours.addHandler(_ForwardToVllm())
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
