"""The soak test's body, stream, metrics and log checks (`scripts/soak_checks.py`) can fail:
each is fed a correct response and responses broken one way at a time (fast, no server)."""

from __future__ import annotations

import copy
import json
import math

import pytest
from integration_harness import load_script

checks = load_script("soak_checks")
soak = load_script("soak_server")

REQ = {"model": "m", "prompt": "hi", "max_tokens": 4, "logprobs": 1, "stop": ["."]}
GOOD = {
    "object": "text_completion",
    "choices": [
        {
            "index": 0,
            "text": " a b c d",
            "finish_reason": "length",
            "logprobs": {
                "tokens": [" a", " b", " c", " d"],
                "token_logprobs": [-0.1, -1.0, -2.0, 0.0],
                "top_logprobs": [{" a": -0.1, " x": -3.0}] * 4,
            },
        }
    ],
    "usage": {"prompt_tokens": 1, "completion_tokens": 4, "total_tokens": 5},
}


def _broken(path: str, value: object) -> dict:
    body = copy.deepcopy(GOOD)
    *head, last = path.split(".")
    node: object = body
    for k in head:
        node = node[int(k)] if isinstance(node, list) else node[k]  # type: ignore[index]
    node[int(last) if isinstance(node, list) else last] = value  # type: ignore[index]
    return body


def test_good_completion_passes() -> None:
    assert checks.check_completion(GOOD, REQ) == []


@pytest.mark.parametrize(
    "path, value, problem",
    [
        ("object", "chat.completion", "not a text_completion"),
        ("choices.0.finish_reason", "abort", "finish_reason 'abort'"),
        ("usage.completion_tokens", 5, "completion_tokens 5 > n * max_tokens 4"),
        ("usage.completion_tokens", 3, "finish_reason length after 3"),
        ("choices.0.text", " a. b", "stop sequence '.'"),
        ("choices.0.logprobs.token_logprobs.1", math.nan, "not finite"),
        ("choices.0.logprobs.token_logprobs.1", 0.5, "not finite and <= 0"),
        ("choices.0.logprobs.tokens", [" a"], "1 logprob tokens, completion_tokens 4"),
        ("usage.total_tokens", 9, "total_tokens != prompt_tokens + completion_tokens"),
    ],
)
def test_broken_completion_fails(path: str, value: object, problem: str) -> None:
    problems = checks.check_completion(_broken(path, value), REQ)
    assert any(problem in p for p in problems), problems


def _sse(*objs: object, done: bool = True) -> list[bytes]:
    lines = [b"data: " + json.dumps(o).encode() + b"\n" for o in objs]
    return lines + ([b"data: [DONE]\n"] if done else [])


CHUNKS = [
    {"choices": [{"index": 0, "text": " a", "finish_reason": None}]},
    {"choices": [{"index": 0, "text": " b", "finish_reason": "length"}]},
    {"choices": [], "usage": {"prompt_tokens": 1, "completion_tokens": 2, "total_tokens": 3}},
]
SREQ = {"model": "m", "prompt": "hi", "max_tokens": 2, "stream": True}


def test_stream_checks() -> None:
    text, problems = checks.check_stream(checks.parse_sse(_sse(*CHUNKS)), SREQ, chat=False)
    assert (text, problems) == (" a b", [])
    err = {"error": {"message": "boom", "code": 500}}
    s = checks.parse_sse(_sse(CHUNKS[0], err, done=False))
    _, problems = checks.check_stream(s, SREQ, chat=False)
    assert len(s.errors) == 1 and any("in-stream error" in p for p in problems)
    assert any("no data: [DONE]" in p for p in problems)
    assert any("no finish_reason" in p for p in problems)
    twice = copy.deepcopy(CHUNKS)
    twice[0]["choices"][0]["finish_reason"] = "stop"
    _, problems = checks.check_stream(checks.parse_sse(_sse(*twice)), SREQ, chat=False)
    assert any("two finish_reasons" in p for p in problems)
    r = soak.Result("stream-completion", 200, 0.1, stream_errors=1)
    assert not soak.ok(r)


def test_metrics_and_log() -> None:
    text = (
        "# HELP vllm:num_requests_running x\n"
        'vllm:num_requests_running{model_name="m",engine="0"} 2.0\n'
        'vllm:request_success_total{finished_reason="abort",model_name="m"} 16.0\n'
        'vllm:request_success_total{finished_reason="stop",model_name="m"} 3.0\n'
    )
    assert checks.metric_sum(text, "vllm:num_requests_running") == 2.0
    assert checks.metric_sum(text, "vllm:request_success_total", finished_reason="abort") == 16
    log = "INFO ok\nERROR 12-02 engine died\nTraceback (most recent call last):\nINFO fine\n"
    assert len(checks.log_errors(log)) == 2
    assert checks.log_errors("INFO 200 OK\nWARNING slow\n") == []
