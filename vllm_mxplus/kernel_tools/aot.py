"""Compile every Triton kernel configuration the launchers can launch to real GPU machine code,
without a GPU, and check it: `mxplus kernels --aot [--targets 80,90,100] [--quick]
[--kernel decode_gemm]`.

The configurations are not a hand list. The launchers (`aot_drivers.DRIVERS`: `act_quant`,
`act_quant_fp8_chunks`, `weight_fp8_chunks`, `decode_gemm`, ...) are driven over their input
domain (formats x dtypes x row counts x K x macro blocks x bias x split-K) on meta tensors inside `triton_utils.capture_launches()`, which
records each launch with the GPU's tile choices instead of running it (sm_80's, sm_90's and
sm_100's, `CAPTURE_CAPABILITIES`). Each distinct (kernel, argument types, constexprs,
divisibility) is then compiled by Triton's own compiler for a `GPUTarget("cuda", cc, 32)` of
every target whose generation launches it (`capture_for`), and the bundled `ptxas -v` reports registers and spills of
its PTX; Triton's metadata gives the shared memory. A compile failure, any spill, shared
memory over the target's per-block limit, or inline assembly packing elements that the
compiled layout does not keep consecutive (`asm_packs`) is a failure (exit code 1).

Compiles run in worker processes with a private Triton cache (a temporary directory, removed
afterwards) and without TRITON_INTERPRET, so nothing leaks into the user's ~/.triton cache.
"""

from __future__ import annotations

import concurrent.futures as cf
import inspect
import multiprocessing
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from vllm_mxplus.kernel_tools.aot_drivers import DRIVERS, min_target
from vllm_mxplus.kernel_tools.asm_packs import packed_asm_problems

#: sm -> max dynamic shared memory per block (bytes), from the CUDA programming guide.
SMEM_LIMIT = {80: 166912, 86: 101376, 89: 101376, 90: 232448, 100: 232448, 120: 101376}
_DTYPE = {
    torch.uint8: "u8",
    torch.int8: "i8",
    torch.int16: "i16",
    torch.int32: "i32",
    torch.int64: "i64",
    torch.float16: "fp16",
    torch.bfloat16: "bf16",
    torch.float32: "fp32",
    torch.bool: "i1",
    torch.float8_e4m3fn: "fp8e4nv",
}
_LAUNCH_OPTIONS = ("num_warps", "num_stages", "num_ctas", "launch_pdl")


@dataclass(frozen=True)
class KernelConfig:
    """One compilable configuration: picklable, hashable (the dedup key)."""

    module: str
    kernel: str
    signature: tuple[tuple[str, str], ...]  # (param, type) in order; "constexpr" for those
    constexprs: tuple[tuple[str, Any], ...]  # tl.dtype values as ("tl.dtype", "bf16")
    divisible: tuple[int, ...]  # param indices divisible by 16 (tt.divisibility)
    options: tuple[tuple[str, int], ...]  # num_warps / num_stages when the launcher sets them

    def label(self) -> str:
        shown = [f"{k}={v[1] if isinstance(v, tuple) else v}" for k, v in self.constexprs]
        ptrs = [t for _, t in self.signature if t.startswith("*")]
        return f"{','.join(shown)} [{ptrs[0] if ptrs else ''}]"


@dataclass
class CompileResult:
    config: KernelConfig
    target: int
    regs: int = 0
    spill_bytes: int = 0
    smem: int = 0
    error: str = ""
    seconds: float = 0.0

    @property
    def failed(self) -> bool:
        return bool(self.error) or self.spill_bytes > 0 or self.smem > SMEM_LIMIT[self.target]


# ----------------------------------------------------------------------------- enumeration
def _type_of(value: Any) -> str:
    if isinstance(value, torch.Tensor):
        return "*" + _DTYPE[value.dtype]
    if isinstance(value, bool):
        return "i1"
    if isinstance(value, int):
        return "i32" if -(2**31) <= value < 2**31 else "i64"
    if isinstance(value, float):
        return "fp32"
    raise TypeError(f"aot: cannot type kernel argument {value!r}")


def _constexpr_value(value: Any) -> Any:
    from vllm_mxplus.backends.triton.launch import tl

    if isinstance(value, tl.dtype):
        return ("tl.dtype", str(value))
    return value


