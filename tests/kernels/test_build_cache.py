"""The CUTLASS build (backends/cutlass/build.py): keyed by its sources, flags and toolkit, a
keyed cache hit compiles nothing, only a .so whose build record matches loads, and a build
uses the cores it is given (parallel files, the rest as nvcc --split-compile)."""

from __future__ import annotations

import os
import shutil

import pytest

from vllm_mxplus import settings
from vllm_mxplus.backends.cutlass import build as cb


@pytest.fixture
def fresh_loader(monkeypatch, tmp_path):
    """An unloaded extension state, a cache root under tmp_path, no VLLM_MXPLUS_CUTLASS_EXT,
    no source checkout builds, a fixed toolkit, and a loader that records what it loads."""
    monkeypatch.setattr(cb, "_EXT", None)
    monkeypatch.setattr(cb, "_EXT_ERROR", "not loaded yet")
    monkeypatch.setenv(settings.CUTLASS_BUILD_DIR.name, str(tmp_path / "cache"))
    monkeypatch.delenv(settings.CUTLASS_EXT.name, raising=False)
    monkeypatch.setattr(cb, "toolkit_version", lambda: "12.8, V12.8.93")
    real = cb.candidate_paths
    monkeypatch.setattr(
        cb, "candidate_paths", lambda: [p for p in real() if "kernels/build" not in str(p)]
    )
    loaded = []
    monkeypatch.setattr(cb, "_load_module", lambda path: loaded.append(path) or f"module {path}")
    return loaded


def _built(root, name: str, mtime: float, record: bool = True):
    """A fake built .so under root/name, with the current build record (or none)."""
    so = root / name / "mxplus_cutlass.so"
    so.parent.mkdir(parents=True)
    so.write_bytes(b"")
    if record:
        cb.write_manifest(so, ["90a"])
    os.utime(so, (mtime, mtime))
    return so


def test_key_follows_sources_flags_and_toolkit(monkeypatch, tmp_path):
    monkeypatch.setattr(cb, "toolkit_version", lambda: "12.8, V12.8.93")
    key = cb.build_key(["90a"])
    assert cb.build_key(["90a"]) == key
    assert cb.build_key(["90a", "100a"]) != key
    monkeypatch.setattr(cb, "toolkit_version", lambda: "12.9, V12.9.41")
    assert cb.build_key(["90a"]) != key
    monkeypatch.setattr(cb, "toolkit_version", lambda: "12.8, V12.8.93")
    monkeypatch.setattr(cb, "NVCC_FLAGS", [*cb.NVCC_FLAGS, "-lineinfo"])
    assert cb.build_key(["90a"]) != key
    monkeypatch.undo()
    monkeypatch.setattr(cb, "toolkit_version", lambda: "12.8, V12.8.93")
    src = tmp_path / "csrc"
    shutil.copytree(cb.SOURCE_DIR, src)
    monkeypatch.setattr(cb, "SOURCE_DIR", src)
    assert cb.build_key(["90a"]) == key
    header = src / cb.HEADERS[0]
    header.write_text(header.read_text() + "\n// one more line\n")
    assert cb.build_key(["90a"]) != key


def test_keyed_cache_hit_compiles_nothing(monkeypatch, tmp_path):
    so = tmp_path / "mxplus_cutlass.so"
    so.write_bytes(b"")
    cb.write_manifest(so, ["90a"])
    monkeypatch.setattr(cb, "default_build_dir", lambda archs: tmp_path)
    monkeypatch.setattr(cb.subprocess, "Popen", lambda *a, **k: pytest.fail("nvcc ran"))
    assert cb.build(None, ["90a"], jobs=16) == so


def test_stale_so_in_the_keyed_directory_is_rebuilt(monkeypatch, tmp_path):
    """A .so without a matching record is no cache hit: nvcc runs (here: fails at once)."""
    (tmp_path / "mxplus_cutlass.so").write_bytes(b"")
    monkeypatch.setattr(cb, "default_build_dir", lambda archs: tmp_path)
    monkeypatch.setattr(cb, "cutlass_include_dirs", lambda: [])
    ran = []
    monkeypatch.setattr(cb.subprocess, "Popen", lambda cmd, **k: ran.append(cmd) or _Failed())
    with pytest.raises(cb.BuildError):
        cb.build(None, ["90a"], jobs=2)
    assert ran


