"""The eval worker imports the vllm_mxplus package the runner runs, whatever its working
directory holds: a study run from a clean worktree (PYTHONPATH) must not pick up the code of
the checkout it writes results into."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import vllm_mxplus
from vllm_mxplus.evaluation import runner


def test_package_root_is_the_running_package() -> None:
    assert (
        Path(runner.PACKAGE_ROOT, "vllm_mxplus", "__init__.py").resolve()
        == Path(vllm_mxplus.__file__).resolve()
    )


def test_worker_ignores_a_package_in_its_working_directory(tmp_path: Path) -> None:
    """The worker's command line (-P, PYTHONPATH = PACKAGE_ROOT first) imports the runner's
    package even with a decoy vllm_mxplus in the working directory, which `python -m` alone
    would import."""
    decoy = tmp_path / "vllm_mxplus"
    decoy.mkdir()
    (decoy / "__init__.py").write_text("raise ImportError('decoy package imported')\n")
    env = {**os.environ, "PYTHONPATH": runner.PACKAGE_ROOT}
    code = ["-c", "import vllm_mxplus; print(vllm_mxplus.__file__)"]
    plain = subprocess.run(
        [sys.executable, *code], cwd=tmp_path, env=env, capture_output=True, text=True
    )
    assert "decoy package imported" in plain.stderr  # the hazard is real without -P
    guarded = subprocess.run(
        [sys.executable, "-P", *code], cwd=tmp_path, env=env, capture_output=True, text=True
    )
    assert guarded.returncode == 0, guarded.stderr
    assert Path(guarded.stdout.strip()).resolve() == Path(vllm_mxplus.__file__).resolve()


def test_run_cell_uses_the_guarded_command(monkeypatch, tmp_path: Path) -> None:
    seen: dict = {}

    class FakeProc:
        def wait(self, timeout=None):
            return 0

    def fake_popen(args, **kw):
        seen["args"], seen["env"] = args, kw["env"]
        return FakeProc()

    monkeypatch.setattr(runner.subprocess, "Popen", fake_popen)
    monkeypatch.setattr(runner, "_kill_group", lambda proc: None)
    monkeypatch.setattr(runner, "worker_spec", lambda cfg, cell: {"meta": {}, "include_path": None})
    monkeypatch.setattr(runner, "lm_eval_command", lambda spec: "lm_eval ...")

    class Cell:
        class model:
            id = "m"

        class row:
            id = "r"

        out = tmp_path / "raw" / "x.json"
        name = "m/r"

    class Cfg:
        env: dict = {}

    runner.run_cell(Cfg(), Cell(), tmp_path)  # type: ignore[arg-type]
    assert seen["args"][1:4] == ["-P", "-m", "vllm_mxplus.evaluation.worker"]
    assert seen["env"]["PYTHONPATH"].split(os.pathsep)[0] == runner.PACKAGE_ROOT
