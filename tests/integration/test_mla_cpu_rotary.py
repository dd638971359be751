"""The plugin warns once when an MLA model is served on CPU with vLLM's CPU rotary op, which
rotates MLA's multi-head query at wrong positions (tests/integration/test_mla_judged.py
measures it), and stays quiet where the op is off or the device is not a CPU."""

from __future__ import annotations

import logging

import pytest
from mla_judge import RoPE_NATIVE

from vllm_mxplus.integration import mla


@pytest.fixture(autouse=True)
def fresh(monkeypatch):
    monkeypatch.setattr(mla, "_cpu_rope_warned", False)


def test_warns_once_on_cpu_with_the_op(caplog) -> None:
    with caplog.at_level(logging.WARNING, logger=mla.__name__):
        assert mla.warn_cpu_rotary("cpu", ["none"])
        assert not mla.warn_cpu_rotary("cpu", ["none"])  # once per process
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1
    assert '"-rotary_embedding"' in warnings[0] and "--compilation-config" in warnings[0]


@pytest.mark.parametrize(
    ("device", "ops"), [("cpu", RoPE_NATIVE["custom_ops"]), ("cuda", ["none"]), ("cuda", None)]
)
def test_quiet_without_the_bug(device: str, ops: list[str] | None) -> None:
    assert not mla.warn_cpu_rotary(device, ops)


def test_the_judged_engines_use_the_advised_option() -> None:
    assert mla.CPU_ROPE_FIX in RoPE_NATIVE["custom_ops"]
    assert str(RoPE_NATIVE).replace("'", '"') in mla.CPU_ROPE_ADVICE
