"""vllm-mxplus: MXFP4 with Overflow-Aware Scaling and Macro Block Scaling for vLLM."""

from vllm_mxplus.version import __version__

__all__ = ["__version__", "register"]


def register() -> None:
    """vLLM general-plugin entry point (runs in every vLLM process); idempotent, lazy.

    Also asks Linux for AMX tile permission on Intel AMX hosts before any model runs: vLLM
    CPU's AMX attention needs it and does not ask (see `vllm_mxplus.platform_amx`)."""
    from vllm_mxplus.integration.registration import register_all
    from vllm_mxplus.platform_amx import request_amx_permission

    request_amx_permission()
    register_all()
