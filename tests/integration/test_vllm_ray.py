"""vLLM's Ray executor with the plugin: `tensor_parallel_size=2,
distributed_executor_backend="ray"` on a local Ray cluster on loopback, pre-quantized tiny
checkpoint. Greedy tokens must equal the single-process run's, and inside every Ray worker
the plugin must be imported, "mxfp4-mbs" must resolve to its config class and the model's
layers must run its quant method.

xfails with vLLM's own error while vLLM's CPU build cannot run the Ray executor (see
docs/deploy.md, "Several nodes"), and checks all of the above as soon as it can.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

pytestmark = [pytest.mark.vllm, pytest.mark.slow]
pytest.importorskip("ray", reason="ray is not installed (pip install ray)")

HERE = Path(__file__).resolve().parent


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def ray_address(tmp_path_factory, subprocess_env):
    """A one-node Ray cluster on 127.0.0.1 (its own session), stopped at the end."""
    ray_bin = Path(sys.executable).with_name("ray")
    if not ray_bin.exists():
        pytest.skip(f"{ray_bin} not found")
    port = _free_port()
    temp = Path("/tmp") / f"ray-mxplus-{os.getpid()}"  # short: Ray's socket paths are limited
    log = tmp_path_factory.mktemp("ray") / "ray.log"
    cmd = [
        str(ray_bin),
        *("start", "--head", "--block", "--node-ip-address=127.0.0.1", f"--port={port}"),
        *("--num-cpus=2", "--include-dashboard=false", "--disable-usage-stats"),
        f"--temp-dir={temp}",
    ]
    with open(log, "w") as f:
        proc = subprocess.Popen(
            cmd, env=subprocess_env, stdout=f, stderr=subprocess.STDOUT, start_new_session=True
        )
    address = f"127.0.0.1:{port}"
    try:
        deadline = time.time() + 120
        while "Ray runtime started" not in log.read_text():
            if proc.poll() is not None or time.time() > deadline:
                pytest.fail(f"ray start failed:\n{log.read_text()[-3000:]}")
            time.sleep(1)
        yield address
    finally:
        proc.send_signal(signal.SIGINT)  # `ray start --block` stops its cluster on SIGINT
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
        shutil.rmtree(temp, ignore_errors=True)


def _drive(model: str, mode: str, out: Path, env: dict) -> dict:
    r = subprocess.run(
        [sys.executable, str(HERE / "ray_driver.py"), model, mode, str(out)],
        env=env,
        capture_output=True,
        text=True,
        timeout=900,
    )
    if not out.exists():
        return {"error": f"driver exited {r.returncode} without a result: {r.stderr[-2000:]}"}
    res = json.loads(out.read_text())
    if "error" in res:  # the engine core's root cause, not the wrapper "initialization failed"
        causes = re.findall(r"^(\w+(?:Error|Exception): .+)$", r.stderr, re.MULTILINE)
        res["error"] = causes[0] if causes else res["error"]
    return res


def test_ray_tp2_matches_single_process(tiny_models, ray_address, tmp_path, subprocess_env):
    model = tiny_models["tiny256-mxfp4-mbs"]
    single = _drive(model, "single", tmp_path / "single.json", subprocess_env)
    assert "error" not in single, single["error"]
    env = {
        **subprocess_env,
        "RAY_ADDRESS": ray_address,
        "VLLM_HOST_IP": "127.0.0.1",
        "VLLM_CPU_OMP_THREADS_BIND": "0|1",
    }
    ray = _drive(model, "ray", tmp_path / "ray.json", env)
    if "error" in ray:
        # vLLM 0.32 CPU: "ValueError: current platform cpu does not support ray."
        # (initialize_ray_cluster: CpuPlatform.ray_device_key is empty)
        pytest.xfail(f"vLLM CPU cannot run the Ray executor: {ray['error'][:500]}")
    assert ray["tokens"] == single["tokens"]
    workers = ray["workers"]
    assert len(workers) == 2 and len({w["pid"] for w in workers}) == 2
    for w in workers:
        assert w["pid"] != ray["driver_pid"] and w["ray_worker"], w
        assert w["plugin_imported"], w
        assert w["mxfp4-mbs"].startswith("vllm_mxplus."), w
        assert any("Mxplus" in m for m in w["quant_methods"]), w
