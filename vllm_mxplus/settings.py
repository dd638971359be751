"""Every environment variable of the project (`VLLM_MXPLUS_*`, `MXPLUS_CACHE`), in one place,
read when used (never at import). Variables of the tools the project drives (`CXX`,
`CUDA_HOME`, `CUTLASS_DIR`, `TORCH_CUDA_ARCH_LIST`, `TRITON_*`, the Hugging Face hub's
`HF_*_OFFLINE`) keep their own meaning and are read where that tool is invoked.

The README's "Settings" table is `python -m vllm_mxplus.settings` (and a test checks that the
two agree). Each accessor reads the environment at the moment it is called, so a variable set
after import (by a test, or by vLLM in a worker process) takes effect, and a bad value fails
with a message naming the variable and what it accepts.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class Setting:
    name: str
    default: str  # as written in the environment; "" = unset
    help: str

    def raw(self) -> str:
        return os.environ.get(self.name, "").strip()

    def value(self) -> str:
        return self.raw() or self.default


BACKEND = Setting(
    "VLLM_MXPLUS_BACKEND",
    "",
    "Force a backend by name (`cpu-packed`, `triton-decode`, `reference`, ...) or allow only a "
    "comma list of them (in priority order; `reference` only if named). `linear:NAME` / "
    "`experts:NAME` apply a name to one layer kind. A layer the allowed backends cannot "
    "serve fails to load with the reason.",
)
SELFTEST = Setting(
    "VLLM_MXPLUS_SELFTEST",
    "1",
    "`0` skips the first-use self-test of kernel backends against `vllm_mxplus.formats`.",
)
CPU_KERNELS = Setting(
    "VLLM_MXPLUS_CPU_KERNELS", "1", "`0` disables the C++ CPU kernels (the reference serves)."
)
CPU_MARCH = Setting(
    "VLLM_MXPLUS_CPU_MARCH",
    "native",
    "`-march` for the CPU kernel build (e.g. `x86-64-v3` to build for another machine).",
)
CPU_BUILD_DIR = Setting(
    "VLLM_MXPLUS_CPU_BUILD_DIR",
    "",
    "Cache directory of the CPU kernel builds (default `~/.cache/vllm-mxplus/cpu_kernels`).",
)
CUTLASS_EXT = Setting(
    "VLLM_MXPLUS_CUTLASS_EXT", "", "Path of a built `mxplus_cutlass*.so` to load."
)
CUTLASS_BUILD_DIR = Setting(
    "VLLM_MXPLUS_CUTLASS_BUILD_DIR",
    "",
    "Cache directory of the CUTLASS builds (default `~/.cache/vllm-mxplus/cutlass`).",
)
PREFILL_MIN_M = Setting(
    "VLLM_MXPLUS_PREFILL_MIN_M",
    "129",
    "Smallest token count M served by the CUTLASS prefill GEMM (the decode kernels below it, "
    "up to 128: their batched row tiles are estimated faster there).",
)
FP8_WEIGHT_HELD = Setting(
    "VLLM_MXPLUS_FP8_WEIGHT_HELD",
    "0",
    "`1`: the Triton FP8 prefill (`triton-fp8-prefill`, sm_90 / sm_100 without the CUTLASS "
    "build) keeps each weight's FP8 form from load (1.03 more bytes per weight) instead of "
    "reading it packed or re-encoding it per call, and then serves from M = 65 instead of 129.",
)
GPU_PROGRAMS_PER_SM = Setting(
    "VLLM_MXPLUS_GPU_PROGRAMS_PER_SM",
    "2",
    "Programs per SM that the Triton GEMMs' split-K aims at where the output tiles are few "
    "(decode): more hide more memory latency, each K slice adds an fp32 M x N partial. "
    "`scripts/gpu_check.sh`'s sweep step times the choices on a GPU.",
)
GPU_PDL = Setting(
    "VLLM_MXPLUS_GPU_PDL",
    "1",
    "On sm_90 and later, launch the decode GEMM with programmatic dependent launch: its "
    "programs start while the activation quantizer before it runs and wait for it at their "
    "first instruction, so the launch gap between the two kernels is hidden. `0`: plain "
    "launches. `scripts/gpu_check.sh` times both.",
)
CPU_LM_HEAD_FP32 = Setting(
    "VLLM_MXPLUS_CPU_LM_HEAD_FP32",
    "auto",
    "The bf16/fp16 lm_head on CPU as an fp32 GEMM over an fp32 copy of its weight made at load "
    "(same values; 4 bytes per weight more memory, logged), for calls of 2+ rows: `auto` where "
    "the CPU lacks native bf16 (no `avx512_bf16`, no `amx_bf16`), `1` always, `0` never "
    "(vLLM's own GEMM).",
)
CPU_EXACT_BF16 = Setting(
    "VLLM_MXPLUS_CPU_EXACT_BF16",
    "auto",
    "The CPU backend's AMX path (docs/cpu_kernels.md): calls of 32+ rows on AMX-BF16 tiles, and "
    "on CPUs with AMX-INT8 too E8M0 weights from 12 rows on int8 tiles: `auto` on CPUs with "
    "AMX-BF16, `0` never (the integer kernels serve every M: slower prefill and batched decode; "
    "NVFP4 and MX+ weights without the path's bf16 copy, 2 bytes per weight less memory; E8M0 "
    "weights have none either way).",
)
CPU_INT8_HELD = Setting(
    "VLLM_MXPLUS_CPU_INT8_HELD",
    "1",
    "Where the CPU backend's AMX path runs E8M0 weights on int8 tiles: `1` keeps each weight's "
    "int8 tiles decoded from load (about 1.1 bytes per weight more memory, ~1.7 in all against "
    "bf16's 2; faster at small batches), `0` decodes them from the packed codes per call.",
)
CPU_AMX_EMULATE = Setting(
    "VLLM_MXPLUS_CPU_AMX_EMULATE",
    "0",
    "Tests only: `1` builds the CPU kernels with the AMX tile instructions emulated in C++ "
    "(much slower than the real ones), so that the AMX path runs, and is tested, on CPUs "
    "without AMX that have AVX-512 (F, BW, VL, DQ, VBMI) and F16C; `0` (default) the real "
    "instructions, on AMX hosts only.",
)
CACHE = Setting(
    "MXPLUS_CACHE",
    "",
    "Root of the asset cache of `mxplus prepare` (the embedded model, text and benchmark data; "
    "default `~/.cache/vllm-mxplus`).",
)
ALL: tuple[Setting, ...] = (
    BACKEND,
    SELFTEST,
    CPU_KERNELS,
    CPU_MARCH,
    CPU_BUILD_DIR,
    CUTLASS_EXT,
    CUTLASS_BUILD_DIR,
    PREFILL_MIN_M,
    FP8_WEIGHT_HELD,
    GPU_PROGRAMS_PER_SM,
    GPU_PDL,
    CPU_LM_HEAD_FP32,
    CPU_EXACT_BF16,
    CPU_INT8_HELD,
    CPU_AMX_EMULATE,
    CACHE,
)


def _flag(s: Setting) -> bool:
    v = s.value().lower()
    if v in ("1", "true", "yes", "on"):
        return True
    if v in ("0", "false", "no", "off"):
        return False
    raise ValueError(f"{s.name}={s.raw()!r}: expected 0 or 1")


def _int_at_least(s: Setting, least: int) -> int:
    v = s.value()
    try:
        n = int(v)
    except ValueError:
        n = least - 1
    if n < least:
        what = "a positive integer" if least == 1 else f"an integer >= {least}"
        raise ValueError(f"{s.name}={v!r}: expected {what}")
    return n


def _auto_flag(s: Setting) -> bool | None:
    """`auto` -> None (the caller decides), else the flag's value."""
    v = s.value().lower()
    if v == "auto":
        return None
    try:
        return _flag(s)
    except ValueError:
        raise ValueError(f"{s.name}={s.raw()!r}: expected auto, 0 or 1") from None


