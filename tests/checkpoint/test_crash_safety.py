"""`mxplus quantize` killed at any point, or out of disk, leaves nothing that looks finished.

Runs the real CLI (`cli_quantize.main`) in child processes of a forkserver that imported the
package once, so each run costs milliseconds of start-up, and kills them with SIGKILL (no
handler, no cleanup) at random times and at chosen points. After every kill: DST is absent
or one of the two complete checkpoints (the old one of a --force run, or the new one, byte
for byte), nothing but hidden `.DST.mxplus-*` entries is next to it, and the next run names
and cleans what was left and produces the same bytes as an undisturbed run. SRC is never
modified. Full disks (RLIMIT_FSIZE, a small tmpfs) and read-only targets fail with one line
naming the file and what to do, and leave no DST.
"""

from __future__ import annotations

import hashlib
import json
import multiprocessing
import os
import random
import resource
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from ckpt_helpers import make_custom

from vllm_mxplus.checkpoint import UsageError, load, quantize_checkpoint
from vllm_mxplus.checkpoint import shard_writer as sw

CTX = multiprocessing.get_context("forkserver")
CTX.set_forkserver_preload(["vllm_mxplus.checkpoint.cli_quantize", "test_crash_safety"])
OLD_SCHEME, NEW_SCHEME = "mxfp4-ocp", "mxfp4-mbs-s"
RANDOM_KILLS = 16