def config_of(launch: Any) -> KernelConfig:
    """The KernelConfig of one recorded launch (triton_utils.Launch)."""
    fn = getattr(launch.kernel, "fn", launch.kernel)
    names = list(inspect.signature(fn).parameters)
    kwargs = dict(launch.kwargs)
    options = tuple(sorted((k, kwargs.pop(k)) for k in _LAUNCH_OPTIONS if k in kwargs))
    positional = dict(zip(names, launch.args))
    signature, constexprs, divisible = [], [], []
    for i, name in enumerate(names):
        if name in kwargs:
            signature.append((name, "constexpr"))
            constexprs.append((name, _constexpr_value(kwargs[name])))
            continue
        value = positional[name]
        signature.append((name, _type_of(value)))
        # Triton specializes pointers (16-byte aligned allocations) and ints % 16 == 0.
        if isinstance(value, torch.Tensor) or (
            isinstance(value, int) and not isinstance(value, bool) and value % 16 == 0
        ):
            divisible.append(i)
    return KernelConfig(
        fn.__module__, fn.__name__, tuple(signature), tuple(constexprs), tuple(divisible), options
    )


def parse_kernels(text: str | None) -> list[str] | None:
    """'decode_gemm,act_quant' -> those launchers (DRIVERS keys); None or '' -> None (all)."""
    wanted = [t for t in (text or "").replace(" ", "").split(",") if t]
    bad = [w for w in wanted if w not in DRIVERS]
    if bad:
        raise ValueError(f"--kernel: unknown {bad}; choose from {', '.join(DRIVERS)}")
    return wanted or None


def parse_macro_blocks(text: str | None) -> list[int] | None:
    """'32,64' -> [32, 64]; None or '' -> None (no filter)."""
    try:
        wanted = [int(t) for t in (text or "").replace(" ", "").split(",") if t]
    except ValueError:
        raise ValueError(f"--macro-block: expected sizes like 32,64, got {text!r}")  # noqa: B904
    return wanted or None


def select_macro_blocks(
    per_launcher: dict[str, list[KernelConfig]], macro_blocks: list[int]
) -> dict[str, list[KernelConfig]]:
    """Only the MBS configurations (HAS_MBS, X_MBS or W_MBS) whose MACRO is in macro_blocks;
    launchers left with none are dropped."""

    def keep(c: KernelConfig) -> bool:
        d = dict(c.constexprs)
        mbs = d.get("HAS_MBS") or d.get("X_MBS") or d.get("W_MBS")
        return bool(mbs) and d.get("MACRO") in macro_blocks

    out = {name: [c for c in cs if keep(c)] for name, cs in per_launcher.items()}
    return {name: cs for name, cs in out.items() if cs}


SPLIT_K_SUM_KEY = "split_k_sum"  # enumerate_configs' key of the split-K sum's configurations


# the GPUs whose tile choices are enumerated: sm_80's (mma.sync only: 32-row decode tiles at
# most, no FP8 or FP4 pipeline), sm_90's and sm_100's (the decode GEMM's weight as the B
# operand, `decode_gemm.weight_is_a`, tcgen05's tiles). A target compiles the choices of its
# generation's capture (`capture_for`)
CAPTURE_CAPABILITIES = (80, 90, 100)


def capture_for(target: int) -> int:
    """The capture capability whose tile choices sm_<target> launches: the newest of
    CAPTURE_CAPABILITIES at or below it (sm_86 / sm_89: sm_80's)."""
    return max((c for c in CAPTURE_CAPABILITIES if c <= target), default=CAPTURE_CAPABILITIES[0])


Captures = dict[KernelConfig, frozenset[int]]  # configuration -> the capabilities that launched it


