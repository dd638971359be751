"""Soak test of `vllm serve MODEL --quantization mxfp4-mbs` on loopback; writes a report.

    flock /tmp/mxplus-vllm.lock .venv/bin/python scripts/soak_server.py \\
        [--model DIR] [--duration 600] [--clients 16] [--out eval/soak/soak-DATE.md]

Starts the server on 127.0.0.1 only, waits for /health, then alternates two phases until
`--duration` has passed:
- load (`--wave-every` seconds): `--clients` threads pick request kinds from a fixed, seeded
  mix: completions and chat (plain, streamed, `n` > 1, `logprobs`, `stop` sequences), prompts
  at exactly `max_model_len` and one token over it, numerically unusual prompts (one token
  repeated, random ids over the whole vocabulary, digits, symbols and scripts), a streamed
  greedy request compared with the same request not streamed, malformed JSON, wrong types,
  huge `max_tokens`, NaN / Inf sampling parameters, clients that hang up mid-stream;
- quiesce: the clients stop; a wave of `--wave-size` streams (200 tokens each, ignore_eos)
  hang up after three chunks; vLLM's /metrics must show no request running or waiting within
  `--abort-timeout`, and the tokens generated since the wave began must stay at most half of
  what the streams would make unaborted (vLLM 0.32 counts no client aborts in /metrics; an
  abort shows as generation stopping); then a burst of `--burst` concurrent requests, all
  checked.
Every answered body is checked (soak_checks.py): JSON shape, choices and indices, usage with
completion tokens <= n * max_tokens, finish_reason, stop sequences absent from the text,
logprobs finite and <= 0 and one per token, streams parsed event by event (error events
counted, [DONE] last, one finish_reason per choice). The server's RSS (its process tree)
is sampled every few seconds; its log is scanned for ERROR / CRITICAL / tracebacks.

PASS (exit 0) only with: the server alive and /health 200 at the end; zero 5xx and zero
dropped connections; every valid request 200 with a body that passes its checks; invalid
ones 4xx; edge ones 200 (checked) or 4xx; zero in-stream error events; every streamed
greedy text equal to its non-streamed twin; every disconnect wave aborted (as above) and
drained to zero running requests; zero error lines in the server log; RSS growth from the
first sample after warm-up to the end within `--rss-growth-mib`.
"""

from __future__ import annotations

import argparse
import http.client
import json
import math
import os
import random
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter, defaultdict
from dataclasses import dataclass, field
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import soak_checks as checks  # noqa: E402  (a sibling script module)

REPO = Path(__file__).resolve().parents[1]
NAME = "soak-mxfp4-mbs"
VALID = (
    "completion",
    "chat",
    "stream-completion",
    "stream-chat",
    "long-prompt",
    "n-best",
    "logprobs",
    "chat-logprobs",
    "stop",
    "numeric-stress",
    "stream-vs-full",
)
INVALID = ("malformed-json", "wrong-types", "over-length")  # must be refused with a 4xx
EDGE = ("huge-max-tokens", "nan-params")  # answered (200, checked) or refused (4xx)
KINDS = VALID + INVALID + EDGE + ("disconnect-mid-stream",)
WEIGHTS = {
    "completion": 4,
    "chat": 3,
    "stream-completion": 3,
    "stream-chat": 2,
    "long-prompt": 1,
    "n-best": 1,
    "logprobs": 1,
    "chat-logprobs": 1,
    "stop": 1,
    "numeric-stress": 2,
    "stream-vs-full": 1,
    "malformed-json": 1,
    "wrong-types": 1,
    "over-length": 1,
    "huge-max-tokens": 1,
    "nan-params": 1,
    "disconnect-mid-stream": 1,
}
WORDS = [
    "the",
    "river",
    "flows",
    "to",
    "the",
    "sea",
    "and",
    "the",
    "city",
    "of",
    "paris",
    "lies",
    "on",
    "it",
    "while",
]
STOPS = [".", "\n", " the", ","]


