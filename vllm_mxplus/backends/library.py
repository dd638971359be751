"""The project's one torch custom-op namespace: every op is `torch.ops.vllm_mxplus.<name>`,
whether defined in Python (`torch.library.custom_op`, or `define_op` below for an op on the
per-call path) or in C++ (`TORCH_LIBRARY_FRAGMENT`)."""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch.library import Library, infer_schema, register_fake

OP_NAMESPACE = "vllm_mxplus"

# Python ops defined by define_op live as long as this library object: for the process.
_LIBRARY = Library(OP_NAMESPACE, "FRAGMENT")


def op_name(name: str) -> str:
    """The qualified name `vllm_mxplus::<name>` for torch.library."""
    return f"{OP_NAMESPACE}::{name}"


def define_op(name: str, fn: Callable, fake: Callable) -> torch._ops.OpOverloadPacket:
    """Register fn (annotated; schema inferred, no argument mutated) as the op
    `vllm_mxplus::<name>` for every device (CompositeExplicitAutograd), with fake as its
    shape function for torch.compile, and return the op.

    For an op called once per linear per step: `torch.library.custom_op`'s Python wrapper
    (autograd and dispatch handling around the kernel) costs ~10 µs a call, where a kernel
    registered to the dispatcher directly costs ~2.5 µs (measured on CPU by
    tests/backends/test_library.py's comparison; vLLM registers its own ops this way). The
    op has no autograd formula: it serves inference."""
    _LIBRARY.define(name + infer_schema(fn, mutates_args=()))
    _LIBRARY.impl(name, fn, "CompositeExplicitAutograd")
    register_fake(op_name(name), fake, lib=_LIBRARY)
    return getattr(torch.ops.vllm_mxplus, name)