def enumerate_captures(
    quick: bool = False, launchers: list[str] | None = None
) -> dict[str, Captures]:
    """{launcher: {distinct configuration: the CAPTURE_CAPABILITIES whose launches used it}},
    from driving each launcher (all, or `launchers`) in capture mode, in launch order. The
    split-K sum that a split GEMM launches after itself goes under its own key,
    SPLIT_K_SUM_KEY (one entry for every launcher that split)."""
    from vllm_mxplus.backends.triton.launch import HAS_TRITON, capture_launches, is_split_k_sum

    if not HAS_TRITON:
        raise RuntimeError("mxplus kernels --aot needs triton installed")
    out: dict[str, Captures] = {}
    for name, drive in DRIVERS.items():
        if launchers is not None and name not in launchers:
            continue
        launches = []
        for capability in CAPTURE_CAPABILITIES:
            with capture_launches(capability) as got:
                drive(quick)
            launches += [(capability, la) for la in got]
        if not launches:
            raise RuntimeError(f"aot: driving {name} recorded no launch")
        for cap, la in launches:
            key = SPLIT_K_SUM_KEY if is_split_k_sum(la) else name
            caps = out.setdefault(key, {})
            cfg = config_of(la)
            caps[cfg] = caps.get(cfg, frozenset()) | {cap}
    return out


def enumerate_configs(
    quick: bool = False, launchers: list[str] | None = None
) -> dict[str, list[KernelConfig]]:
    """{launcher: distinct configurations}, the union over CAPTURE_CAPABILITIES
    (`enumerate_captures`)."""
    return {name: list(caps) for name, caps in enumerate_captures(quick, launchers).items()}


# ----------------------------------------------------------------------------- compilation
# What Triton's make_cubin passes to ptxas besides -v and the target (Triton 3.6 / 3.7:
# "--regAllocOptLevel=2 to work around a ptxas 13.x bug"); without it the allocation, and the
# spills, differ from the binary that runs
TRITON_PTXAS_FLAGS = ("--regAllocOptLevel=2",)


def _ptxas_path(target: int) -> str:
    from triton.backends.nvidia import compiler as nv

    try:
        tool = nv.get_ptxas(target)
    except TypeError:  # older Triton: get_ptxas() takes no arch
        tool = nv.get_ptxas()
    return tool.path


def _ptxas_stats(ptx: str, target: int, workdir: str) -> tuple[int, int]:
    """(registers, spill bytes) of the PTX's kernel, from `ptxas -v` (with Triton's own
    register-allocation flag, so the count is that of the binary Triton builds)."""
    suffix = "a" if target >= 90 else ""
    path = os.path.join(workdir, f"k{os.getpid()}_{time.monotonic_ns()}.ptx")
    with open(path, "w") as f:
        f.write(ptx)
    try:
        proc = subprocess.run(
            [
                _ptxas_path(target),
                "-v",
                *TRITON_PTXAS_FLAGS,
                f"--gpu-name=sm_{target}{suffix}",
                path,
                "-o",
                os.devnull,
            ],  # fmt: skip
            capture_output=True,
            text=True,
            timeout=300,
        )
    finally:
        os.unlink(path)
    if proc.returncode:
        raise RuntimeError(f"ptxas failed: {proc.stderr.strip()[-400:]}")
    regs = re.findall(r"Used (\d+) registers", proc.stderr)
    spills = [
        int(a) + int(b)
        for a, b in re.findall(r"(\d+) bytes spill stores, (\d+) bytes spill loads", proc.stderr)
    ]
    if not regs:
        raise RuntimeError(f"no register count in ptxas output: {proc.stderr.strip()[-400:]}")
    return max(map(int, regs)), max(spills, default=0)


def as_launched(config: KernelConfig, target: int) -> tuple[dict[str, Any], dict[str, Any]]:
    """(constexprs, options) of a configuration as the launchers launch it on sm_<target>:
    no griddepcontrol below sm_90, no E2M1 conversion below sm_100."""
    from vllm_mxplus.backends.triton.launch import ARCH_CONSTEXPRS, PDL_MIN_CAPABILITY

    constexprs = dict(config.constexprs)
    options = dict(config.options)
    constexprs.update({k: False for k, cap in ARCH_CONSTEXPRS.items()
                       if k in constexprs and target < cap})  # fmt: skip
    if target < PDL_MIN_CAPABILITY:
        options.pop("launch_pdl", None)
    return constexprs, options