def test_only_a_matching_so_loads(fresh_loader, tmp_path, monkeypatch):
    """The newest .so of the cache was built from other sources: skipped; the older matching
    one loads."""
    root = tmp_path / "cache"
    good = _built(root, "aaaa", 1_000)
    stale = _built(root, "bbbb", 2_000)
    rec = (stale.parent / cb.MANIFEST).read_text().replace('"sources": "', '"sources": "0')
    (stale.parent / cb.MANIFEST).write_text(rec)
    assert cb.candidate_paths()[0] == stale  # newest first
    assert cb.load_extension() == f"module {good}"
    assert fresh_loader == [good]


@pytest.mark.parametrize(
    "edit,reason",
    [
        (lambda rec: rec.replace('"sources": "', '"sources": "0'), "C++ sources or nvcc flags"),
        (lambda rec: rec.replace('"torch": "', '"torch": "0'), "other torch"),
        (lambda rec: rec.replace("12.8, V12.8.93", "12.4, V12.4.131"), "toolkit '12.4"),
        (None, "no build record"),
    ],
    ids=["sources", "torch", "toolkit", "unrecorded"],
)
def test_stale_so_never_loads_and_says_why(fresh_loader, tmp_path, monkeypatch, edit, reason):
    so = _built(tmp_path / "cache", "cccc", 1_000, record=edit is not None)
    if edit is not None:
        path = so.parent / cb.MANIFEST
        path.write_text(edit(path.read_text()))
    assert cb.load_extension() is None
    assert fresh_loader == []
    assert str(so) in cb._EXT_ERROR and reason in cb._EXT_ERROR
    assert "python -m vllm_mxplus.backends.cutlass.build" in cb._EXT_ERROR


def test_explicit_path_is_held_to_the_same_record(fresh_loader, tmp_path, monkeypatch):
    so = _built(tmp_path / "elsewhere", "x", 1_000, record=False)
    monkeypatch.setenv(settings.CUTLASS_EXT.name, str(so))
    assert cb.load_extension() is None and "no build record" in cb._EXT_ERROR
    monkeypatch.setattr(cb, "_EXT_ERROR", "not loaded yet")
    cb.write_manifest(so, ["90a", "100a"])
    assert cb.load_extension() == f"module {so}"


def test_toolkit_not_compared_without_nvcc(fresh_loader, tmp_path, monkeypatch):
    """A serving machine without nvcc: the record's toolkit cannot be compared; sources,
    flags and torch still are."""
    so = _built(tmp_path / "cache", "dddd", 1_000)
    monkeypatch.setattr(cb, "toolkit_version", lambda: None)
    assert cb.load_extension() == f"module {so}"


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


class _Done:
    def poll(self):
        return 0

    def wait(self):
        return 0


def test_link_failure_is_a_build_error_naming_the_step(monkeypatch, tmp_path):
    """nvcc compiled every file, then torch's extension builder fails (a CPU torch without
    CUDA_HOME raises OSError): a BuildError that says linking failed, not a traceback."""
    import torch.utils.cpp_extension as cpp

    monkeypatch.setattr(cb, "cutlass_include_dirs", lambda: [])
    monkeypatch.setattr(cb.subprocess, "Popen", lambda cmd, **k: _Done())

    def no_cuda_home(**kw):
        raise OSError("CUDA_HOME environment variable is not set.")

    monkeypatch.setattr(cpp, "load", no_cuda_home)
    with pytest.raises(cb.BuildError, match="linking the extension failed.*CUDA_HOME"):
        cb.build(tmp_path / "out", ["90a"], jobs=2)


def test_mxplus_kernels_build_cutlass(monkeypatch, tmp_path, capsys):
    """`mxplus kernels --build-cutlass` builds with the archs and directory asked for and
    prints where the .so is; a failed step or a bad arch exits 1 with the reason."""
    from vllm_mxplus.cli import main

    calls = []

    def fake_build(out, archs, jobs=2, verbose=False):
        calls.append((out, archs, jobs))
        return tmp_path / "mxplus_cutlass.so"

    monkeypatch.setattr(cb, "build", fake_build)
    argv = ["kernels", "--build-cutlass", "--archs", "90a", "--cutlass-out", str(tmp_path)]
    assert main([*argv, "--jobs", "3"]) == 0
    assert calls == [(tmp_path, ["90a"], 3)]
    assert "mxplus_cutlass.so (archs 90a" in capsys.readouterr().out
    assert main(["kernels", "--build-cutlass", "--archs", "80a"]) == 1
    assert "unsupported arch ['80a']" in capsys.readouterr().out

    def failing(out, archs, jobs=2, verbose=False):
        raise cb.BuildError("nvcc not found (install the CUDA toolkit or set CUDA_HOME)")

    monkeypatch.setattr(cb, "build", failing)
    assert main(["kernels", "--build-cutlass"]) == 1
    assert "--build-cutlass: nvcc not found" in capsys.readouterr().out
