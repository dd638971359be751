"""benchmarks/bench_vs_llamacpp.py survives a crashing peer and builds with extra CMake options:
fake llama.cpp tools (shell scripts) that die of a signal, exit non-zero or hang are recorded
with the command and the end of their output, and the next part of the run still runs; extra
CMake options reach cmake after the defaults, in a build directory of their own."""

from __future__ import annotations

import json
import os
import shutil
import stat
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[3] / "benchmarks"))
import bench_vs_llamacpp as bench  # noqa: E402

pytestmark = pytest.mark.skipif(shutil.which("sh") is None, reason="needs a POSIX shell (sh)")


def _tool(path: Path, body: str) -> Path:
    path.write_text("#!/bin/sh\n" + body + "\n")
    path.chmod(path.stat().st_mode | stat.S_IXUSR)
    return path


BENCH_JSON = json.dumps(
    [{"n_prompt": 512, "n_gen": 0, "avg_ts": 1234.5}, {"n_prompt": 0, "n_gen": 128, "avg_ts": 56.7}]
)


def test_a_crashing_peer_is_recorded_and_the_run_goes_on(tmp_path):
    crash = tmp_path / "crash"
    crash.mkdir()
    _tool(crash / "llama-bench", 'echo "ggml_backend_amx_mul_mat: boom" >&2\nkill -SEGV $$')
    ok = tmp_path / "ok"
    ok.mkdir()
    _tool(ok / "llama-bench", f"cat <<'EOF'\n{BENCH_JSON}\nEOF")
    peer = bench.Peer()
    got = peer.attempt("single q4_0", bench.llama_single, crash, tmp_path / "m.gguf", 1, 1)
    assert got is None
    (f,) = peer.failures
    assert f.how == "killed by SIGSEGV (signal 11)" and f.what == "single q4_0"
    assert f.cmd[0] == str(crash / "llama-bench") and "-p" in f.cmd
    report = "\n".join(peer.report())
    assert "single q4_0: killed by SIGSEGV" in report
    assert f"command: {crash / 'llama-bench'} -m" in report
    assert "ggml_backend_amx_mul_mat: boom" in report
    # the next part runs
    pp, tg, cmd = peer.attempt("single mxfp4", bench.llama_single, ok, tmp_path / "m.gguf", 1, 1)
    assert (pp, tg) == (1234.5, 56.7) and len(peer.failures) == 1


def test_exit_status_and_hang_are_recorded(tmp_path, monkeypatch):
    _tool(tmp_path / "test-backend-ops", 'echo "no such backend" >&2\nexit 3')
    peer = bench.Peer()
    assert peer.attempt("linear q4_0", bench.llama_linear, tmp_path, "q4_0") is None
    assert peer.failures[-1].how == "exit status 3"
    assert "no such backend" in peer.failures[-1].output
    _tool(tmp_path / "llama-batched-bench", "sleep 30")
    monkeypatch.setattr(bench, "PEER_TIMEOUT_S", 0.5)
    got = peer.attempt("batched q4_0", bench.llama_batched, tmp_path, tmp_path / "m", 1, (4,))
    assert got is None and peer.failures[-1].how == "timed out after 0.5 s"
    assert peer.attempt("missing", bench.run_peer, [str(tmp_path / "nope")]) is None
    assert peer.failures[-1].how.startswith("could not start")
    assert bench.describe_exit(-6) == "killed by SIGABRT (signal 6)"
    assert bench.describe_exit(1) == "exit status 1"


def test_cells_of_a_crashed_peer():
    assert bench.cell(None) == "     crashed" and bench.cell(12.25) == "        12.2"
    assert bench.cell(1.5, 7, ".2f") == "   1.50"


def test_extra_cmake_options_reach_cmake_in_their_own_build(tmp_path, monkeypatch):
    """A fake cmake records its arguments and 'builds' the four tools."""
    log = tmp_path / "cmake.log"
    path = tmp_path / "path"
    path.mkdir()
    _tool(
        path / "cmake",
        f'echo "$@" >> {log}\n'
        'if [ "$1" = "--build" ]; then mkdir -p "$2/bin"; '
        + " ".join(f'touch "$2/bin/{t}";' for t in bench.TARGETS)
        + " fi",
    )
    monkeypatch.setenv("PATH", f"{path}{os.pathsep}{os.environ['PATH']}")
    monkeypatch.setattr(bench, "CACHE", tmp_path / "cache")
    monkeypatch.setattr(
        bench.shutil, "which", lambda name: str(path / name) if name == "cmake" else None
    )
    extra = ["-DGGML_AMX_INT8=OFF", "-DGGML_NATIVE=OFF", "-DGGML_AVX512=ON"]
    bin_dir = bench.llama_build(tmp_path / "src", "1.0", 2, extra)
    assert bin_dir.parent.name == bench.build_dir_name("1.0", extra) != "build-1.0-native"
    configure = log.read_text().splitlines()[0].split()
    assert configure[-3:] == extra  # after the defaults: a later -D wins
    assert "-DGGML_NATIVE=ON" in configure  # the default, overridden by the later option
    assert (bin_dir.parent / "cmake-options.txt").read_text().split()[-3:] == extra
    assert bench.llama_build(tmp_path / "src", "1.0", 2, extra) == bin_dir  # built once
    assert len(log.read_text().splitlines()) == 2
    default = bench.llama_build(tmp_path / "src", "1.0", 2)
    assert default.parent.name == "build-1.0-native" and default != bin_dir
    assert bench.build_dir_name("1.0", extra[:1]) != bench.build_dir_name("1.0", extra)


def test_a_failed_build_is_a_peer_failure(tmp_path, monkeypatch):
    path = tmp_path / "path"
    path.mkdir()
    _tool(path / "cmake", 'echo "CMake Error: unknown option" >&2\nexit 1')
    monkeypatch.setenv("PATH", f"{path}{os.pathsep}{os.environ['PATH']}")
    monkeypatch.setattr(bench, "CACHE", tmp_path / "cache")
    monkeypatch.setattr(
        bench.shutil, "which", lambda name: str(path / name) if name == "cmake" else None
    )
    peer = bench.Peer()
    assert peer.attempt("build", bench.llama_build, tmp_path / "src", "1.0", 2, ["-DX=1"]) is None
    assert peer.failures[0].how == "exit status 1" and "-DX=1" in peer.failures[0].cmd
