"""VLLM_MXPLUS_BACKEND: force one backend or allow a list, per layer kind, with a clear error
when the allowed backends cannot serve a layer; and the settings table in the README."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from vllm_mxplus import settings
from vllm_mxplus.backends import (
    BackendUnavailable,
    ExpertSpec,
    LinearSpec,
    ReferenceBackend,
    ReferenceExperts,
    selection,
)
from vllm_mxplus.backends.cpu import kernels as cpu_kernels
from vllm_mxplus.backends.cpu.experts import CpuPackedExperts
from vllm_mxplus.backends.cpu.linear import CpuPackedBackend
from vllm_mxplus.backends.cutlass.linear import CutlassPrefillBackend
from vllm_mxplus.backends.triton.linear import TritonDecodeBackend
from vllm_mxplus.formats import get_scheme

LIN = LinearSpec(get_scheme("mxfp4-mbs"), n=32, k=128, out_dtype=torch.float32)
EXP = ExpertSpec(get_scheme("mxfp4-mbs"))


@pytest.fixture(autouse=True)
def _quiet(monkeypatch):
    monkeypatch.setattr(selection, "_LOGGED", set())
    monkeypatch.delenv(settings.BACKEND.name, raising=False)


def _names(spec, platform="cpu", capability=None):
    return [b.name for b in selection.select(spec, platform, capability, "model.layers.0.x")]


def test_default_on_cpu_is_the_packed_kernels_alone():
    assert _names(LIN) == ["cpu-packed"]
    assert _names(EXP) == ["cpu-packed"]


@pytest.mark.parametrize(
    "value,linear,experts",
    [
        ("reference", ReferenceBackend, ReferenceExperts),
        ("experts:reference", CpuPackedBackend, ReferenceExperts),
        ("reference,cpu-packed", CpuPackedBackend, CpuPackedExperts),
    ],
    ids=[
        "forcing-the-reference-applies-to-both-kinds",
        "a-kind-prefix-forces-one-kind-only",
        "an-allow-list-keeps-priority-order-and-skips-the-unneeded-reference",
    ],
)
def test_the_setting_picks_the_backends_per_kind(monkeypatch, value, linear, experts):
    monkeypatch.setenv(settings.BACKEND.name, value)
    assert [type(b) for b in selection.select(LIN, "cpu", None)] == [linear]
    assert [type(b) for b in selection.select(EXP, "cpu", None)] == [experts]


def test_a_forced_backend_that_cannot_serve_the_layer_fails_naming_layer_and_reason(monkeypatch):
    monkeypatch.setenv(settings.BACKEND.name, "linear:triton-decode")
    with pytest.raises(BackendUnavailable) as e:
        selection.select(LIN, "cpu", None, "model.layers.0.x")
    msg = str(e.value)
    assert "model.layers.0.x" in msg and "leaves M >= 1 unserved" in msg
    assert "triton-decode: not a linear backend on cpu" in msg


def test_a_decode_only_backend_forced_on_cuda_leaves_prefill_unserved(monkeypatch):
    monkeypatch.setenv(settings.BACKEND.name, "linear:triton-decode")
    monkeypatch.setattr(settings, "selftest_enabled", lambda: False)
    monkeypatch.setattr(
        TritonDecodeBackend, "is_supported", classmethod(lambda c, p, cap: (True, ""))
    )
    with pytest.raises(
        BackendUnavailable, match=r"leaves M >= 129 unserved.*triton-decode,reference"
    ):
        selection.select(LIN, "cuda", 90, "model.layers.0.x")


@pytest.mark.parametrize(
    "value,match",
    [
        ("no-such-backend", "no linear backend named 'no-such-backend'"),
        ("attention:reference", "unknown layer kind 'attention'"),
    ],
)
def test_bad_values_say_what_is_valid(monkeypatch, value, match):
    monkeypatch.setenv(settings.BACKEND.name, value)
    with pytest.raises(BackendUnavailable, match=match) as e:
        selection.select(LIN, "cpu", None)
    assert "reference" in str(e.value)  # the list of valid names or kinds follows


def test_an_empty_name_is_an_error(monkeypatch):
    monkeypatch.setenv(settings.BACKEND.name, "reference,,")
    with pytest.raises(ValueError, match="empty backend name"):
        settings.backend_choice()


def test_settings_are_read_when_used_not_at_import(monkeypatch):
    monkeypatch.setenv(settings.SELFTEST.name, "0")
    assert settings.selftest_enabled() is False
    monkeypatch.setenv(settings.SELFTEST.name, "1")
    assert settings.selftest_enabled() is True
    monkeypatch.setenv(settings.PREFILL_MIN_M.name, "zero")
    with pytest.raises(ValueError, match="VLLM_MXPLUS_PREFILL_MIN_M='zero': expected a positive"):
        settings.prefill_min_m()


def test_every_module_reads_its_settings_when_used(monkeypatch):
    """The CUTLASS prefill range, the CPU kernels' switch and -march follow a variable set
    after import (vLLM sets them in worker processes, tests per case)."""
    assert CutlassPrefillBackend.m_range() == (129, None)
    monkeypatch.setenv(settings.PREFILL_MIN_M.name, "33")
    assert CutlassPrefillBackend.m_range() == (33, None)
    assert not CutlassPrefillBackend.supports_m(32) and CutlassPrefillBackend.supports_m(33)
    monkeypatch.setenv(settings.CPU_KERNELS.name, "0")
    assert cpu_kernels.load() == (False, f"disabled by {settings.CPU_KERNELS.name}=0")
    monkeypatch.setenv(settings.CPU_MARCH.name, "x86-64-v3")
    assert cpu_kernels.cflags()[0] == "-march=x86-64-v3"


def test_readme_settings_table_is_the_generated_one():
    readme = (Path(__file__).resolve().parents[2] / "README.md").read_text()
    assert settings.table() in readme, "regenerate: python -m vllm_mxplus.settings"


def test_every_variable_the_package_reads_is_a_setting():
    root = Path(settings.__file__).resolve().parent
    import re

    used = set()
    for f in root.rglob("*.py"):
        used |= set(re.findall(r"\bVLLM_MXPLUS_[A-Z0-9_]+\b", f.read_text()))
    assert used <= {s.name for s in settings.ALL}, used - {s.name for s in settings.ALL}
