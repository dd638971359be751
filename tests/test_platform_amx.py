"""AMX tile permission: the decision with a fake cpuinfo / syscall, and a no-op here (AMD)."""

from __future__ import annotations

import logging
import platform

import pytest

import vllm_mxplus
from vllm_mxplus import log_once, platform_amx
from vllm_mxplus.platform_amx import (
    ARCH_GET_XCOMP_PERM,
    ARCH_REQ_XCOMP_PERM,
    XFEATURE_XTILEDATA,
    cpu_has_amx_tile,
    request_amx_permission,
)

INTEL = (
    "processor\t: 0\nvendor_id\t: GenuineIntel\n"
    "flags\t\t: fpu sse2 avx512f avx512_bf16 amx_bf16 amx_tile amx_int8\n"
)
AMD = "processor\t: 0\nvendor_id\t: AuthenticAMD\nflags\t\t: fpu sse2 avx512f avx512_bf16\n"
# amx_tile only in a bugs / model-name line is not the flag
NOT_A_FLAG = "model name\t: amx_tile lookalike\nflags\t\t: fpu sse2 amx_bf16\n"


class FakeKernel:
    """arch_prctl as Linux implements it for XTILEDATA: GET returns the permitted mask."""

    def __init__(self, held: bool = False, refuse_errno: int = 0):
        self.mask = 0b11 | ((1 << XFEATURE_XTILEDATA) if held else 0)
        self.refuse_errno = refuse_errno
        self.calls: list[tuple[int, int]] = []

    def __call__(self, code: int, arg: int) -> tuple[int, int]:
        self.calls.append((code, arg))
        if code == ARCH_GET_XCOMP_PERM:
            return self.mask, 0
        if code == ARCH_REQ_XCOMP_PERM and arg == XFEATURE_XTILEDATA:
            if self.refuse_errno:
                return -1, self.refuse_errno
            self.mask |= 1 << XFEATURE_XTILEDATA
            return 0, 0
        return -1, 22


@pytest.fixture(autouse=True)
def fresh_logs(monkeypatch):
    monkeypatch.setattr(log_once, "_SEEN", set())
    monkeypatch.setattr(logging.getLogger("vllm_mxplus"), "propagate", True)


@pytest.mark.parametrize(
    "text,want",
    [(INTEL, True), (AMD, False), (NOT_A_FLAG, False), ("", False)],
    ids=["intel", "amd", "lookalike", "empty"],
)
def test_cpu_has_amx_tile(text, want):
    assert cpu_has_amx_tile(text) is want


def test_intel_amx_host_requests_xtiledata(caplog):
    caplog.set_level(logging.DEBUG, logger="vllm_mxplus")
    kernel = FakeKernel()
    r = request_amx_permission(system="Linux", machine="x86_64", cpuinfo=INTEL, arch_prctl=kernel)
    assert (r.action, r.ok) == ("granted", True)
    assert (ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA) in kernel.calls
    assert kernel.mask & (1 << XFEATURE_XTILEDATA)
    assert [rec.levelno for rec in caplog.records] == [logging.INFO]
    assert "AMX tile permission" in caplog.records[0].getMessage()


def test_permission_already_held_is_not_requested_again():
    kernel = FakeKernel(held=True)
    r = request_amx_permission(system="Linux", machine="x86_64", cpuinfo=INTEL, arch_prctl=kernel)
    assert r.action == "already"
    assert all(code == ARCH_GET_XCOMP_PERM for code, _ in kernel.calls)


def test_refusal_is_a_warning_never_an_exception(caplog):
    caplog.set_level(logging.DEBUG, logger="vllm_mxplus")
    kernel = FakeKernel(refuse_errno=22)  # EINVAL: a kernel older than 5.16
    r = request_amx_permission(system="Linux", machine="x86_64", cpuinfo=INTEL, arch_prctl=kernel)
    assert (r.action, r.ok) == ("failed", False)
    assert "Invalid argument" in r.detail and "5.16" in r.detail
    assert [rec.levelno for rec in caplog.records] == [logging.WARNING]
    assert "SIGILL" in caplog.records[0].getMessage()


def test_syscall_that_raises_is_not_fatal():
    def broken(code: int, arg: int) -> tuple[int, int]:
        raise OSError("no libc")

    r = request_amx_permission(system="Linux", machine="x86_64", cpuinfo=INTEL, arch_prctl=broken)
    assert r.action == "failed" and "no libc" in r.detail


@pytest.mark.parametrize(
    "system,machine,cpuinfo",
    [
        ("Linux", "x86_64", AMD),
        ("Linux", "aarch64", INTEL),
        ("Darwin", "x86_64", INTEL),
        ("Windows", "AMD64", INTEL),
    ],
    ids=["amd", "arm", "macos", "windows"],
)
def test_no_syscall_off_amx_hosts(system, machine, cpuinfo):
    kernel = FakeKernel()
    r = request_amx_permission(system=system, machine=machine, cpuinfo=cpuinfo, arch_prctl=kernel)
    assert r.action == "skipped" and kernel.calls == []


def test_logged_once_per_process(caplog):
    caplog.set_level(logging.DEBUG, logger="vllm_mxplus")
    for _ in range(3):
        request_amx_permission(system="Linux", machine="x86_64", cpuinfo=AMD)
    assert len(caplog.records) == 1


def test_this_machine(monkeypatch, caplog):
    """The real path on this machine: a logged no-op without amx_tile, granted with it."""
    caplog.set_level(logging.DEBUG, logger="vllm_mxplus")
    monkeypatch.setattr(platform_amx, "_RESULT", None)
    r = request_amx_permission()
    has_amx = cpu_has_amx_tile(platform_amx.read_cpuinfo())
    if has_amx and platform.system() == "Linux":
        assert r.action in ("granted", "already"), r.detail
    else:
        assert r.action == "skipped"
    assert len(caplog.records) == 1 and "AMX" in caplog.records[0].getMessage()
    assert request_amx_permission() is r  # cached: asked once per process


@pytest.mark.skipif(
    platform.system() != "Linux" or platform.machine() != "x86_64",
    reason="arch_prctl is Linux x86-64 only",
)
def test_real_arch_prctl_binding_reads_the_permitted_mask():
    """The ctypes binding of syscall 158 works: x87 and SSE (bits 0, 1) are always permitted."""
    mask, _ = platform_amx._libc_arch_prctl(ARCH_GET_XCOMP_PERM, 0)
    assert mask >= 0 and mask & 0b11 == 0b11


def test_register_requests_amx_first(monkeypatch):
    calls = []
    monkeypatch.setattr(platform_amx, "request_amx_permission", lambda: calls.append("amx"))
    from vllm_mxplus.integration import registration

    monkeypatch.setattr(registration, "register_all", lambda: calls.append("schemes"))
    vllm_mxplus.register()
    assert calls == ["amx", "schemes"]
