"""`register_all()`: make every scheme a vLLM quantization name, and register the gpt-oss class
that loads the plugin's quantized experts (integration/gpt_oss_model.py; vLLM's own class in
every other case). Idempotent, lazy imports.

Runs in every vLLM process through the `vllm.general_plugins` entry point.
"""

from __future__ import annotations

import logging

from vllm_mxplus.formats import SCHEMES
from vllm_mxplus.integration.config import CONFIG_CLASSES

_REGISTERED = False
GPT_OSS_ARCH = "GptOssForCausalLM"
GPT_OSS_CLASS = "vllm_mxplus.integration.gpt_oss_model:MxplusGptOssForCausalLM"


class _ForwardToVllm(logging.Handler):
    """Hands our records to vLLM's handlers at emit time: vLLM may configure its handlers
    after the plugin is registered, so copying them at registration time can copy none.
    Calls the handlers directly (no propagation), so root handlers see a record once."""

    def emit(self, record: logging.LogRecord) -> None:
        for handler in logging.getLogger("vllm").handlers:
            if record.levelno >= handler.level:
                handler.handle(record)


def _route_logs_to_vllm() -> None:
    """Our loggers (`vllm_mxplus.*`) also print through vLLM's handlers, at INFO, once."""
    ours = logging.getLogger("vllm_mxplus")
    if any(type(h).__name__ == "_ForwardToVllm" for h in ours.handlers):
        return
    ours.addHandler(_ForwardToVllm())
    ours.setLevel(logging.INFO)


def register_all() -> list[str]:
    """Register one QuantizationConfig per scheme; returns the registered names."""
    global _REGISTERED

    if _REGISTERED:
        return list(SCHEMES)
    from vllm import ModelRegistry
    from vllm.model_executor.layers.quantization import register_quantization_config

    for name, cls in CONFIG_CLASSES.items():
        register_quantization_config(name)(cls)
    # by name: imported (with vLLM's gpt-oss module) only when a gpt-oss model is built
    ModelRegistry.register_model(GPT_OSS_ARCH, GPT_OSS_CLASS)
    _route_logs_to_vllm()
    _REGISTERED = True
    return list(SCHEMES)
