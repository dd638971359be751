"""`vllm serve TINY --quantization mxfp4-mbs` on loopback: OpenAI endpoints, NaN, load.

One server for the module (start-up dominates on CI), stopped by SIGTERM to its PID.
"""

from __future__ import annotations

import json
import signal
import subprocess
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor

import pytest
from integration_harness import load_script
from tiny_models import POISON

pytestmark = pytest.mark.vllm

MODEL_NAME = "tiny-mxfp4-mbs"
STARTUP_TIMEOUT_S = 300


def _request(url: str, body=None, timeout: float = 120.0, raw: bytes | None = None):
    """(status, parsed JSON or text) for a GET (body None) or a POST."""
    data = raw if raw is not None else (None if body is None else json.dumps(body).encode())
    req = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            text = r.read().decode()
            status = r.status
    except urllib.error.HTTPError as e:
        text, status = e.read().decode(errors="replace"), e.code
    try:
        return status, json.loads(text)
    except json.JSONDecodeError:
        return status, text


@pytest.fixture(scope="module")
def server(tiny_models, tmp_path_factory, subprocess_env):
    soak = load_script("soak_server")
    port = soak.free_port()
    log_path = tmp_path_factory.mktemp("server") / "serve.log"
    cmd = soak.serve_command(tiny_models["tiny256"], "mxfp4-mbs", MODEL_NAME, port, 256, 16)
    log = open(log_path, "w")  # noqa: SIM115
    proc = subprocess.Popen(cmd, env=subprocess_env, stdout=log, stderr=subprocess.STDOUT)
    base = f"http://127.0.0.1:{port}"
    deadline = time.time() + STARTUP_TIMEOUT_S
    try:
        while time.time() < deadline:
            if proc.poll() is not None:
                pytest.fail(
                    f"vllm serve exited with {proc.returncode}:\n{log_path.read_text()[-4000:]}"
                )
            try:
                if _request(base + "/health", timeout=5)[0] == 200:
                    break
            except (urllib.error.URLError, ConnectionError, TimeoutError):
                pass
            time.sleep(1)
        else:
            pytest.fail(
                f"vllm serve not ready in {STARTUP_TIMEOUT_S}s:\n{log_path.read_text()[-4000:]}"
            )
        yield base, proc, log_path
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        log.close()


def _completion(base: str, prompt: str, max_tokens: int = 16, **kw):
    body = {
        "model": MODEL_NAME,
        "prompt": prompt,
        "max_tokens": max_tokens,
        "temperature": 0.0,
        "ignore_eos": True,
        **kw,
    }
    return _request(base + "/v1/completions", body)


def test_completions(server):
    base, _, log_path = server
    status, out = _completion(base, "the capital of france is")
    assert status == 200, out
    assert out["choices"][0]["text"].strip()
    assert out["usage"]["completion_tokens"] == 16
    assert "mxplus mxfp4-mbs on cpu" in log_path.read_text()  # the dispatch log line


def test_chat_completions(server):
    base, _, _ = server
    body = {
        "model": MODEL_NAME,
        "max_tokens": 8,
        "temperature": 0.0,
        "messages": [{"role": "user", "content": "hello world"}],
    }
    status, out = _request(base + "/v1/chat/completions", body)
    assert status == 200, out
    assert out["choices"][0]["message"]["role"] == "assistant"
    assert isinstance(out["choices"][0]["message"]["content"], str)


def test_nan_request_does_not_disturb_others(server):
    """A prompt holding POISON (+inf embedding) drives NaN activations through the W4A4
    linears (NaN blocks -> E8M0 code 255). Requests batched with it are unaffected and the
    server stays up."""
    base, proc, _ = server
    clean = ["one two three", "hello world"]
    alone = [_completion(base, p, 12)[1]["choices"][0]["text"] for p in clean]
    with ThreadPoolExecutor(4) as ex:
        futs = [ex.submit(_completion, base, f"the {POISON} river", 12)]
        futs += [ex.submit(_completion, base, p, 12) for p in clean]
        results = [f.result() for f in futs]
    assert results[0][0] in (200, 400, 500), results[0]  # answered, whatever it says
    assert [r[1]["choices"][0]["text"] for r in results[1:]] == alone
    assert proc.poll() is None
    assert _request(base + "/health")[0] == 200


def test_bounded_load_with_malformed_requests(server):
    """64 concurrent completions on loopback with 8 malformed requests among them."""
    base, proc, _ = server
    valid = [
        {"prompt": f"one two {w} the", "max_tokens": 8 + i % 9}
        for i, w in enumerate(["sun", "moon", "star", "sky"] * 14)
    ]
    malformed = [
        {"raw": b"{not json"},
        {"body": {"model": MODEL_NAME, "prompt": "hello", "max_tokens": -3}},
        {"body": {"model": "no-such-model", "prompt": "hello", "max_tokens": 4}},
        {"body": {"model": MODEL_NAME, "max_tokens": 4}},  # no prompt
        {"body": {"model": MODEL_NAME, "prompt": "the " * 400, "max_tokens": 4}},  # > max len
        {"body": {"model": MODEL_NAME, "prompt": "hello", "temperature": "hot"}},
        {"body": {"model": MODEL_NAME, "prompt": [[10**9]], "max_tokens": 4}},  # bad token id
        {"body": {"model": MODEL_NAME, "prompt": "hello", "max_tokens": 4, "n": 0}},
    ]

    def send(item):
        if "raw" in item:
            return _request(base + "/v1/completions", raw=item["raw"])
        if "body" in item:
            return _request(base + "/v1/completions", item["body"])
        return _completion(base, item["prompt"], item["max_tokens"])

    items = valid + malformed
    order = sorted(range(len(items)), key=lambda i: (i * 37) % len(items))  # interleave
    with ThreadPoolExecutor(64) as ex:
        results = dict(zip(order, ex.map(send, [items[i] for i in order])))
    for i, item in enumerate(valid):
        status, out = results[i]
        assert status == 200, (item, out)
        assert out["usage"]["completion_tokens"] == item["max_tokens"]
    for j, item in enumerate(malformed, start=len(valid)):
        status, out = results[j]
        assert 400 <= status < 500, (item, status, out)
    assert proc.poll() is None
    assert _request(base + "/health")[0] == 200
    assert _completion(base, "hello world", 4)[0] == 200
