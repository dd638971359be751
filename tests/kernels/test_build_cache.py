"""The CUTLASS build (backends/cutlass/build.py): a keyed cache hit compiles nothing, and a
build uses the cores it is given (parallel files, the rest as nvcc --split-compile)."""

from __future__ import annotations

import pytest

from vllm_mxplus.backends.cutlass import build as cb


def test_keyed_cache_hit_compiles_nothing(monkeypatch, tmp_path):
    so = tmp_path / "mxplus_cutlass.so"
    so.write_bytes(b"")
    monkeypatch.setattr(cb, "default_build_dir", lambda archs: tmp_path)
    monkeypatch.setattr(cb.subprocess, "Popen", lambda *a, **k: pytest.fail("nvcc ran"))
    assert cb.build(None, ["90a"], jobs=16) == so


class _Failed:
    def poll(self):
        return 1

    def wait(self):
        return 1


@pytest.mark.parametrize("jobs,split", [(16, 16), (2, 2), (1, None)])
def test_cores_become_split_compile_threads(monkeypatch, tmp_path, jobs, split):
    cmds = []
    monkeypatch.setattr(cb, "cutlass_include_dirs", lambda: [])
    monkeypatch.setattr(cb.subprocess, "Popen", lambda cmd, **k: cmds.append(cmd) or _Failed())
    with pytest.raises(cb.BuildError):
        cb.build(tmp_path / "out", ["90a"], jobs=jobs)  # explicit dir: never a cache hit
    kernel = next(c for c in cmds if any("sm90" in a for a in c))
    stub = next(c for c in cmds if "-DMXPLUS_STUB" in c)
    flags = [a for a in kernel if a.startswith("--split-compile")]
    assert flags == ([] if split is None else [f"--split-compile={split}"])
    assert not any(a.startswith("--split-compile") for a in stub)