def distinct_work(
    configs: list[KernelConfig], targets: list[int], captured: Captures | None = None
) -> list[tuple[KernelConfig, int]]:
    """(config, target) pairs to compile: each target the configuration's kernel runs on
    (`min_target`) and, with `captured` (`enumerate_captures`), whose generation launches it
    (`capture_for`); a configuration once per target as launched there (`as_launched`): one
    with PDL or the E2M1 conversion on is the one without it below their generation."""
    seen: set[tuple] = set()
    work = []
    for t in targets:
        for c in configs:
            if t < min_target(c) or (captured is not None and capture_for(t) not in captured[c]):
                continue
            cx, opts = as_launched(c, t)
            key = (t, c.module, c.kernel, c.signature, c.divisible,
                   tuple(sorted(cx.items(), key=lambda kv: kv[0])), tuple(sorted(opts.items())))  # fmt: skip
            if key not in seen:
                seen.add(key)
                work.append((c, t))
    return work


def compile_kernel(config: KernelConfig, target: int) -> Any:
    """Triton's compiled kernel (PTX, cubin, metadata) of one configuration for sm_<target>."""
    import importlib

    import triton
    import triton.language as tl
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    kernel = getattr(importlib.import_module(config.module), config.kernel)
    launched, options = as_launched(config, target)
    constexprs = {
        k: tl.dtype(v[1]) if isinstance(v, tuple) and v[:1] == ("tl.dtype",) else v
        for k, v in launched.items()
    }
    attrs = {(i,): [["tt.divisibility", 16]] for i in config.divisible}
    src = ASTSource(kernel, dict(config.signature), constexprs, attrs)
    return triton.compile(src, target=GPUTarget("cuda", target, 32), options=options)


def compile_config(config: KernelConfig, target: int) -> CompileResult:
    """Compile one configuration for sm_<target> (runs in a worker process)."""
    res = CompileResult(config, target)
    t0 = time.time()
    try:
        ck = compile_kernel(config, target)
        packs = packed_asm_problems(ck.asm["ttgir"])
        if packs:
            raise RuntimeError("; ".join(packs))
        res.smem = int(getattr(ck.metadata, "shared", 0))
        res.regs, res.spill_bytes = _ptxas_stats(
            ck.asm["ptx"], target, os.environ["TRITON_CACHE_DIR"]
        )
    except Exception as e:  # reported per config; the run fails at the end
        res.error = f"{type(e).__name__}: {str(e).strip().splitlines()[-1][:300] if str(e) else ''}"
    res.seconds = time.time() - t0
    return res


def _init_worker(cache_dir: str) -> None:
    os.environ["TRITON_CACHE_DIR"] = cache_dir
    os.environ.pop("TRITON_INTERPRET", None)


def compile_all(
    configs: list[KernelConfig],
    targets: list[int],
    jobs: int,
    progress: bool = True,
    captured: Captures | None = None,
) -> list[CompileResult]:
    """Compile configs x targets (`distinct_work`) in `jobs` spawned workers with a private
    Triton cache."""
    cache_dir = tempfile.mkdtemp(prefix="mxplus-aot-triton-")
    env_interp = os.environ.pop("TRITON_INTERPRET", None)  # spawned workers inherit os.environ
    work = distinct_work(configs, targets, captured)
    results: list[CompileResult] = []
    try:
        ctx = multiprocessing.get_context("spawn")
        with cf.ProcessPoolExecutor(
            max_workers=jobs, mp_context=ctx, initializer=_init_worker, initargs=(cache_dir,)
        ) as pool:
            futures = [pool.submit(compile_config, c, t) for c, t in work]
            bar = _progress(len(futures)) if progress else None
            for fut in cf.as_completed(futures):
                results.append(fut.result())
                if bar is not None:
                    bar.update(1)
            if bar is not None:
                bar.close()
    finally:
        if env_interp is not None:
            os.environ["TRITON_INTERPRET"] = env_interp
        shutil.rmtree(cache_dir, ignore_errors=True)
    return results


def _progress(total: int):
    try:
        from tqdm import tqdm
    except ImportError:
        return None
    return tqdm(total=total, desc="aot compile", unit="cfg", disable=not sys.stderr.isatty())


