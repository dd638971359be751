"""Backend registry and selector: priority, fallback with a logged reason, pick by M."""

from __future__ import annotations

import logging
from typing import Optional

import pytest
import torch

from vllm_mxplus.formats import quantize
from vllm_mxplus.ops import dispatch
from vllm_mxplus.ops.backend import LinearBackend, LinearSpec
from vllm_mxplus.ops.dispatch import LinearDispatch, register_backend, select
from vllm_mxplus.ops.reference import ReferenceBackend

SPEC = LinearSpec(scheme="mxfp4-mbs", n=32, k=256, out_dtype=torch.float32)


class _Decode(LinearBackend):
    """A fake decode kernel: sm90+ only, M <= 16, returns a marker."""

    name = "fake-decode"
    covers_all_m = False

    @classmethod
    def is_supported(cls, platform: str, capability: Optional[int]):
        if capability is None or capability < 90:
            return False, f"needs capability >= 90, got {capability}"
        return True, ""

    @classmethod
    def supports_m(cls, m: int) -> bool:
        return m <= 16

    def process_weights_after_loading(self, layer, qweight, spec):
        layer.decode_ready = True

    def apply(self, layer, x, bias, spec, act_global_scale=None):
        return torch.full((*x.shape[:-1], spec.n), 7.0)


class _NoScheme(_Decode):
    name = "fake-no-nvfp4"

    @classmethod
    def can_implement(cls, spec):
        return (spec.scheme != "mxfp4-mbs"), "only other schemes"


@pytest.fixture
def registry(monkeypatch):
    monkeypatch.setattr(dispatch, "_REGISTRY", {"cuda": [], "cpu": []})
    monkeypatch.setattr(dispatch, "_LOGGED", set())
    # registration may route our logs to vLLM's handler only; caplog listens on the root.
    monkeypatch.setattr(logging.getLogger("vllm_mxplus"), "propagate", True)
    return dispatch._REGISTRY


def test_empty_cpu_registry_gets_reference_only(registry):
    chosen = select(SPEC, "cpu", None)
    assert [b.name for b in chosen] == ["reference"]


def test_fallback_logs_reason_once(registry, caplog):
    register_backend("cuda", _Decode)
    caplog.set_level(logging.INFO, logger="vllm_mxplus.ops.dispatch")
    for _ in range(3):
        chosen = select(SPEC, "cuda", 80)
    assert [b.name for b in chosen] == ["reference"]
    msgs = [r.getMessage() for r in caplog.records]
    assert len(msgs) == 1 and "falling back" in msgs[0] and "capability >= 90" in msgs[0]


def test_priority_and_pick_by_m(registry, caplog):
    register_backend("cuda", _Decode)
    register_backend("cuda", _NoScheme, priority=0)
    caplog.set_level(logging.INFO, logger="vllm_mxplus.ops.dispatch")
    chosen = select(SPEC, "cuda", 90)
    assert [b.name for b in chosen] == ["fake-decode", "reference"]
    assert "only other schemes" in caplog.records[0].getMessage()
    layer = torch.nn.Module()
    d = LinearDispatch(SPEC, chosen)
    d.process_weights_after_loading(layer, quantize(torch.randn(32, 256), "mxfp4-mbs-d"))
    assert layer.decode_ready
    assert isinstance(d.pick(1), _Decode) and isinstance(d.pick(16), _Decode)
    assert isinstance(d.pick(17), ReferenceBackend)
    assert (d.apply(layer, torch.randn(4, 256), None) == 7.0).all()
    ref = d.apply(layer, torch.randn(100, 256), None)
    assert ref.shape == (100, 32) and not (ref == 7.0).all()


def test_unimportable_backend_is_a_rejection(registry, caplog):
    register_backend("cuda", "vllm_mxplus.ops.no_such_module:Kernel")
    caplog.set_level(logging.WARNING, logger="vllm_mxplus.ops.dispatch")
    assert [b.name for b in select(SPEC, "cuda", 100)] == ["reference"]
    assert "import failed" in caplog.records[0].getMessage()


class _AllM(_Decode):
    """A backend that serves every M: nothing after it is kept (no reference fp32 copy)."""

    name = "fake-all-m"
    covers_all_m = True

    @classmethod
    def supports_m(cls, m: int) -> bool:
        return True


def test_backend_serving_every_m_ends_the_list(registry):
    register_backend("cuda", _Decode)
    register_backend("cuda", _AllM)
    register_backend("cuda", _NoScheme)
    chosen = select(SPEC, "cuda", 90)
    assert [b.name for b in chosen] == ["fake-decode", "fake-all-m"]
    layer = torch.nn.Module()
    LinearDispatch(SPEC, chosen).process_weights_after_loading(
        layer, quantize(torch.randn(32, 256), "mxfp4-mbs-d"))
    assert not hasattr(layer, "mxplus_weight_fp32")  # the reference never prepared weights