def _path(s: Setting) -> Path | None:
    return Path(s.raw()).expanduser() if s.raw() else None


def selftest_enabled() -> bool:
    return _flag(SELFTEST)


def cpu_kernels_enabled() -> bool:
    return _flag(CPU_KERNELS)


def cpu_lm_head_fp32() -> bool | None:
    """VLLM_MXPLUS_CPU_LM_HEAD_FP32: True / False forced, None for `auto`."""
    return _auto_flag(CPU_LM_HEAD_FP32)


def cpu_exact_bf16() -> bool:
    """VLLM_MXPLUS_CPU_EXACT_BF16: False for `0`, True for `auto` (the host decides)."""
    raw = CPU_EXACT_BF16.value()
    if raw not in ("auto", "0"):
        raise ValueError(f"{CPU_EXACT_BF16.name}={raw!r}: expected `auto` or `0`")
    return raw == "auto"


def cpu_march() -> str:
    return CPU_MARCH.value()


def cpu_build_dir() -> Path | None:
    return _path(CPU_BUILD_DIR)


def cache_dir() -> Path | None:
    return _path(CACHE)


def cutlass_ext() -> Path | None:
    return _path(CUTLASS_EXT)


def cutlass_build_dir() -> Path | None:
    return _path(CUTLASS_BUILD_DIR)


def prefill_min_m() -> int:
    return _int_at_least(PREFILL_MIN_M, 1)


def fp8_weight_held() -> bool:
    return _flag(FP8_WEIGHT_HELD)


def cpu_int8_held() -> bool:
    return _flag(CPU_INT8_HELD)


def cpu_amx_emulate() -> bool:
    return _flag(CPU_AMX_EMULATE)


def gpu_programs_per_sm() -> int:
    return _int_at_least(GPU_PROGRAMS_PER_SM, 1)


def gpu_pdl() -> bool:
    return _flag(GPU_PDL)


@dataclass(frozen=True)
class BackendChoice:
    """VLLM_MXPLUS_BACKEND parsed: the names for every layer kind (key "") and the names
    given with a `KIND:` prefix (key KIND). The selector checks kinds and names."""

    raw: str
    names: dict[str, tuple[str, ...]]

    def names_for(self, kind: str) -> tuple[str, ...]:
        both = self.names.get("", ())
        return both + tuple(n for n in self.names.get(kind, ()) if n not in both)


def backend_choice() -> BackendChoice | None:
    """VLLM_MXPLUS_BACKEND, parsed; None when unset."""
    raw = BACKEND.raw()
    if not raw:
        return None
    names: dict[str, list[str]] = {}
    for item in (p.strip() for p in raw.split(",")):
        kind, sep, name = item.rpartition(":")
        name = name.strip()
        if not name:
            raise ValueError(f"{BACKEND.name}={raw!r}: an empty backend name in {item!r}")
        bucket = names.setdefault(kind.strip(), [])
        if name not in bucket:
            bucket.append(name)
    return BackendChoice(raw, {k: tuple(v) for k, v in names.items()})


def table() -> str:
    """The README's Settings table (markdown)."""
    rows = ["| variable | default | what it does |", "|---|---|---|"]
    for s in ALL:
        rows.append(f"| `{s.name}` | {f'`{s.default}`' if s.default else 'unset'} | {s.help} |")
    return "\n".join(rows)


if __name__ == "__main__":
    print(table())
