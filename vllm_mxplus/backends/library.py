"""The project's one torch custom-op namespace: every op is `torch.ops.vllm_mxplus.<name>`,
whether defined in Python (`torch.library.custom_op`) or in C++ (`TORCH_LIBRARY_FRAGMENT`)."""

OP_NAMESPACE = "vllm_mxplus"


def op_name(name: str) -> str:
    """The qualified name `vllm_mxplus::<name>` for torch.library."""
    return f"{OP_NAMESPACE}::{name}"
