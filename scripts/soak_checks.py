"""Checks of the soak test (`soak_server.py`): OpenAI-API response bodies, SSE streams, the
server log and vLLM's Prometheus metrics. Pure functions: each returns a list of problems
(empty = fine), so a check can fail and say why.
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass, field

FINISH_REASONS = ("stop", "length")
LOG_ERROR = re.compile(r"\bERROR\b|Traceback \(most recent call last\)|\bCRITICAL\b")


@dataclass
class Stream:
    """A parsed server-sent-event stream: JSON payloads, error events, [DONE] seen."""

    payloads: list[dict] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)  # data: {"error": ...} events
    bad_lines: list[str] = field(default_factory=list)  # data: lines that are not JSON
    done: bool = False


def parse_sse(lines: list[bytes]) -> Stream:
    s = Stream()
    for raw in lines:
        line = raw.strip()
        if not line.startswith(b"data:"):
            continue
        data = line[5:].strip()
        if data == b"[DONE]":
            s.done = True
            continue
        try:
            obj = json.loads(data)
        except ValueError:
            s.bad_lines.append(data[:120].decode(errors="replace"))
            continue
        if not isinstance(obj, dict):
            s.bad_lines.append(str(obj)[:120])
        elif "error" in obj:
            s.errors.append(json.dumps(obj["error"])[:200])
        else:
            s.payloads.append(obj)
    return s


def _usage(body: dict, req: dict, n: int) -> list[str]:
    u = body.get("usage")
    if not isinstance(u, dict):
        return ["no usage"]
    p = []
    for k in ("prompt_tokens", "completion_tokens", "total_tokens"):
        if not isinstance(u.get(k), int) or u[k] < 0:
            p.append(f"usage.{k} = {u.get(k)!r}")
    if p:
        return p
    max_tokens = req.get("max_tokens") or req.get("max_completion_tokens")
    if isinstance(max_tokens, int) and u["completion_tokens"] > n * max_tokens:
        p.append(f"completion_tokens {u['completion_tokens']} > n * max_tokens {n * max_tokens}")
    if u["total_tokens"] != u["prompt_tokens"] + u["completion_tokens"]:
        p.append("total_tokens != prompt_tokens + completion_tokens")
    return p


def _finish(reason: object, text: str, req: dict, tokens: int | None) -> list[str]:
    p = []
    if reason not in FINISH_REASONS:
        p.append(f"finish_reason {reason!r}")
    max_tokens = req.get("max_tokens") or req.get("max_completion_tokens")
    length = reason == "length" and tokens is not None and isinstance(max_tokens, int)
    if length and tokens != max_tokens:
        p.append(f"finish_reason length after {tokens} of max_tokens {max_tokens}")
    stops = req.get("stop") or []
    for s in [stops] if isinstance(stops, str) else stops:
        if s and s in text:
            p.append(f"stop sequence {s!r} in the output")
    return p


def _logprob_values(values: list[object], what: str) -> list[str]:
    bad = [v for v in values if not (isinstance(v, int | float) and math.isfinite(v) and v <= 1e-4)]
    return [f"{what}: {len(bad)} logprobs not finite and <= 0 (e.g. {bad[0]!r})"] if bad else []


def _choices(body: object, req: dict, kind: str) -> tuple[list[dict] | None, list[str], int | None]:
    """(choices, problems, completion_tokens when n = 1) of a non-streamed body whose "object"
    must be `kind`: the envelope checks (object, one choice per n, usage) of both endpoints.
    choices None: the body is not usable, the problems say why."""
    if not isinstance(body, dict) or body.get("object") != kind:
        return None, [f"not a {kind}: {str(body)[:120]}"], None
    n = req.get("n", 1)
    choices = body.get("choices")
    if not isinstance(choices, list) or len(choices) != n:
        return (
            None,
            [f"{len(choices) if isinstance(choices, list) else choices!r} choices, n = {n}"],
            None,
        )
    tokens = body.get("usage", {}).get("completion_tokens") if n == 1 else None
    return choices, _usage(body, req, n), tokens


def check_completion(body: object, req: dict) -> list[str]:
    """A non-streamed /v1/completions body against its request."""
    choices, p, tokens = _choices(body, req, "text_completion")
    if choices is None:
        return p
    n = len(choices)
    if sorted(c.get("index") for c in choices) != list(range(n)):
        p.append("choice indices are not 0..n-1")
    for c in choices:
        text = c.get("text")
        if not isinstance(text, str):
            p.append(f"choice text {text!r}")
            continue
        p += _finish(c.get("finish_reason"), text, req, tokens)
        if req.get("logprobs") is not None:
            p += _completion_logprobs(c.get("logprobs"), req["logprobs"], tokens)
    return p


def _completion_logprobs(lp: object, k: int, tokens: int | None) -> list[str]:
    if not isinstance(lp, dict):
        return [f"logprobs {lp!r}"]
    toks, vals, tops = lp.get("tokens"), lp.get("token_logprobs"), lp.get("top_logprobs")
    if not (isinstance(toks, list) and isinstance(vals, list) and isinstance(tops, list)):
        return ["logprobs lists missing"]
    p = []
    if not len(toks) == len(vals) == len(tops):
        p.append(f"logprobs lengths {len(toks)}, {len(vals)}, {len(tops)}")
    if tokens is not None and len(toks) != tokens:
        p.append(f"{len(toks)} logprob tokens, completion_tokens {tokens}")
    p += _logprob_values(vals, "token_logprobs")
    if any(not isinstance(t, dict) or len(t) > k + 1 for t in tops):
        p.append(f"top_logprobs entries beyond k + 1 = {k + 1}")
    else:
        p += _logprob_values([v for t in tops for v in t.values()], "top_logprobs")
    return p


def check_chat(body: object, req: dict) -> list[str]:
    """A non-streamed /v1/chat/completions body against its request."""
    choices, p, tokens = _choices(body, req, "chat.completion")
    if choices is None:
        return p
    for c in choices:
        msg = c.get("message")
        if not isinstance(msg, dict) or msg.get("role") != "assistant":
            p.append(f"message {str(msg)[:80]}")
            continue
        text = msg.get("content") or ""
        if not isinstance(text, str):
            p.append(f"content {text!r}")
            continue
        p += _finish(c.get("finish_reason"), text, req, tokens)
        if req.get("logprobs"):
            content = (c.get("logprobs") or {}).get("content")
            if not isinstance(content, list):
                p.append("logprobs.content missing")
                continue
            if tokens is not None and len(content) != tokens:
                p.append(f"{len(content)} logprob entries, completion_tokens {tokens}")
            p += _logprob_values([e.get("logprob") for e in content], "logprobs.content")
            k = req.get("top_logprobs", 0)
            if any(len(e.get("top_logprobs") or []) > k for e in content):
                p.append(f"more than top_logprobs = {k} alternatives")
    return p


def check_stream(s: Stream, req: dict, chat: bool) -> tuple[str, list[str]]:
    """(streamed text of choice 0, problems) of a finished stream against its request: JSON
    chunks, no error events, [DONE] last, one finish_reason per choice, usage (requested via
    stream_options) within max_tokens, at most one content delta per generated token."""
    p = [f"in-stream error: {e}" for e in s.errors] + [f"non-JSON data: {b}" for b in s.bad_lines]
    if not s.done:
        p.append("no data: [DONE]")
    n = req.get("n", 1)
    texts: dict[int, list[str]] = {i: [] for i in range(n)}
    finish: dict[int, object] = {}
    usage = None
    for obj in s.payloads:
        if obj.get("usage"):
            usage = obj
        for c in obj.get("choices") or []:
            i = c.get("index")
            if i not in texts:
                p.append(f"choice index {i!r} with n = {n}")
                continue
            piece = (c.get("delta") or {}).get("content") if chat else c.get("text")
            if piece:
                texts[i].append(piece)
            if c.get("finish_reason") is not None:
                if i in finish:
                    p.append(f"choice {i}: two finish_reasons")
                finish[i] = c["finish_reason"]
    tokens = None
    if usage is None:
        p.append("no usage chunk (stream_options.include_usage)")
    else:
        p += _usage(usage, req, n)
        tokens = usage["usage"].get("completion_tokens") if n == 1 else None
    for i in range(n):
        text = "".join(texts[i])
        if i not in finish:
            p.append(f"choice {i}: no finish_reason")
        else:
            p += _finish(finish[i], text, req, tokens)
        if tokens is not None and len(texts[i]) > tokens:
            p.append(f"{len(texts[i])} content deltas for {tokens} tokens")
    return "".join(texts[0]), p


def metric_sum(text: str, name: str, **labels: str) -> float:
    """The sum of a Prometheus metric's samples whose labels include `labels`."""
    total = 0.0
    for line in text.splitlines():
        if not line.startswith(name) or line.startswith("#"):
            continue
        head, _, value = line.rpartition(" ")
        metric, _, label_text = head.partition("{")
        if metric != name:
            continue
        if all(f'{k}="{v}"' in label_text for k, v in labels.items()):
            total += float(value)
    return total


def log_errors(text: str) -> list[str]:
    """Lines of the server log that report an error or a traceback."""
    return [ln.strip()[:240] for ln in text.splitlines() if LOG_ERROR.search(ln)]
