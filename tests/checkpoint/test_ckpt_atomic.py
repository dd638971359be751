"""Interrupted and failed runs leave no DST; --force replaces only after success."""

from __future__ import annotations

from pathlib import Path

import pytest
from ckpt_helpers import cli_args

from vllm_mxplus.checkpoint import (
    CheckpointError,
    UsageError,
    load,
    quantize_checkpoint,
    shard_writer,
)
from vllm_mxplus.checkpoint import quantizer as quantizer_mod
from vllm_mxplus.checkpoint.cli_quantize import EXIT_USAGE, run


def _fail_on_third_call(monkeypatch: pytest.MonkeyPatch, exc: BaseException) -> None:
    real = shard_writer.quantize_weight
    calls = {"n": 0}

    def flaky(*args, **kwargs):
        calls["n"] += 1
        if calls["n"] == 3:
            raise exc
        return real(*args, **kwargs)

    monkeypatch.setattr(shard_writer, "quantize_weight", flaky)


def _siblings(dst: Path) -> list[str]:
    return sorted(p.name for p in dst.parent.iterdir())


@pytest.mark.parametrize(
    "exc", [KeyboardInterrupt(), MemoryError("simulated crash")], ids=["ctrl-c", "crash"]
)
def test_interrupted_run_leaves_nothing(
    llama_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, exc: BaseException
) -> None:
    _fail_on_third_call(monkeypatch, exc)
    dst = tmp_path / "out" / "q"
    with pytest.raises(type(exc)):
        quantize_checkpoint(llama_dir, dst, "mxfp4-mbs-s", progress=False)
    assert not dst.exists()
    assert _siblings(dst) == []  # the temporary dir next to DST is gone too


def test_writer_failure_leaves_nothing(
    llama_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    real = shard_writer.StreamingWriter.write

    def broken(self, name, tensor):
        if name.endswith("mlp.up_proj.weight_scale"):
            raise OSError(28, "No space left on device")
        return real(self, name, tensor)

    monkeypatch.setattr(shard_writer.StreamingWriter, "write", broken)
    dst = tmp_path / "q"
    rc = run(cli_args(str(llama_dir), str(dst), "--scheme", "mxfp4-16-oas", "--no-progress"))
    assert rc == 1
    assert _siblings(dst) == []


def test_temp_dir_is_next_to_dst_and_lacks_config_until_done(
    llama_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    seen = []
    real = quantizer_mod.swap_in

    def spy(tmp: Path, dst: Path) -> None:
        seen.append((tmp.parent, tmp.name, (tmp / "config.json").is_file()))
        real(tmp, dst)

    real_write_all = quantizer_mod.write_all

    def spy_write_all(source, shards, fmt, tmp, *args):
        real_write_all(source, shards, fmt, tmp, *args)
        seen.append(("after-shards", (tmp / "config.json").exists()))

    monkeypatch.setattr(quantizer_mod, "swap_in", spy)
    monkeypatch.setattr(quantizer_mod, "write_all", spy_write_all)
    dst = tmp_path / "q"
    quantize_checkpoint(llama_dir, dst, "mxfp4-ocp", progress=False)
    assert seen[0] == ("after-shards", False)  # config.json comes last
    parent, name, has_config = seen[1]
    assert parent == tmp_path and name.startswith(".q.mxplus-tmp-") and has_config
    assert _siblings(dst) == ["q"]


def test_existing_dst_needs_force(
    llama_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    dst = tmp_path / "q"
    dst.mkdir()
    (dst / "precious.txt").write_text("keep me")
    with pytest.raises(UsageError, match="DST exists; pass --force"):
        quantize_checkpoint(llama_dir, dst, "mxfp4-ocp", progress=False)
    rc = run(cli_args(str(llama_dir), str(dst), "--scheme", "mxfp4-ocp", "--no-progress"))
    err = capsys.readouterr().err
    assert rc == EXIT_USAGE and err.count("\n") == 1 and "--force" in err
    assert (dst / "precious.txt").read_text() == "keep me"

    quantize_checkpoint(llama_dir, dst, "mxfp4-ocp", force=True, progress=False)
    assert not (dst / "precious.txt").exists() and load(dst)
    assert _siblings(dst) == ["q"]  # the moved-aside old DST was deleted


def test_force_keeps_old_dst_when_run_fails(
    llama_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    dst = tmp_path / "q"
    quantize_checkpoint(llama_dir, dst, "mxfp4-ocp", progress=False)
    _fail_on_third_call(monkeypatch, RuntimeError("boom"))
    with pytest.raises(CheckpointError, match="cannot quantize tensor .*boom"):
        quantize_checkpoint(llama_dir, dst, "mxfp4-16-oas", force=True, progress=False)
    assert load(dst)["model.layers.0.mlp.up_proj"].fmt == "mxfp4-ocp"  # old DST intact
    assert _siblings(dst) == ["q"]


def test_force_refuses_to_overwrite_src(llama_dir: Path) -> None:
    with pytest.raises(UsageError, match="would overwrite SRC"):
        quantize_checkpoint(llama_dir, llama_dir, "mxfp4-ocp", force=True, progress=False)
    with pytest.raises(UsageError, match="would overwrite SRC"):
        quantize_checkpoint(llama_dir, llama_dir.parent, "mxfp4-ocp", force=True, progress=False)


def test_sigterm_cleans_up(tmp_path: Path) -> None:
    """A real process killed with SIGTERM mid-run exits 130 and leaves no DST, no temp dir."""
    import os
    import signal
    import subprocess
    import sys
    import time

    import torch
    from ckpt_helpers import make_custom

    # Each weight takes >= 0.5 s (a sleep patched in), so the signal lands mid-run however
    # fast the quantizer becomes.
    src = make_custom(
        tmp_path / "src", {f"l.{i}.proj.weight": torch.randn(16, 64) for i in range(8)}
    )
    out = tmp_path / "out"
    out.mkdir()
    dst = out / "q"
    child = (
        "import sys, time\n"
        "import vllm_mxplus.checkpoint.shard_writer as q\n"
        "real = q.quantize_weight\n"
        "def slow(*a, **k):\n"
        "    time.sleep(0.5)\n"
        "    return real(*a, **k)\n"
        "q.quantize_weight = slow\n"
        "from vllm_mxplus.checkpoint.cli_quantize import main\n"
        "sys.exit(main(sys.argv[1:]))\n"
    )
    proc = subprocess.Popen(
        [
            sys.executable,
            "-c",
            child,
            str(src),
            str(dst),
            "--scheme",
            "mxfp4-mbs-s",
            "--no-progress",
            "--device",
            "cpu",
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=dict(os.environ, PYTHONPATH=str(Path(__file__).resolve().parents[2])),
    )
    deadline = time.monotonic() + 60
    while not any(out.iterdir()) and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.05)
    assert proc.poll() is None, "the run ended before it could be interrupted"
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 130, err
    assert "interrupted" in err
    assert list(out.iterdir()) == []
