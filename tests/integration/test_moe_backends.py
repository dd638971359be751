"""The MoE expert-backend registry: priority order, rejection reasons, reference fallback
(fast: no engine; the backends run under vLLM in test_moe.py)."""

from __future__ import annotations

import logging

import pytest

from vllm_mxplus.backends import experts as mb
from vllm_mxplus.backends.cpu.experts import CpuPackedExperts, ReferenceExperts


def _spec(
    scheme: str = "mxfp4-mbs", w: str = "mxfp4-mbs-d", a: str = "mxfp4-mbs-s", device: str = "cpu"
) -> mb.MoESpec:
    return mb.MoESpec(
        scheme=scheme, weight_format=w, activation_format=a, macro_block=128, device_type=device
    )


class _Grouped(mb.ExpertBackend):
    """A stand-in for a grouped GPU kernel that serves every scheme."""

    name = "grouped-test"

    @classmethod
    def is_supported(cls, platform, capability):
        return (capability or 0) >= 90, "needs sm_90"

    def process_weights_after_loading(self, layer, weights):
        raise AssertionError("not called here")

    def apply(self, layer, x, topk_weights, topk_ids, act):
        raise AssertionError("not called here")


@pytest.fixture
def registry():
    saved = {k: list(v) for k, v in mb._REGISTRY.items()}
    yield mb
    mb._REGISTRY.clear()
    mb._REGISTRY.update(saved)


def test_grouped_kernel_slots_in_first(registry):
    registry.register_expert_backend("cuda", _Grouped, priority=0)
    assert registry.registered_expert_backends("cuda")[0] is _Grouped
    assert isinstance(registry.select_expert_backend(_spec(device="cuda"), "cuda", 90), _Grouped)


def test_unsupported_capability_falls_back_to_reference_with_reason(registry, caplog):
    registry.register_expert_backend("cuda", _Grouped, priority=0)
    with caplog.at_level(logging.INFO, logger=mb.__name__):
        got = registry.select_expert_backend(
            _spec(scheme="mxfp4-16-oas", w="mxfp4-16-oas", a="mxfp4-16-oas", device="cuda"),
            "cuda",
            80,
        )
    assert isinstance(got, ReferenceExperts)
    assert "grouped-test: needs sm_90" in caplog.text


def test_import_failure_is_a_rejection(registry, caplog):
    registry.register_expert_backend("xpu", "no_such_module_xyz:Backend")
    with caplog.at_level(logging.INFO, logger=mb.__name__):
        got = registry.select_expert_backend(
            _spec(scheme="mxfp4-ocp", w="mxfp4-ocp", a="mxfp4-ocp", device="xpu"), "xpu", None
        )
    assert isinstance(got, ReferenceExperts)
    assert "no_such_module_xyz:Backend: import failed (ModuleNotFoundError" in caplog.text


@pytest.mark.parametrize(
    "w,a,ok",
    [
        ("mxfp4-mbs-d", "mxfp4-mbs-s", True),
        ("nvfp4", "nvfp4", True),
        ("mxplus", "mxplus", True),
        ("nvfp4", "mxfp4-mbs-s", False),
    ],
    ids=["mbs", "nvfp4", "mxplus", "mixed"],
)
def test_cpu_packed_takes_every_scheme_and_refuses_mixed_pairs(w, a, ok):
    got, why = CpuPackedExperts.can_implement(_spec(w=w, a=a))
    assert got is ok
    assert ok or f"no CPU kernel for weights {w}" in why