@dataclass
class Result:
    kind: str
    status: int  # HTTP status; 0 = connection error; -1 = client hung up on purpose
    seconds: float
    detail: str = ""
    problems: list[str] = field(default_factory=list)  # failed body / stream checks
    stream_errors: int = 0  # data: {"error": ...} events in a 200 stream
    phase: str = "load"  # load | burst | wave


def serve_command(
    model: str,
    quantization: str,
    name: str,
    port: int,
    max_model_len: int,
    max_num_seqs: int,
) -> list[str]:
    """`vllm serve` of model on loopback, eager, bf16 (also the server of
    tests/integration/test_vllm_server.py)."""
    return [
        *(sys.executable, "-m", "vllm.entrypoints.cli.main", "serve", model),
        *(("--quantization", quantization) if quantization not in ("", "none") else ()),
        *("--served-model-name", name, "--host", "127.0.0.1", "--port", str(port)),
        *("--enforce-eager", "--max-model-len", str(max_model_len)),
        *("--max-num-seqs", str(max_num_seqs), "--dtype", "bfloat16"),
    ]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def tree_rss_mib(pid: int) -> float:
    """RSS of a process and all its descendants (the API server + engine core), MiB."""
    import psutil

    try:
        p = psutil.Process(pid)
        procs = [p, *p.children(recursive=True)]
    except psutil.NoSuchProcess:
        return float("nan")
    total = 0
    for q in procs:
        try:  # noqa: SIM105
            total += q.memory_info().rss
        except psutil.NoSuchProcess:
            pass
    return total / 2**20


def _get(port: int, path: str, timeout: float = 10) -> tuple[int, str]:
    try:
        c = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout)
        c.request("GET", path)
        r = c.getresponse()
        out = r.status, r.read().decode(errors="replace")
        c.close()
        return out
    except OSError:
        return 0, ""


def _health(port: int) -> int:
    return _get(port, "/health")[0]


