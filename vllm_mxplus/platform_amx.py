"""Ask Linux for Intel AMX tile state in this process, so vLLM's own AMX kernels can run.

Linux (5.16+) only lets a process execute AMX tile instructions after it requested the
XTILEDATA state component with `arch_prctl(ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA)`; the
first tile instruction of a process that did not ask is killed with SIGILL. vLLM CPU 0.32's
AMX attention (`cpu_attn_amx.hpp`, `tilezero`) never asks: a worker serving a bf16 model on
an Intel Xeon with AMX dies with exit code -4 on its first request unless something else in
the process (e.g. a oneDNN AMX GEMM) asked first. The plugin's `register()` runs in every
vLLM process (the `vllm.general_plugins` entry point), so it asks there, before any model
runs.

Only on Linux x86-64 whose /proc/cpuinfo advertises `amx_tile`; a no-op elsewhere. Never
fatal: a refusal is logged once as a warning and the process carries on as before.
"""

from __future__ import annotations

import ctypes
import logging
import os
import platform
from collections.abc import Callable
from dataclasses import dataclass

from vllm_mxplus.log_once import log_once

logger = logging.getLogger(__name__)

SYS_ARCH_PRCTL = 158  # x86-64 syscall number of arch_prctl
ARCH_GET_XCOMP_PERM = 0x1022
ARCH_REQ_XCOMP_PERM = 0x1023
XFEATURE_XTILEDATA = 18

# arch_prctl(code, arg) -> (return value, errno); injectable for tests.
Syscall = Callable[[int, int], tuple[int, int]]


@dataclass(frozen=True)
class AmxResult:
    """What `request_amx_permission` did: `action` is one of "skipped" (not an AMX host),
    "already" (permission held before), "granted" or "failed"; `detail` says why."""

    action: str
    detail: str

    @property
    def ok(self) -> bool:
        """False only when the CPU has AMX and the permission could not be obtained."""
        return self.action != "failed"


_RESULT: AmxResult | None = None


def read_cpuinfo() -> str:
    """/proc/cpuinfo's text, or '' where it cannot be read."""
    try:
        with open("/proc/cpuinfo", encoding="utf-8", errors="replace") as f:
            return f.read()
    except OSError:
        return ""


def cpu_model_name(default: str) -> str:
    """This CPU's model name from /proc/cpuinfo (for benchmark and report headers), else
    `default`."""
    for line in read_cpuinfo().splitlines():
        if line.startswith("model name"):
            return line.split(":", 1)[1].strip()
    return default


def cpu_flags(cpuinfo: str) -> set[str] | None:
    """The feature flags of a /proc/cpuinfo text's first `flags` (x86) or `Features` (Arm)
    line; None when it has no such line."""
    for line in cpuinfo.splitlines():
        key, _, value = line.partition(":")
        if key.strip() in ("flags", "Features"):
            return set(value.split())
    return None


def cpu_has_amx_tile(cpuinfo: str) -> bool:
    """Whether a /proc/cpuinfo text lists the `amx_tile` flag."""
    return "amx_tile" in (cpu_flags(cpuinfo) or set())


def _libc_arch_prctl(code: int, arg: int) -> tuple[int, int]:
    libc = ctypes.CDLL(None, use_errno=True)
    libc.syscall.restype = ctypes.c_long
    if code == ARCH_GET_XCOMP_PERM:  # the kernel writes the permitted feature mask to *arg
        mask = ctypes.c_ulong(0)
        ret = libc.syscall(ctypes.c_long(SYS_ARCH_PRCTL), ctypes.c_int(code), ctypes.byref(mask))
        return (int(mask.value) if ret == 0 else ret), ctypes.get_errno()
    ret = libc.syscall(ctypes.c_long(SYS_ARCH_PRCTL), ctypes.c_int(code), ctypes.c_ulong(arg))
    return ret, ctypes.get_errno()


def decide_and_request(system: str, machine: str, cpuinfo: str, arch_prctl: Syscall) -> AmxResult:
    """The decision, free of process state (unit-tested with a fake cpuinfo and syscall).

    With ARCH_GET_XCOMP_PERM, `arch_prctl` returns the permitted mask (or -1 and errno)."""
    if system != "Linux" or machine.lower() not in ("x86_64", "amd64"):
        return AmxResult("skipped", f"not Linux x86-64 ({system} {machine})")
    if not cpu_has_amx_tile(cpuinfo):
        return AmxResult("skipped", "the CPU does not advertise amx_tile")
    mask, _ = arch_prctl(ARCH_GET_XCOMP_PERM, 0)
    if mask >= 0 and mask & (1 << XFEATURE_XTILEDATA):
        return AmxResult("already", "XTILEDATA permission already held by this process")
    ret, err = arch_prctl(ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA)
    if ret == 0:
        return AmxResult("granted", "XTILEDATA permission granted")
    return AmxResult(
        "failed",
        f"arch_prctl(ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA) = {ret} "
        f"({os.strerror(err) if err else 'no errno'}); Linux >= 5.16 "
        f"is needed for AMX in user space",
    )


def request_amx_permission(
    *,
    system: str | None = None,
    machine: str | None = None,
    cpuinfo: str | None = None,
    arch_prctl: Syscall | None = None,
) -> AmxResult:
    """Request AMX tile permission for this process once (later calls return the first result);
    logs the outcome once. Never raises. The keyword arguments replace the real machine
    (tests); passing any of them bypasses the per-process cache."""
    global _RESULT
    injected = any(v is not None for v in (system, machine, cpuinfo, arch_prctl))
    if _RESULT is not None and not injected:
        return _RESULT
    try:
        result = decide_and_request(
            system if system is not None else platform.system(),
            machine if machine is not None else platform.machine(),
            cpuinfo if cpuinfo is not None else read_cpuinfo(),
            arch_prctl if arch_prctl is not None else _libc_arch_prctl,
        )
    except Exception as e:  # never fatal: a plugin must not stop vLLM from starting
        result = AmxResult("failed", f"{type(e).__name__}: {e}")
    if result.action == "failed":
        log_once(
            logger,
            ("amx", result),
            logging.WARNING,
            "mxplus: this CPU has AMX but the tile permission was refused: %s. vLLM's "
            "AMX kernels may kill the process with SIGILL.",
            result.detail,
        )
    elif result.action == "granted":
        log_once(
            logger,
            ("amx", result),
            logging.INFO,
            "mxplus: requested AMX tile permission for this process (vLLM's AMX "
            "attention needs it): %s",
            result.detail,
        )
    else:
        log_once(
            logger,
            ("amx", result),
            logging.DEBUG,
            "mxplus: AMX permission: %s (%s)",
            result.action,
            result.detail,
        )
    if not injected:
        _RESULT = result
    return result