# ----------------------------------------------------------------------------- report
def summarize(results: list[CompileResult]) -> list[str]:
    """One line per (kernel, target): configs, register range, max spill, max smem, failures."""
    groups: dict[tuple[str, int], list[CompileResult]] = defaultdict(list)
    for r in results:
        groups[(r.config.kernel, r.target)].append(r)
    lines = [
        f"{'kernel':26s} {'sm':>4s} {'configs':>7s} {'regs':>9s} {'spill B':>7s} "
        f"{'smem B':>7s} {'limit':>7s} {'fail':>4s}"
    ]
    for (kernel, target), rs in sorted(groups.items()):
        ok = [r for r in rs if not r.error]
        regs = f"{min(r.regs for r in ok)}-{max(r.regs for r in ok)}" if ok else "-"
        lines.append(
            f"{kernel:26s} {target:>4d} {len(rs):>7d} {regs:>9s} "
            f"{max((r.spill_bytes for r in ok), default=0):>7d} "
            f"{max((r.smem for r in ok), default=0):>7d} {SMEM_LIMIT[target]:>7d} "
            f"{sum(r.failed for r in rs):>4d}"
        )
    return lines


def per_config(results: list[CompileResult]) -> list[str]:
    """One line per compile: target, kernel, constexprs and pointer type, registers, spill."""
    return [
        f"sm_{r.target:<3d} {r.config.kernel} {r.config.label()}: "
        + (r.error or f"{r.regs} registers, {r.spill_bytes} B spilled, smem {r.smem} B")
        for r in sorted(results, key=lambda r: (r.config.kernel, r.config.label(), r.target))
    ]


def failures(results: list[CompileResult]) -> list[str]:
    out = []
    for r in results:
        if not r.failed:
            continue
        why = r.error or (
            f"{r.spill_bytes} bytes spilled ({r.regs} registers)"
            if r.spill_bytes
            else f"shared memory {r.smem} > {SMEM_LIMIT[r.target]}"
        )
        out.append(f"sm_{r.target} {r.config.kernel} {r.config.label()}: {why}")
    return out


def parse_targets(text: str) -> list[int]:
    """'80,90,100' -> [80, 90, 100]; a clear error for anything else."""
    try:
        targets = [int(t) for t in text.replace(" ", "").split(",") if t]
    except ValueError:
        raise ValueError(f"--targets: expected compute capabilities like 80,90,100, got {text!r}")  # noqa: B904
    bad = [t for t in targets if t not in SMEM_LIMIT]
    if bad or not targets:
        raise ValueError(
            f"--targets: unsupported {bad or text!r}; choose from {sorted(SMEM_LIMIT)}"
        )
    return targets


def run_aot(
    targets: list[int],
    quick: bool,
    jobs: int,
    print_fn: Callable[[str], None] = print,
    progress: bool = True,
    launchers: list[str] | None = None,
    macro_blocks: list[int] | None = None,
) -> int:
    """The `--aot` command: enumerate (every launcher, or `launchers`; only the MBS
    configurations of `macro_blocks` when given, each then printed on its own line),
    compile, print the table; 0 when everything passes."""
    t0 = time.time()
    captures = enumerate_captures(quick, launchers)
    per_launcher = {name: list(caps) for name, caps in captures.items()}
    captured: Captures = {}
    for caps in captures.values():
        for cfg, got in caps.items():
            captured[cfg] = captured.get(cfg, frozenset()) | got
    if macro_blocks:
        per_launcher = select_macro_blocks(per_launcher, macro_blocks)
        if not per_launcher:
            raise RuntimeError(f"aot: no MBS configuration with macro block in {macro_blocks}")
    configs = [c for cs in per_launcher.values() for c in cs]
    counts = ", ".join(f"{k}: {len(v)}" for k, v in per_launcher.items())
    print_fn(
        f"aot: {len(configs)} configurations ({counts}) x targets {targets}, each for the "
        f"targets whose generation launches it{' (quick subset)' if quick else ''}, {jobs} jobs"
    )
    results = compile_all(configs, targets, jobs, progress, captured)
    if macro_blocks:
        for line in per_config(results):
            print_fn(line)
    for line in summarize(results):
        print_fn(line)
    bad = failures(results)
    for line in bad[:50]:
        print_fn("FAIL " + line)
    if len(bad) > 50:
        print_fn(f"... and {len(bad) - 50} more failures")
    print_fn(f"aot: {len(results)} compiles, {len(bad)} failed, {time.time() - t0:.0f} s")
    return 1 if bad else 0