class Client:
    """One HTTP client thread's requests (http.client: control over streams and hang-ups)."""

    def __init__(
        self, port: int, model: str, max_model_len: int, vocab: int, rng: random.Random
    ) -> None:
        self.port, self.model, self.max_len, self.vocab, self.rng = (
            port,
            model,
            max_model_len,
            vocab,
            rng,
        )

    def _post(self, path: str, body: bytes, stream: bool, hang_up_after: int = 0):
        """(status, text or Stream); a stream hung up on purpose gives status -1."""
        conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=300)
        try:
            conn.request("POST", path, body=body, headers={"Content-Type": "application/json"})
            r = conn.getresponse()
            if stream and r.status == 200:
                lines, chunks = [], 0
                for line in r:
                    lines.append(line)
                    if line.startswith(b"data:"):
                        chunks += 1
                        if hang_up_after and chunks >= hang_up_after:
                            conn.sock.shutdown(socket.SHUT_RDWR)  # vanish mid-stream
                            return -1, checks.parse_sse(lines)
                        if line.strip() == b"data: [DONE]":
                            break
                return r.status, checks.parse_sse(lines)
            return r.status, r.read().decode(errors="replace")
        finally:
            conn.close()

    def _words(self, n: int) -> str:
        return " ".join(self.rng.choice(WORDS) for _ in range(n))

    def _ids(self, n: int) -> list[int]:
        return [self.rng.randrange(self.vocab) for _ in range(n)]

    def body(self, kind: str) -> tuple[str, dict | bytes, bool]:
        """(path, request, streamed) for a kind; bytes for a request that is not JSON."""
        m, rng = self.model, self.rng
        comp, chat = "/v1/completions", "/v1/chat/completions"
        msgs = [{"role": "user", "content": self._words(rng.randint(3, 30))}]
        usage = {"stream_options": {"include_usage": True}}
        if kind == "completion":
            return comp, {"model": m, "prompt": self._words(rng.randint(3, 40)),
                          "max_tokens": rng.randint(1, 48),
                          "temperature": rng.choice([0.0, 0.7])}, False  # fmt: skip
        if kind == "chat":
            return chat, {"model": m, "messages": msgs, "max_tokens": rng.randint(1, 48)}, False
        if kind == "stream-completion":
            return comp, {"model": m, "prompt": self._words(20), "max_tokens": 32,
                          "stream": True, **usage}, True  # fmt: skip
        if kind == "stream-chat":
            return chat, {"model": m, "messages": msgs, "max_tokens": 32, "stream": True,
                          **usage}, True  # fmt: skip
        if kind == "long-prompt":  # token ids: prompt + max_tokens = max_model_len exactly
            return comp, {"model": m, "prompt": self._ids(self.max_len - 8), "max_tokens": 8,
                          "ignore_eos": True}, False  # fmt: skip
        if kind == "over-length":  # a prompt one token over the limit: a 400, never a 5xx
            # (prompt + max_tokens over it is not an error: vLLM 0.32 shortens max_tokens)
            return comp, {"model": m, "prompt": self._ids(self.max_len + 1), "max_tokens": 8}, False
        if kind == "n-best":
            return comp, {"model": m, "prompt": self._words(10), "n": rng.choice([2, 3, 4]),
                          "max_tokens": 16, "temperature": 0.9, "seed": rng.randrange(1000)}, False  # fmt: skip
        if kind == "logprobs":
            return comp, {"model": m, "prompt": self._words(12), "max_tokens": 16,
                          "logprobs": rng.choice([0, 1, 5])}, False  # fmt: skip
        if kind == "chat-logprobs":
            return chat, {"model": m, "messages": msgs, "max_tokens": 16, "logprobs": True,
                          "top_logprobs": rng.choice([0, 2, 5])}, False  # fmt: skip
        if kind == "stop":
            req = {"model": m, "prompt": self._words(15), "max_tokens": 40,
                   "stop": rng.sample(STOPS, rng.randint(1, 3))}  # fmt: skip
            if rng.random() < 0.5:
                return chat, {**req, "messages": msgs, "prompt": None}, False
            return comp, req, False
        if kind == "numeric-stress":
            stream = rng.random() < 0.5
            return comp, {"model": m, "prompt": self.stress_prompt(), "max_tokens": 16,
                          "ignore_eos": True, "temperature": 0.0, "stream": stream}, stream  # fmt: skip
        if kind == "malformed-json":
            return comp, b'{"model": "' + m.encode() + b'", "prompt": "x",', False
        if kind == "wrong-types":
            body = rng.choice([
                {"model": m, "prompt": "hello", "max_tokens": "many"},
                {"model": m, "prompt": "hello", "temperature": "hot"},
                {"model": m, "messages": "not a list"},
                {"model": m, "prompt": {"a": 1}},
            ])  # fmt: skip
            return (chat if "messages" in body else comp), body, False
        if kind == "huge-max-tokens":
            return comp, {"model": m, "prompt": "hello", "max_tokens": 10**12}, False
        if kind == "nan-params":  # Python's json writes NaN / Infinity literals;
            # a temperature of 1e-30 overflows logits / T to inf in the sampler
            extra = rng.choice([
                {"temperature": 1e-30}, {"temperature": float("nan")},
                {"top_p": float("inf")}, {"presence_penalty": float("-inf")},
                {"logit_bias": {"1": 1e308}}, {"frequency_penalty": 1e300},
            ])  # fmt: skip
            return comp, {"model": m, "prompt": "hello", "max_tokens": 4, **extra}, False
        if kind == "disconnect-mid-stream":
            return comp, {"model": m, "prompt": self._words(10), "max_tokens": WAVE_MAX_TOKENS,
                          "ignore_eos": True, "stream": True}, True  # fmt: skip
        raise ValueError(kind)

    def stress_prompt(self) -> list[int] | str:
        """Inputs far from natural text: the paths where activations and logits are extreme
        (a token repeated hundreds of times is the classic trigger of massive activations;
        random ids reach rare embedding rows)."""
        rng, n = self.rng, self.max_len - 16
        choice = rng.randrange(5)
        if choice == 0:
            return [rng.randrange(self.vocab)] * n
        if choice == 1:
            return self._ids(n)
        if choice == 2:
            return [0] * (n // 2) + [self.vocab - 1] * (n - n // 2)
        if choice == 3:
            return "9" * (n // 2)
        return "".join(rng.choice("∑∞≈\u200b🙂中文العربية\t\n ~!@#$%^&*") for _ in range(n // 2))

    def request(self, kind: str, phase: str = "load") -> Result:
        if kind == "stream-vs-full":
            return self._stream_vs_full(phase)
        path, req, stream = self.body(kind)
        if isinstance(req, dict) and req.get("prompt", 0) is None:
            req = {k: v for k, v in req.items() if k != "prompt"}
        raw = req if isinstance(req, bytes) else json.dumps(req).encode()
        hang = 3 if kind == "disconnect-mid-stream" else 0
        if stream and isinstance(req, dict) and "stream_options" not in req:
            req["stream_options"] = {"include_usage": True}
            raw = json.dumps(req).encode()
        t0 = time.perf_counter()
        try:
            status, out = self._post(path, raw, stream, hang)
        except (OSError, http.client.HTTPException) as e:
            return Result(
                kind, 0, time.perf_counter() - t0, f"{type(e).__name__}: {e}", [], 0, phase
            )
        r = Result(kind, status, time.perf_counter() - t0, phase=phase)
        if isinstance(out, checks.Stream):
            r.stream_errors = len(out.errors)
            if status == 200:
                _, r.problems = checks.check_stream(
                    out, req, chat=path.endswith("chat/completions")
                )  # type: ignore[arg-type]
            elif status == -1:
                r.problems = [f"in-stream error: {e}" for e in out.errors]
            r.detail = f"{len(out.payloads)} chunks"
            return r
        r.detail = out[:200]
        if status == 200 and isinstance(req, dict):
            try:
                body = json.loads(out)
            except ValueError:
                r.problems = [f"200 with a body that is not JSON: {out[:80]!r}"]
                return r
            chat = path.endswith("chat/completions")
            r.problems = (checks.check_chat if chat else checks.check_completion)(body, req)
        return r

    def _stream_vs_full(self, phase: str) -> Result:
        """A greedy request streamed and not streamed: the deltas must add up to the text."""
        chat = self.rng.random() < 0.5
        path = "/v1/chat/completions" if chat else "/v1/completions"
        req: dict = {"model": self.model, "max_tokens": 24, "temperature": 0.0, "seed": 0}
        if chat:
            req["messages"] = [{"role": "user", "content": self._words(12)}]
        else:
            req["prompt"] = self._words(12)
        t0 = time.perf_counter()
        try:
            s1, full = self._post(path, json.dumps(req).encode(), False)
            sreq = {**req, "stream": True, "stream_options": {"include_usage": True}}
            s2, st = self._post(path, json.dumps(sreq).encode(), True)
        except (OSError, http.client.HTTPException) as e:
            return Result("stream-vs-full", 0, time.perf_counter() - t0, str(e), [], 0, phase)
        status = s1 if s1 != 200 else s2
        r = Result("stream-vs-full", status, time.perf_counter() - t0, phase=phase)
        if s1 != 200 or s2 != 200 or not isinstance(st, checks.Stream):
            return r
        body = json.loads(full)
        r.problems = (checks.check_chat if chat else checks.check_completion)(body, req)
        streamed, sp = checks.check_stream(st, sreq, chat)
        r.stream_errors = len(st.errors)
        r.problems += sp
        text = body["choices"][0]["message"]["content"] if chat else body["choices"][0]["text"]
        if streamed != (text or ""):
            r.problems.append(f"streamed {streamed[:60]!r} != full {str(text)[:60]!r}")
        return r


def ok(r: Result) -> bool:
    """What the pass criteria accept for one request (status and body checks)."""
    if r.problems or r.stream_errors:
        return False
    if r.kind in VALID:
        return r.status == 200
    if r.kind == "disconnect-mid-stream":
        return r.status in (-1, 200)
    if r.kind in EDGE:
        return r.status == 200 or 400 <= r.status < 500
    return 400 <= r.status < 500


def percentile(xs: list[float], q: float) -> float:
    """Nearest-rank percentile (q in [0, 100]) of a non-empty list."""
    s = sorted(xs)
    k = max(0, min(len(s) - 1, math.ceil(q / 100 * len(s)) - 1))
    return s[k]


def render(meta: dict, results: list[Result], waves: list[dict], verdict: dict) -> str:
    by_kind: dict[str, list[Result]] = defaultdict(list)
    for r in results:
        by_kind[r.kind].append(r)
    n_5xx = sum(500 <= r.status < 600 for r in results)
    lines = [
        f"# Soak test: `vllm serve` {meta['model_name']} `--quantization {meta['quantization']}`",
        "",
        f"Command: `{meta['command']}`",
        "",
        f"Commit: `{meta['commit']}`. Machine: {meta['machine']}; load average at start "
        f"{meta['load_start']}, at end {meta['load_end']}. vLLM {meta['vllm']}, torch "
        f"{meta['torch']}.",
        "",
        f"Server: `{meta['server_cmd']}` (loopback only).",
        "",
        f"Duration {meta['duration']:.0f} s, {meta['clients']} concurrent clients, "
        f"{len(results)} requests ({sum(r.phase == 'burst' for r in results)} in bursts of "
        f"{meta['burst']}, {sum(r.phase == 'wave' for r in results)} in disconnect waves), "
        f"{sum(not ok(r) for r in results)} outside the pass criteria.",
        "",
        "| kind | requests | status codes | body / stream problems | p50 s | p99 s | accepted |",
        "|---|---|---|---|---|---|---|",
    ]
    for kind in KINDS:
        rs = by_kind.get(kind, [])
        if not rs:
            continue
        codes = Counter(
            "hung up" if r.status == -1 else ("conn error" if r.status == 0 else str(r.status))
            for r in rs
        )
        lat = [r.seconds for r in rs]
        lines.append(
            f"| {kind} | {len(rs)} | "
            f"{', '.join(f'{c}: {n}' for c, n in sorted(codes.items()))} | "
            f"{sum(bool(r.problems) for r in rs)} | "
            f"{percentile(lat, 50):.3f} | {percentile(lat, 99):.3f} | "
            f"{sum(ok(r) for r in rs)}/{len(rs)} |"
        )
    lines += [
        "",
        "| disconnect wave | streams | tokens generated (unaborted: all) | running + waiting "
        "after | seconds to drain | burst answered 200 |",
        "|---|---|---|---|---|---|",
    ]
    for i, w in enumerate(waves):
        lines.append(
            f"| {i + 1} | {w['size']} | {w['tokens']:.0f} ({w['full']}) | {w['left']:.0f} | "
            f"{w['drain_s']:.1f} | {w['burst_ok']}/{w['burst']} |"
        )
    lines += [
        "",
        "Criteria (all must hold for PASS), measured:",
        "",
        f"- 5xx responses: {n_5xx} (must be 0); dropped connections: "
        f"{sum(r.status == 0 for r in results)} (must be 0)",
        f'- in-stream `data: {{"error": ...}}` events: '
        f"{sum(r.stream_errors for r in results)} (must be 0)",
        f"- responses failing their body / stream checks: "
        f"{sum(bool(r.problems) for r in results)} (must be 0)",
        f"- disconnect waves drained to 0 running + waiting within {meta['abort_timeout']:.0f} s "
        + (
            f"with at most half the tokens of unaborted streams ({WAVE_MAX_TOKENS} each): "
            if meta.get("abort_token_check", True)
            else "(token check off: --no-abort-token-check): "
        )
        + f"{verdict['waves_ok']}/{len(waves)} (must be all, >= 1)",
        f"- server log lines with ERROR / CRITICAL / Traceback: {len(verdict['log_errors'])} "
        "(must be 0)",
        f"- server RSS (process tree): start {verdict['rss_start']:.0f} MiB (after warm-up), "
        f"end {verdict['rss_end']:.0f} MiB, max {verdict['rss_max']:.0f} MiB; growth "
        f"{verdict['rss_growth']:+.0f} MiB (must be <= {meta['rss_bound']:.0f} MiB)",
        f"- server alive at the end: {verdict['alive']}; /health at the end: {verdict['health']}",
        "",
        f"Verdict: **{'PASS' if verdict['pass'] else 'FAIL'}**",
    ]
    bad = [r for r in results if not ok(r)][:10]
    if bad:
        lines += ["", "First requests outside the criteria:", ""]
        lines += [
            f"- {r.kind} ({r.phase}): status {r.status}, {'; '.join(r.problems)[:200] or r.detail[:160]!r}"
            for r in bad
        ]
    if verdict["log_errors"]:
        lines += ["", "First error lines of the server log:", ""]
        lines += [f"- `{ln}`" for ln in verdict["log_errors"][:10]]
    return "\n".join(lines) + "\n"


WAVE_MAX_TOKENS = 200  # what each hung-up stream would generate if it were not aborted


def _metrics(port: int) -> tuple[float, float]:
    """(running + waiting requests, generated tokens so far) from vLLM's /metrics.

    vLLM 0.32 does not count client aborts in vllm:request_success_total, so an abort shows
    as generation stopping: the tokens a wave generates stay far below WAVE_MAX_TOKENS per
    stream."""
    status, text = _get(port, "/metrics")
    if status != 200:
        return math.nan, math.nan
    busy = checks.metric_sum(text, "vllm:num_requests_running") + checks.metric_sum(
        text, "vllm:num_requests_waiting"
    )
    return busy, checks.metric_sum(text, "vllm:generation_tokens_total")


def _concurrently(client_of, kinds: list[str], phase: str) -> list[Result]:
    out: list[Result] = [None] * len(kinds)  # type: ignore[list-item]

    def one(i: int) -> None:
        out[i] = client_of(i).request(kinds[i], phase)

    threads = [threading.Thread(target=one, args=(i,)) for i in range(len(kinds))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return out


def wave_and_burst(port, model, args, vocab, seed) -> tuple[dict, list[Result]]:
    """With no other request in flight: hang up `wave_size` streams, check that vLLM aborts
    them all and drains to zero running requests; then `burst` concurrent requests."""
    _, tokens0 = _metrics(port)
    mk = lambda i: Client(port, model, args.max_model_len, vocab, random.Random(seed + i))
    wave = _concurrently(mk, ["disconnect-mid-stream"] * args.wave_size, "wave")
    t0 = time.time()
    busy, tokens = _metrics(port)
    while busy != 0 and time.time() - t0 < args.abort_timeout:
        time.sleep(0.5)
        busy, tokens = _metrics(port)
    full = args.wave_size * WAVE_MAX_TOKENS
    info = {
        "size": args.wave_size,
        "tokens": tokens - tokens0,
        "full": full,
        "left": busy,
        "drain_s": time.time() - t0,
        # drained, and at most half of the tokens the streams would have made unaborted
        # (not judged with --no-abort-token-check: a tiny model finishes its streams before
        # any disconnect reaches it, so its tokens say nothing about aborts)
        "ok": busy == 0 and (not args.abort_token_check or tokens - tokens0 <= full / 2),
    }
    rng = random.Random(seed)
    kinds = rng.choices(
        ["completion", "chat", "stream-completion", "stream-chat", "logprobs"], k=args.burst
    )
    burst = _concurrently(mk, kinds, "burst")
    info["burst"], info["burst_ok"] = len(burst), sum(ok(r) for r in burst)
    return info, wave + burst


def _vocab(model: str) -> int:
    try:
        return int(json.loads(Path(model, "config.json").read_text())["vocab_size"])
    except (OSError, ValueError, KeyError):
        return 1000


def _commit() -> str:
    def git(*a: str) -> str:
        return subprocess.run(["git", *a], cwd=REPO, capture_output=True, text=True).stdout.strip()

    head = git("rev-parse", "HEAD") or "unknown"
    dirty = git("status", "--porcelain", "--", "scripts", "vllm_mxplus")
    return head + (" (+ uncommitted changes in scripts/ or vllm_mxplus/)" if dirty else "")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", help="model dir (default: the SmolLM2 asset of `mxplus prepare`)")
    p.add_argument(
        "--quantization",
        default="mxfp4-mbs",
        help="vLLM --quantization (default mxfp4-mbs: quantized at load); 'none' for a "
        "checkpoint from `mxplus quantize`, detected with no flag",
    )
    p.add_argument("--duration", type=float, default=600.0, help="seconds of load (default 600)")
    p.add_argument("--clients", type=int, default=16, help="concurrent clients (default 16)")
    p.add_argument("--max-model-len", type=int, default=512)
    p.add_argument("--wave-every", type=float, default=60.0, help="seconds of load per wave")
    p.add_argument("--wave-size", type=int, default=16, help="streams hung up per wave")
    p.add_argument("--burst", type=int, default=64, help="concurrent requests after a wave")
    p.add_argument("--abort-timeout", type=float, default=60.0)
    p.add_argument(
        "--no-abort-token-check",
        dest="abort_token_check",
        action="store_false",
        help="judge a disconnect wave by draining to zero running requests only, not also by "
        "the tokens it generated (for a tiny model that finishes every stream before the "
        "disconnects reach it; the real-model soak keeps the check)",
    )
    p.add_argument(
        "--rss-growth-mib",
        type=float,
        default=256.0,
        help="allowed RSS growth from after warm-up to the end (default 256 MiB)",
    )
    p.add_argument("--startup-timeout", type=float, default=1800.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", help="report path (default eval/soak/soak-YYYYMMDD-HHMM.md)")
    p.add_argument("--server-log", help="where the server's output goes (default: temp dir)")
    args = p.parse_args(argv)

    import torch
    import vllm

    model = args.model
    if model is None:
        from vllm_mxplus.assets.smollm2 import smollm2_dir

        model = str(smollm2_dir())
        if not Path(model, "config.json").exists():
            p.error(f"--model not given and {model} does not exist: run `mxplus prepare`")
    out = Path(
        args.out
        or REPO / "eval" / "soak" / f"soak-{time.strftime('%Y%m%d-%H%M', time.gmtime())}.md"
    )
    port = free_port()
    server_cmd = serve_command(
        model, args.quantization, NAME, port, args.max_model_len, args.clients
    )
    env = {
        **os.environ,
        "VLLM_CPU_KVCACHE_SPACE": os.environ.get("VLLM_CPU_KVCACHE_SPACE", "1"),
        "HF_HUB_OFFLINE": "1",
        "HF_DATASETS_OFFLINE": "1",
    }
    # the server's own log stays out of the repository (it is large and machine-specific)
    log_path = Path(args.server_log or Path(tempfile.gettempdir()) / f"{out.stem}.server.log")
    out.parent.mkdir(parents=True, exist_ok=True)
    command = " ".join(
        [".venv/bin/python scripts/soak_server.py", *(argv if argv is not None else sys.argv[1:])]
    )
    meta = {
        "model_name": Path(model).name,
        "quantization": args.quantization,
        "command": command,
        "commit": _commit(),
        "machine": _machine(),
        "load_start": f"{os.getloadavg()[0]:.1f}",
        "vllm": vllm.__version__,
        "torch": torch.__version__,
        "server_cmd": " ".join(["vllm serve", model, *server_cmd[server_cmd.index(model) + 1 :]]),
        "clients": args.clients,
        "burst": args.burst,
        "rss_bound": args.rss_growth_mib,
        "abort_timeout": args.abort_timeout,
        "abort_token_check": args.abort_token_check,
    }
    # SIGTERM unwinds like Ctrl-C, so the `finally` below stops the server (its own session)
    signal.signal(signal.SIGTERM, lambda *_: (_ for _ in ()).throw(KeyboardInterrupt()))
    t_start = time.time()
    with open(log_path, "w") as log:
        proc = subprocess.Popen(
            server_cmd, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
        )
        try:
            return _soak(args, proc, port, model, out, log_path, meta, t_start)
        finally:
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
                try:
                    proc.wait(timeout=60)
                except subprocess.TimeoutExpired:
                    os.killpg(proc.pid, signal.SIGKILL)
                    proc.wait()


def _soak(args, proc, port, model, out, log_path, meta, t_start) -> int:
    deadline = time.time() + args.startup_timeout
    while _health(port) != 200:
        if proc.poll() is not None or time.time() > deadline:
            print(f"server did not start (exit {proc.poll()}); log: {log_path}", file=sys.stderr)
            return 2
        time.sleep(2)
    print(f"server ready in {time.time() - t_start:.0f} s", file=sys.stderr)
    vocab = _vocab(model)
    warm = Client(port, NAME, args.max_model_len, vocab, random.Random(-1))
    for kind in VALID:  # warm-up: every valid path once, before the RSS baseline
        warm.request(kind, "warm-up")
    rss: list[tuple[float, float]] = [(0.0, tree_rss_mib(proc.pid))]
    results: list[Result] = []
    waves: list[dict] = []
    lock = threading.Lock()
    t0 = time.time()
    stop = t0 + args.duration
    kinds, weights = list(WEIGHTS), list(WEIGHTS.values())
    phase_end = [min(stop, t0 + args.wave_every)]

    def worker(i: int) -> None:
        c = Client(port, NAME, args.max_model_len, vocab, random.Random(args.seed * 1000 + i))
        while time.time() < phase_end[0] and proc.poll() is None:
            r = c.request(c.rng.choices(kinds, weights)[0])
            with lock:
                results.append(r)

    n_wave = 0
    while time.time() < stop and proc.poll() is None:
        threads = [
            threading.Thread(target=worker, args=(i,), daemon=True) for i in range(args.clients)
        ]
        for t in threads:
            t.start()
        while any(t.is_alive() for t in threads):
            time.sleep(5)
            rss.append((time.time() - t0, tree_rss_mib(proc.pid)))
            print(
                f"soak: {time.time() - t0:.0f}/{args.duration:.0f} s, {len(results)} requests, "
                f"{sum(not ok(r) for r in results)} bad, RSS {rss[-1][1]:.0f} MiB",
                file=sys.stderr,
            )
        if proc.poll() is not None:
            break
        n_wave += 1
        info, rs = wave_and_burst(port, NAME, args, vocab, args.seed * 7919 + n_wave * 997)
        waves.append(info)
        results.extend(rs)
        print(f"soak: wave {n_wave}: {info}", file=sys.stderr)
        phase_end[0] = min(stop, time.time() + args.wave_every)
    health = _health(port)
    alive = proc.poll() is None
    rss.append((time.time() - t0, tree_rss_mib(proc.pid)))
    log_lines = checks.log_errors(Path(log_path).read_text(errors="replace"))
    growth = rss[-1][1] - rss[0][1]
    verdict = {
        "rss_start": rss[0][1],
        "rss_end": rss[-1][1],
        "rss_max": max(v for _, v in rss),
        "rss_growth": growth,
        "alive": alive,
        "health": health,
        "waves_ok": sum(w["ok"] for w in waves),
        "log_errors": log_lines,
    }
    verdict["pass"] = (
        alive
        and health == 200
        and all(ok(r) for r in results)
        and bool(waves)
        and verdict["waves_ok"] == len(waves)
        and not log_lines
        and growth <= args.rss_growth_mib
    )
    meta["load_end"] = f"{os.getloadavg()[0]:.1f}"
    meta["duration"] = time.time() - t0
    out.write_text(render(meta, results, waves, verdict))
    print(f"report: {out} ({'PASS' if verdict['pass'] else 'FAIL'})", file=sys.stderr)
    return 0 if verdict["pass"] else 1


def _machine() -> str:
    """The CPU as lscpu names it, its core count and the OS (lscpu's 'Model name')."""
    import platform

    name = "unknown CPU"
    try:
        out = subprocess.run(["lscpu"], capture_output=True, text=True, timeout=10).stdout
        for line in out.splitlines():
            if line.startswith("Model name:"):
                name = line.split(":", 1)[1].strip()
    except (OSError, subprocess.SubprocessError):
        pass
    return f"{name}, {os.cpu_count()} CPUs ({platform.machine()}, Linux {platform.release()})"


if __name__ == "__main__":
    sys.exit(main())