def _child(argv: list[str], err_path: str, kill_at: str = "", fsize: int = 0) -> None:
    """One `mxplus quantize` run; exit code = the CLI's; stderr to err_path."""
    fd = os.open(err_path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    os.dup2(fd, 2)
    torch.set_num_threads(1)
    if fsize:
        resource.setrlimit(resource.RLIMIT_FSIZE, (fsize, fsize))
    if kill_at:
        _arm(kill_at)
    from vllm_mxplus.checkpoint.cli_quantize import main

    rc = main(argv)
    sys.stderr.flush()
    os._exit(rc)


def _die() -> None:
    os.kill(os.getpid(), signal.SIGKILL)


def _arm(point: str) -> None:
    """Make this process SIGKILL itself at a chosen point of the run."""
    from vllm_mxplus.checkpoint import quantizer, safetensors_io

    if point == "no-disk-check":  # not a kill: a disk that fills up during the run
        quantizer.check_disk_space = lambda *a: None
        return
    if point == "first-shard-closed":
        real_close = safetensors_io.StreamingWriter.close

        def close(self):  # noqa: ANN001, ANN202
            real_close(self)
            _die()

        safetensors_io.StreamingWriter.close = close  # type: ignore[method-assign]
    elif point == "mid-tensor":
        real_write = safetensors_io.StreamingWriter.write
        calls = {"n": 0}

        def write(self, name, tensor):  # noqa: ANN001, ANN202
            calls["n"] += 1
            if calls["n"] == 5:
                self._f.write(b"\x00" * 7)  # a partial tensor, flushed by the kernel
                self._f.flush()
                _die()
            return real_write(self, name, tensor)

        safetensors_io.StreamingWriter.write = write  # type: ignore[method-assign]
    elif point == "mid-config":  # config.json (the finished marker) written, not yet in place
        real_replace = os.replace

        def replace(a, b):  # noqa: ANN001, ANN202
            if Path(b).name == "config.json":
                _die()
            real_replace(a, b)

        sw.os.replace = replace  # type: ignore[attr-defined]
    elif point == "before-swap":
        quantizer.swap_in = lambda tmp, dst: _die()
    elif point in ("between-renames", "after-renames"):
        real_rename = os.rename
        n = {"n": 0}
        stop = 1 if point == "between-renames" else 2

        def rename(a, b):  # noqa: ANN001, ANN202
            real_rename(a, b)
            n["n"] += 1
            if n["n"] == stop:
                _die()

        sw.os.rename = rename  # type: ignore[attr-defined]
    else:
        raise ValueError(point)


def _tmp_dir(dst: Path) -> Path | None:
    """The run's unfinished output next to DST, once the quantizer has created it."""
    return next(dst.parent.glob(f".{dst.name}{sw.TMP_TAG}*"), None)


def _run(
    argv: list[str], err: Path, *, kill_after: float | None = None, **kw: object
) -> tuple[int, str]:
    """Run the CLI in a child; with KILL_AFTER, SIGKILL it that many seconds after its
    unfinished output appeared on disk (the writing phase, which start-up time on a loaded
    machine does not move)."""
    p = CTX.Process(target=_child, args=(argv, str(err)), kwargs=kw)
    p.start()
    if kill_after is not None:
        dst = Path(argv[1])
        while p.is_alive() and _tmp_dir(dst) is None:
            time.sleep(0.001)
        time.sleep(kill_after)
        # Process.kill, not os.kill: the forkserver (the child's parent) may reap a run that ends
        # just now, and Process.kill takes the vanished pid as "already finished".
        p.kill()
    p.join(120)
    assert p.exitcode is not None, "the quantizer hung"
    return p.exitcode, err.read_text() if err.exists() else ""


def _writing_seconds(argv: list[str], err: Path) -> float:
    """How long an undisturbed run takes from its unfinished output's appearance to its end."""
    p = CTX.Process(target=_child, args=(argv, str(err)))
    p.start()
    while p.is_alive() and _tmp_dir(Path(argv[1])) is None:
        time.sleep(0.001)
    t0 = time.perf_counter()
    p.join(120)
    assert p.exitcode == 0, err.read_text()
    return time.perf_counter() - t0


def _digest(d: Path) -> dict[str, str]:
    return {
        str(p.relative_to(d)): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(d.rglob("*"))
        if p.is_file()
    }


@pytest.fixture(scope="module")
def src(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """24 small bf16 linears in 3 shards of output, plus tokenizer-like files."""
    g = torch.Generator().manual_seed(0)
    tensors = {
        f"l.{i}.proj.weight": torch.randn(32, 256, generator=g).bfloat16() for i in range(24)
    }
    tensors["norm.weight"] = torch.ones(256)
    path = make_custom(tmp_path_factory.mktemp("src") / "m", tensors, shards=2)
    (path / "tokenizer.json").write_text('{"version": "1.0"}\n')
    return path


def _argv(src: Path, dst: Path, scheme: str, *extra: str) -> list[str]:
    base = [str(src), str(dst), "--scheme", scheme, "--no-progress", "--device", "cpu"]
    return [*base, "--max-shard-size", "40KiB", *extra]


@pytest.fixture(scope="module")
def references(src: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, dict]:
    """The bytes of undisturbed runs, per scheme, and how long one run writes."""
    out: dict[str, dict] = {}
    root = tmp_path_factory.mktemp("ref")
    for scheme in (OLD_SCHEME, NEW_SCHEME):
        dst = root / scheme
        seconds = _writing_seconds(_argv(src, dst, scheme), root / "err")
        out[scheme] = {"digest": _digest(dst), "seconds": seconds, "dir": dst}
        assert len([f for f in out[scheme]["digest"] if f.endswith(".safetensors")]) >= 3
    return out


def _check_after_kill(dst: Path, refs: dict, force: bool) -> list[Path]:
    """The invariants after a kill; returns the stale entries left next to DST."""
    allowed = [refs[NEW_SCHEME]["digest"]] + ([refs[OLD_SCHEME]["digest"]] if force else [])
    if dst.exists():
        assert _digest(dst) in allowed, "DST exists but is not a complete checkpoint"
        load(dst)
    elif force:  # a --force run may only remove the old DST once the new one is in place:
        assert sw.stale_paths(dst), "the old DST vanished"  # it is kept aside, restorable
    others = [p for p in dst.parent.iterdir() if p != dst]
    for p in others:
        assert p.name.startswith(f".{dst.name}.mxplus-"), p
        if sw.TMP_TAG in p.name and (p / "config.json").exists():
            assert _digest(p) == refs[NEW_SCHEME]["digest"], f"{p}: config.json, not complete"
    return [p for p in others if not p.name.endswith(sw.LOCK_TAG)]


def _rerun_and_check(src: Path, dst: Path, refs: dict, stale: list[Path], tmp: Path) -> None:
    rc, err = _run(_argv(src, dst, NEW_SCHEME, "--force"), tmp / "rerun.err")
    assert rc == 0, err
    for p in stale:
        assert str(p) in err, f"stale {p} not named: {err}"
    assert sorted(p.name for p in dst.parent.iterdir()) == [dst.name]
    assert _digest(dst) == refs[NEW_SCHEME]["digest"]


@pytest.mark.slow  # many killed and resumed runs: ~1.5 min
def test_sigkill_at_random_times(src: Path, references: dict, tmp_path: Path) -> None:
    src_before = _digest(src)
    rng = random.Random(0)
    hi = 1.2 * references[NEW_SCHEME]["seconds"]
    seen_stale = 0
    # Each kill lands a random time after the run's unfinished output appeared (so start-up on
    # a loaded machine does not move it out of the writing); RANDOM_KILLS runs at least, more
    # (up to 4x) until a quarter of them landed mid-run. A run that finished before its kill
    # narrows the window to where the writing ended.
    i = 0
    while i < RANDOM_KILLS or (seen_stale < RANDOM_KILLS // 4 and i < 4 * RANDOM_KILLS):
        out = tmp_path / f"run{i}"
        dst = out / "d" / "q"  # logs in out, DST alone in its directory
        dst.parent.mkdir(parents=True)
        force = i % 2 == 1
        if force:  # an existing, complete DST from another scheme
            shutil.copytree(references[OLD_SCHEME]["dir"], dst)
        rc, err = _run(
            _argv(src, dst, NEW_SCHEME, *(["--force"] if force else [])),
            out / "kill.err",
            kill_after=(kill := rng.uniform(0.0, hi)),
        )
        assert rc in (-signal.SIGKILL, 0), err
        stale = _check_after_kill(dst, references, force)
        seen_stale += bool(stale)
        if rc == 0:
            hi = max(0.02, 0.5 * (kill + hi))
        _rerun_and_check(src, dst, references, stale, out)
        i += 1
    assert seen_stale >= RANDOM_KILLS // 4, f"only {seen_stale} kills landed mid-run"
    assert _digest(src) == src_before


POINTS = [
    "mid-tensor",
    "first-shard-closed",
    "mid-config",
    "before-swap",
    "between-renames",
    "after-renames",
]


@pytest.mark.parametrize(
    "point, force",
    # without --force there is one rename (tmp -> DST): "between-renames" is just after it
    [(p, False) for p in POINTS[:-1]] + [(p, True) for p in POINTS],
    ids=[f"new-{p}" for p in POINTS[:-1]] + [f"force-{p}" for p in POINTS],
)
def test_sigkill_at_chosen_points(
    src: Path, references: dict, tmp_path: Path, point: str, force: bool
) -> None:
    dst = tmp_path / "d" / "q"
    if force:
        shutil.copytree(references[OLD_SCHEME]["dir"], dst)
    argv = _argv(src, dst, NEW_SCHEME, *(["--force"] if force else []))
    rc, err = _run(argv, tmp_path / "kill.err", kill_at=point)
    assert rc == -signal.SIGKILL, err
    stale = _check_after_kill(dst, references, force)
    if force or "renames" not in point:  # (without --force, the first rename is the last)
        assert stale, "a killed run leaves its temporary directory"
    if point == "mid-config":  # the marker's text is whole on disk, but not under its name
        (tmp,) = (p for p in stale if sw.TMP_TAG in p.name)
        assert not (tmp / "config.json").exists()
        assert json.loads((tmp / "config.json.partial").read_text())["quantization_config"]
    if point == "between-renames" and force:  # the old DST is aside and DST is missing
        assert not dst.exists()
        rc, err = _run(_argv(src, dst, NEW_SCHEME), tmp_path / "restore.err")
        assert rc == 2 and "restored as" in err and "DST exists" in err, err
        assert _digest(dst) == references[OLD_SCHEME]["digest"]  # the user's DST is back
    _rerun_and_check(src, dst, references, stale if rc != 2 else [], tmp_path)


def test_second_run_on_same_dst_is_refused(src: Path, tmp_path: Path) -> None:
    dst = tmp_path / "q"
    fd = sw._lock(dst)  # a run in progress
    try:
        with pytest.raises(UsageError, match=rf"another mxplus quantize \(pid {os.getpid()}\)"):
            quantize_checkpoint(src, dst, NEW_SCHEME, progress=False, device="cpu")
    finally:
        sw._unlock(dst, fd)
    assert sorted(p.name for p in tmp_path.iterdir()) == []
    quantize_checkpoint(src, dst, NEW_SCHEME, progress=False, device="cpu")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["q"]


def _assert_clean_failure(rc: int, err: str, dst: Path, *needles: str) -> None:
    assert rc == 1, err
    lines = [ln for ln in err.splitlines() if ln.startswith("mxplus quantize: error: ")]
    assert len(lines) == 1, err
    for n in needles:
        assert n in lines[0], lines[0]
    assert not dst.exists()
    if dst.parent.exists():
        assert [p.name for p in dst.parent.iterdir() if p.name.startswith(f".{dst.name}")] == []


def test_file_size_limit(src: Path, tmp_path: Path) -> None:
    """RLIMIT_FSIZE: writes fail with EFBIG (Python ignores SIGXFSZ) mid-shard."""
    before = _digest(src)
    dst = tmp_path / "q"
    rc, err = _run(_argv(src, dst, NEW_SCHEME), tmp_path / "err", fsize=20_000)
    _assert_clean_failure(rc, err, dst, "File too large", "free disk space", ".safetensors")
    assert _digest(src) == before


def _mount_tmpfs(path: Path, *opts: str) -> bool:
    path.mkdir(parents=True, exist_ok=True)
    if os.geteuid() != 0:
        return False
    r = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", ",".join(opts), "tmpfs", str(path)], capture_output=True
    )
    return r.returncode == 0


@pytest.fixture
def mounts(tmp_path: Path):
    done: list[Path] = []
    yield done
    for m in done:
        subprocess.run(["umount", "-l", str(m)], check=False)


@pytest.mark.parametrize("precheck", [True, False], ids=["precheck", "fills-during-run"])
def test_full_tmpfs(src: Path, tmp_path: Path, mounts: list, precheck: bool) -> None:
    mnt = tmp_path / "small"
    if not _mount_tmpfs(mnt, "size=64k"):
        pytest.skip("mounting a small tmpfs needs root and CAP_SYS_ADMIN")
    mounts.append(mnt)
    dst = mnt / "out" / "q"
    kill_at = "" if precheck else "no-disk-check"
    rc, err = _run(_argv(src, dst, NEW_SCHEME), tmp_path / "err", kill_at=kill_at)
    if precheck:
        _assert_clean_failure(rc, err, dst, "GiB needed", str(mnt))
    else:
        _assert_clean_failure(rc, err, dst, "No space left on device", "free disk space")


def test_read_only_target(src: Path, tmp_path: Path, mounts: list) -> None:
    ro = tmp_path / "ro"
    if _mount_tmpfs(ro, "ro", "size=1m"):
        mounts.append(ro)
        reason = "Read-only file system"
    elif os.geteuid() != 0:
        ro.mkdir(exist_ok=True)
        ro.chmod(0o555)
        reason = "Permission denied"
    else:
        pytest.skip("root ignores permission bits and cannot mount a read-only tmpfs here")
    before = _digest(src)
    dst = ro / "q"
    rc, err = _run(_argv(src, dst, NEW_SCHEME), tmp_path / "err")
    _assert_clean_failure(rc, err, dst, reason, "choose a DST in a writable directory")
    assert _digest(src) == before
