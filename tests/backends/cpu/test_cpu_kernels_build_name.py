"""The CPU kernel build is named by a hash of its sources and flags; loading it must not
change that name (torch's cpp_extension.load appends to the flag list it is given), or the
build reported as loaded and the one `build_dir()` names part."""

from __future__ import annotations

from vllm_mxplus.backends.cpu import kernels as cpu_kernels


def test_build_name_stable_across_load() -> None:
    before = cpu_kernels.build_name()
    flags = list(cpu_kernels.LDFLAGS)
    ok, why = cpu_kernels.load()
    assert ok, why
    assert flags == cpu_kernels.LDFLAGS
    assert cpu_kernels.build_name() == before
    assert cpu_kernels._state["loaded"] == before
