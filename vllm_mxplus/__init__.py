"""vllm-mxplus: MXFP4 with Overflow-Aware Scaling and Macro Block Scaling for vLLM."""

__version__ = "0.1.0"


def register() -> None:
    """vLLM general-plugin entry point (runs in every vLLM process); idempotent, lazy."""
    from vllm_mxplus.integration.registration import register_all

    register_all()
