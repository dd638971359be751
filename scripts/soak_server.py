"""Soak test of `vllm serve MODEL --quantization mxfp4-mbs` on loopback; writes a report.

    flock /tmp/mxplus-vllm.lock .venv/bin/python scripts/soak_server.py \\
        [--model DIR] [--duration 300] [--clients 16] [--out eval/results/soak-DATE.md]

Starts the server on 127.0.0.1 only, waits for /health, then runs `--clients` threads for
`--duration` seconds; each thread picks request kinds from a fixed, seeded mix: completions,
chat, streaming completions and chat, long prompts near max_model_len, malformed JSON, wrong
types, huge max_tokens, NaN / Inf sampling parameters, and clients that disconnect
mid-stream. The server's RSS (its whole process tree) is sampled every few seconds.

Pass criteria (exit 0, and PASS in the report): the server never exits; every valid request
is answered 200; malformed JSON and wrong types get a 4xx; huge max_tokens and NaN / Inf /
overflowing sampling parameters get a 200 or a 4xx (never a 5xx or a dropped connection); /health
answers 200 at the end; RSS growth from the first sample after warm-up to the end stays
within `--rss-growth-mib`. The report (markdown) goes to `--out`.
"""

from __future__ import annotations

import argparse
import http.client
import json
import math
import os
import platform
import random
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter, defaultdict
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
NAME = "soak-mxfp4-mbs"
VALID = ("completion", "chat", "stream-completion", "stream-chat", "long-prompt")
INVALID = ("malformed-json", "wrong-types")  # must be refused with a 4xx
EDGE = ("huge-max-tokens", "nan-params")  # answered (200) or refused (4xx), never a 5xx
KINDS = VALID + INVALID + EDGE + ("disconnect-mid-stream",)
WEIGHTS = {
    "completion": 4,
    "chat": 3,
    "stream-completion": 3,
    "stream-chat": 2,
    "long-prompt": 1,
    "malformed-json": 1,
    "wrong-types": 1,
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


@dataclass
class Result:
    kind: str
    status: int  # HTTP status; 0 = connection error; -1 = client hung up on purpose
    seconds: float
    detail: str = ""


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
        *("--quantization", quantization),
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


class Client:
    """One HTTP client thread's requests (http.client: control over streams and hang-ups)."""

    def __init__(self, port: int, model: str, max_model_len: int, rng: random.Random):
        self.port, self.model, self.max_len, self.rng = port, model, max_model_len, rng

    def _conn(self) -> http.client.HTTPConnection:
        return http.client.HTTPConnection("127.0.0.1", self.port, timeout=300)

    def _post(
        self, path: str, body: bytes, stream: bool = False, hang_up_after: int = 0
    ) -> tuple[int, str]:
        conn = self._conn()
        try:
            conn.request("POST", path, body=body, headers={"Content-Type": "application/json"})
            r = conn.getresponse()
            if stream and r.status == 200:
                chunks = 0
                for line in r:
                    if line.startswith(b"data:"):
                        chunks += 1
                        if hang_up_after and chunks >= hang_up_after:
                            conn.sock.shutdown(socket.SHUT_RDWR)  # vanish mid-stream
                            return -1, f"hung up after {chunks} chunks"
                        if line.strip() == b"data: [DONE]":
                            break
                return r.status, f"{chunks} chunks"
            text = r.read().decode(errors="replace")
            return r.status, text[:200]
        finally:
            conn.close()

    def _words(self, n: int) -> str:
        return " ".join(self.rng.choice(WORDS) for _ in range(n))

    def request(self, kind: str) -> Result:
        t0 = time.perf_counter()
        m, rng = self.model, self.rng
        comp, chat = "/v1/completions", "/v1/chat/completions"
        msgs = [{"role": "user", "content": self._words(rng.randint(3, 30))}]
        try:
            if kind == "completion":
                status, d = self._post(
                    comp,
                    json.dumps(
                        {
                            "model": m,
                            "prompt": self._words(rng.randint(3, 40)),
                            "max_tokens": rng.randint(1, 48),
                            "temperature": rng.choice([0.0, 0.7]),
                        }
                    ).encode(),
                )
            elif kind == "chat":
                status, d = self._post(
                    chat,
                    json.dumps(
                        {"model": m, "messages": msgs, "max_tokens": rng.randint(1, 48)}
                    ).encode(),
                )
            elif kind == "stream-completion":
                status, d = self._post(
                    comp,
                    json.dumps(
                        {"model": m, "prompt": self._words(20), "max_tokens": 32, "stream": True}
                    ).encode(),
                    stream=True,
                )
            elif kind == "stream-chat":
                status, d = self._post(
                    chat,
                    json.dumps(
                        {"model": m, "messages": msgs, "max_tokens": 32, "stream": True}
                    ).encode(),
                    stream=True,
                )
            elif kind == "long-prompt":  # token ids: exact length, just below the limit
                n = self.max_len - 24
                status, d = self._post(
                    comp,
                    json.dumps(
                        {
                            "model": m,
                            "prompt": [rng.randint(100, 20000) for _ in range(n)],
                            "max_tokens": 16,
                        }
                    ).encode(),
                )
            elif kind == "malformed-json":
                status, d = self._post(comp, b'{"model": "' + m.encode() + b'", "prompt": "x",')
            elif kind == "wrong-types":
                body = rng.choice(
                    [
                        {"model": m, "prompt": "hello", "max_tokens": "many"},
                        {"model": m, "prompt": "hello", "temperature": "hot"},
                        {"model": m, "messages": "not a list"},
                        {"model": m, "prompt": {"a": 1}},
                    ]
                )
                path = chat if "messages" in body else comp
                status, d = self._post(path, json.dumps(body).encode())
            elif kind == "huge-max-tokens":
                status, d = self._post(
                    comp, json.dumps({"model": m, "prompt": "hello", "max_tokens": 10**12}).encode()
                )
            elif kind == "nan-params":  # Python's json writes NaN / Infinity literals;
                # a temperature of 1e-30 overflows logits / T to inf in the sampler
                body = rng.choice(
                    [
                        {"model": m, "prompt": "hello", "max_tokens": 4, "temperature": 1e-30},
                        {
                            "model": m,
                            "prompt": "hello",
                            "max_tokens": 4,
                            "temperature": float("nan"),
                        },
                        {"model": m, "prompt": "hello", "max_tokens": 4, "top_p": float("inf")},
                        {
                            "model": m,
                            "prompt": "hello",
                            "max_tokens": 4,
                            "presence_penalty": float("-inf"),
                        },
                    ]
                )
                status, d = self._post(comp, json.dumps(body).encode())
            elif kind == "disconnect-mid-stream":
                status, d = self._post(
                    comp,
                    json.dumps(
                        {
                            "model": m,
                            "prompt": self._words(10),
                            "max_tokens": 200,
                            "ignore_eos": True,
                            "stream": True,
                        }
                    ).encode(),
                    stream=True,
                    hang_up_after=3,
                )
            else:
                raise ValueError(kind)
        except (OSError, http.client.HTTPException) as e:
            status, d = 0, f"{type(e).__name__}: {e}"
        return Result(kind, status, time.perf_counter() - t0, d)


def ok(r: Result) -> bool:
    """What the pass criteria accept for one request."""
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


def render(meta: dict, results: list[Result], rss: list[tuple[float, float]], verdict: dict) -> str:
    by_kind: dict[str, list[Result]] = defaultdict(list)
    for r in results:
        by_kind[r.kind].append(r)
    title = (
        f"# Soak test: `vllm serve` {meta['model_name']} `--quantization {meta['quantization']}`"
    )
    machine = (
        f"Machine: {meta['machine']}; load average at start {meta['load_start']}, at "
        f"end {meta['load_end']}. vLLM {meta['vllm']}, torch {meta['torch']}."
    )
    summary = (
        f"Duration {meta['duration']:.0f} s, {meta['clients']} concurrent clients, "
        f"{len(results)} requests answered or refused, "
        f"{sum(not ok(r) for r in results)} outside the pass criteria."
    )
    lines = [
        title,
        "",
        f"Command: `{meta['command']}`",
        "",
        machine,
        "",
        f"Server: `{meta['server_cmd']}` (loopback only).",
        "",
        summary,
        "",
        "| kind | requests | status codes | p50 s | p99 s | accepted |",
        "|---|---|---|---|---|---|",
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
            f"{percentile(lat, 50):.3f} | {percentile(lat, 99):.3f} | "
            f"{sum(ok(r) for r in rs)}/{len(rs)} |"
        )
    valid = [r.seconds for r in results if r.kind in VALID and r.status == 200]
    if valid:
        lines += [
            "",
            (
                f"Latency of the answered valid requests: p50 "
                f"{percentile(valid, 50):.3f} s, p99 {percentile(valid, 99):.3f} s."
            ),
        ]
    rss_line = (
        f"Server RSS (process tree): start {verdict['rss_start']:.0f} MiB (after "
        f"warm-up), end {verdict['rss_end']:.0f} MiB, max {verdict['rss_max']:.0f} "
        f"MiB; growth {verdict['rss_growth']:+.0f} MiB, bound "
        f"{meta['rss_bound']:.0f} MiB."
    )
    alive_line = (
        f"Server process alive at the end: {verdict['alive']}; /health at the end: "
        f"{verdict['health']}; crashes: {verdict['crashes']}."
    )
    lines += ["", rss_line, alive_line, "", f"Verdict: **{'PASS' if verdict['pass'] else 'FAIL'}**"]
    bad = [r for r in results if not ok(r)][:10]
    if bad:
        lines += ["", "First requests outside the criteria:", ""]
        lines += [f"- {r.kind}: status {r.status}, {r.detail[:160]!r}" for r in bad]
    return "\n".join(lines) + "\n"


def _health(port: int) -> int:
    try:
        c = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
        c.request("GET", "/health")
        s = c.getresponse().status
        c.close()
        return s
    except OSError:
        return 0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", help="model dir (default: the SmolLM2 asset of `mxplus prepare`)")
    p.add_argument("--quantization", default="mxfp4-mbs")
    p.add_argument("--duration", type=float, default=300.0, help="seconds of load (default 300)")
    p.add_argument("--clients", type=int, default=16, help="concurrent clients (default 16)")
    p.add_argument("--max-model-len", type=int, default=512)
    p.add_argument(
        "--rss-growth-mib",
        type=float,
        default=256.0,
        help="allowed RSS growth from after warm-up to the end (default 256 MiB)",
    )
    p.add_argument("--startup-timeout", type=float, default=600.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", help="report path (default eval/results/soak-YYYYMMDD-HHMM.md)")
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
        or REPO / "eval" / "results" / f"soak-{time.strftime('%Y%m%d-%H%M', time.gmtime())}.md"
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
    load_start = f"{os.getloadavg()[0]:.1f}"
    t_start = time.time()
    with open(log_path, "w") as log:
        proc = subprocess.Popen(
            server_cmd, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
        )
        try:
            return _soak(
                args,
                proc,
                port,
                model,
                out,
                log_path,
                server_cmd,
                load_start,
                t_start,
                torch.__version__,
                vllm.__version__,
            )
        finally:
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
                try:
                    proc.wait(timeout=60)
                except subprocess.TimeoutExpired:
                    os.killpg(proc.pid, signal.SIGKILL)
                    proc.wait()


def _soak(
    args, proc, port, model, out, log_path, server_cmd, load_start, t_start, torch_v, vllm_v
) -> int:
    from tqdm.auto import tqdm

    deadline = time.time() + args.startup_timeout
    while _health(port) != 200:
        if proc.poll() is not None or time.time() > deadline:
            print(f"server did not start (exit {proc.poll()}); log: {log_path}", file=sys.stderr)
            return 2
        time.sleep(2)
    print(f"server ready in {time.time() - t_start:.0f} s", file=sys.stderr)
    warm = Client(port, NAME, args.max_model_len, random.Random(-1))
    for kind in VALID:  # warm-up: every valid path once, before the RSS baseline
        warm.request(kind)
    rss: list[tuple[float, float]] = [(0.0, tree_rss_mib(proc.pid))]
    results: list[Result] = []
    lock = threading.Lock()
    stop = time.time() + args.duration
    kinds, weights = list(WEIGHTS), list(WEIGHTS.values())

    def worker(i: int) -> None:
        c = Client(port, NAME, args.max_model_len, random.Random(args.seed * 1000 + i))
        while time.time() < stop and proc.poll() is None:
            r = c.request(c.rng.choices(kinds, weights)[0])
            with lock:
                results.append(r)

    threads = [threading.Thread(target=worker, args=(i,), daemon=True) for i in range(args.clients)]
    t0 = time.time()
    for t in threads:
        t.start()
    with tqdm(total=int(args.duration), desc="soak", unit="s") as bar:
        while any(t.is_alive() for t in threads):
            time.sleep(5)
            rss.append((time.time() - t0, tree_rss_mib(proc.pid)))
            bar.n = min(int(time.time() - t0), int(args.duration))
            bar.set_postfix(requests=len(results), rss_mib=f"{rss[-1][1]:.0f}")
            bar.refresh()
    for t in threads:
        t.join()
    health = _health(port)
    alive = proc.poll() is None
    rss.append((time.time() - t0, tree_rss_mib(proc.pid)))
    growth = rss[-1][1] - rss[0][1]
    verdict = {
        "rss_start": rss[0][1],
        "rss_end": rss[-1][1],
        "rss_max": max(v for _, v in rss),
        "rss_growth": growth,
        "alive": alive,
        "health": health,
        "crashes": 0 if alive else 1,
    }
    verdict["pass"] = (
        alive and health == 200 and all(ok(r) for r in results) and growth <= args.rss_growth_mib
    )
    meta = {
        "model_name": Path(model).name,
        "quantization": args.quantization,
        "command": f"flock /tmp/mxplus-vllm.lock .venv/bin/python scripts/soak_server.py "
        f"--duration {args.duration:g} --clients {args.clients}",
        "machine": f"{platform.machine()} {os.cpu_count()} cores ({_cpu_name()})",
        "load_start": load_start,
        "load_end": f"{os.getloadavg()[0]:.1f}",
        "vllm": vllm_v,
        "torch": torch_v,
        "server_cmd": " ".join(
            ["vllm serve", Path(model).name, *server_cmd[server_cmd.index(model) + 1 :]]
        ),
        "duration": time.time() - t0,
        "clients": args.clients,
        "rss_bound": args.rss_growth_mib,
    }
    out.write_text(render(meta, results, rss, verdict))
    print(f"report: {out}", file=sys.stderr)
    return 0 if verdict["pass"] else 1


def _cpu_name() -> str:
    from vllm_mxplus.platform_amx import cpu_model_name

    return cpu_model_name(platform.processor() or "unknown CPU")


if __name__ == "__main__":
    sys.exit(main())
