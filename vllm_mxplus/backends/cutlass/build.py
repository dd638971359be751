"""The optional CUTLASS extension `mxplus_cutlass`: where its sources are, how it is built, and
loading it (never needed on CPU).

    python -m vllm_mxplus.backends.cutlass.build               # archs: TORCH_CUDA_ARCH_LIST, else both
    python -m vllm_mxplus.backends.cutlass.build --archs 90a   # H100 / H200 only
    python -m vllm_mxplus.backends.cutlass.build --out DIR     # then VLLM_MXPLUS_CUTLASS_EXT=<the .so>

The C++ sources ship inside the package (`vllm_mxplus/backends/cutlass/csrc/`, package data), so an
installed wheel builds the same way as a source checkout (`kernels/build.py` is a shim for
this module). Each .cu file is compiled by nvcc for its own architecture only (sm90 ->
sm_90a, sm100 -> sm_100a); a file whose arch is not requested is compiled as a stub
(-DMXPLUS_STUB) that returns MXPLUS_ERR_NOT_COMPILED. The pybind wrapper
(torch_bindings.cpp) is built and linked by torch.utils.cpp_extension.load. CUTLASS headers
come from the `nvidia-cutlass` wheel (or CUTLASS_DIR=<a CUTLASS checkout or its headers>).

The default build directory is a per-user cache keyed by the build's identity
(`~/.cache/vllm-mxplus/cutlass/<key>`, root overridable with VLLM_MXPLUS_CUTLASS_BUILD_DIR):
a digest of the C++ sources and the nvcc flags, the CUDA toolkit (nvcc's release), torch and
its CUDA version, and the archs. Every build writes that identity beside its .so
(`mxplus_cutlass.build.json`). `load_extension()` considers VLLM_MXPLUS_CUTLASS_EXT, then the
cache, then `kernels/build/` of a source checkout, and loads only a .so whose recorded
identity matches this package's sources and flags, this torch, and the installed toolkit
(where nvcc is installed: a serving machine may have none); a stale or unrecorded .so is
skipped with the reason. It never builds by itself: nvcc takes minutes.
"""

from __future__ import annotations

import argparse
import functools
import hashlib
import importlib.machinery
import importlib.util
import json
import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path
from types import ModuleType

import torch

from vllm_mxplus import settings

SOURCE_DIR = Path(__file__).resolve().parent / "csrc"
SOURCES = {"90a": "sm90_fp8_chunk_scaled.cu", "100a": "sm100_fp4_mbs.cu"}
BINDINGS = "torch_bindings.cpp"
HEADERS = ("mxplus_launchers.h", "mxplus_cutlass_gemm.h")
NVCC_FLAGS = [
    "-std=c++17",
    "--expt-relaxed-constexpr",
    "-O3",
    "-DNDEBUG",
    "-Xcompiler",
    "-fPIC",
    "-DCUTLASS_ENABLE_TENSOR_CORE_MMA=1",
]
EXT_ENV = settings.CUTLASS_EXT.name  # path of a built mxplus_cutlass*.so
BUILD_ENV = settings.CUTLASS_BUILD_DIR.name
ARCH_OF_CAPABILITY = {(9, 0): "sm90a", (10, 0): "sm100a"}
MANIFEST = "mxplus_cutlass.build.json"  # the build's identity, beside its .so


class BuildError(RuntimeError):
    """nvcc, the CUTLASS headers or a compile step is missing or failed (message says which)."""


# ----------------------------------------------------------------------------- build
def cutlass_include_dirs() -> list[Path]:
    """[include, tools/util/include] of CUTLASS_DIR or of the nvidia-cutlass wheel."""
    root = os.environ.get("CUTLASS_DIR")
    if root:
        base = Path(root)
    else:
        try:
            import cutlass_library
        except ImportError as e:
            raise BuildError(
                "CUTLASS headers not found: pip install nvidia-cutlass==4.2.0.0 "
                "(or set CUTLASS_DIR)"
            ) from e
        base = Path(cutlass_library.__file__).parent / "source"
    dirs = [base / "include", base / "tools" / "util" / "include"]
    missing = [str(d) for d in dirs if not (d / "cutlass").is_dir()]
    if missing:
        raise BuildError(f"CUTLASS headers not found under {missing} (set CUTLASS_DIR)")
    return dirs


def nvcc_path() -> str:
    cuda_home = os.environ.get("CUDA_HOME") or os.environ.get("CUDA_PATH")
    cand = Path(cuda_home) / "bin" / "nvcc" if cuda_home else None
    path = str(cand) if cand and cand.exists() else shutil.which("nvcc")
    if not path:
        raise BuildError("nvcc not found (install the CUDA toolkit or set CUDA_HOME)")
    return path


def nvcc_command(src: Path, obj: Path, arch: str | None, extra: tuple[str, ...] = ()) -> list[str]:
    """nvcc -c for one file: arch like '90a' builds the kernel, None builds the stub (which
    needs no CUTLASS headers)."""
    inc = ([f"-I{d}" for d in cutlass_include_dirs()] if arch else []) + [f"-I{SOURCE_DIR}"]
    gen = ["-gencode", f"arch=compute_{arch},code=sm_{arch}"] if arch else ["-DMXPLUS_STUB"]
    return [nvcc_path(), "-c", *NVCC_FLAGS, *gen, *inc, *extra, str(src), "-o", str(obj)]


def requested_archs(cli: str | None) -> list[str]:
    """'90a,100a' from --archs, else from TORCH_CUDA_ARCH_LIST ('9.0a;10.0a'), else both."""
    if cli:
        archs = [a.strip() for a in cli.replace(";", ",").split(",") if a.strip()]
    elif os.environ.get("TORCH_CUDA_ARCH_LIST"):
        raw = os.environ["TORCH_CUDA_ARCH_LIST"].replace(";", " ").replace(",", " ").split()
        archs = [a.replace(".", "").replace("+PTX", "") for a in raw]
        archs = [a if a.endswith("a") else a + "a" for a in archs if a.rstrip("a") in ("90", "100")]
    else:
        archs = list(SOURCES)
    bad = [a for a in archs if a not in SOURCES]
    if bad:
        raise BuildError(f"unsupported arch {bad}: choose from {list(SOURCES)}")
    return archs


def source_files() -> list[Path]:
    return [SOURCE_DIR / n for n in (*SOURCES.values(), BINDINGS, *HEADERS)]


@functools.lru_cache(maxsize=1)
def toolkit_version() -> str | None:
    """The CUDA toolkit that builds here: nvcc's release line ('12.8, V12.8.93'), or None
    without nvcc (a serving machine may have none; then the toolkit is not compared)."""
    try:
        out = subprocess.run(
            [nvcc_path(), "--version"], capture_output=True, text=True, timeout=60
        ).stdout
    except (BuildError, OSError, subprocess.SubprocessError):
        return None
    found = re.search(r"release ([^\n]+)", out)
    return found.group(1).strip() if found else out.strip() or None


def source_digest() -> str:
    """sha256 of every C++ source and header (names and bytes) and of the nvcc flags."""
    h = hashlib.sha256()
    for path in source_files():
        h.update(path.name.encode() + b"\0" + path.read_bytes() + b"\0")
    h.update("\0".join(NVCC_FLAGS).encode())
    return h.hexdigest()


def build_identity(archs: list[str], toolkit: str | None) -> dict[str, object]:
    """What a built .so depends on: sources and flags, toolkit, torch and its CUDA, archs."""
    return {
        "sources": source_digest(),
        "toolkit": toolkit,
        "torch": torch.__version__,
        "torch_cuda": torch.version.cuda,
        "archs": sorted(archs),
    }


def build_key(archs: list[str]) -> str:
    """Hash of the build's identity (`build_identity` with the installed toolkit): one cache
    directory per build."""
    ident = build_identity(archs, toolkit_version())
    return hashlib.sha256(json.dumps(ident, sort_keys=True).encode()).hexdigest()[:16]


def cache_root() -> Path:
    return settings.cutlass_build_dir() or Path.home() / ".cache" / "vllm-mxplus" / "cutlass"


def default_build_dir(archs: list[str]) -> Path:
    return cache_root() / build_key(archs)


def write_manifest(so: Path, archs: list[str]) -> None:
    """Record the identity of the build that produced `so` beside it."""
    ident = build_identity(archs, toolkit_version())
    (so.parent / MANIFEST).write_text(json.dumps(ident, indent=1, sort_keys=True) + "\n")


def stale_reason(so: Path) -> str | None:
    """None when `so` was built from this package's sources and flags, for this torch (and
    CUDA), with the installed toolkit (when nvcc is installed); else why it must not load."""
    path = so.parent / MANIFEST
    try:
        rec = json.loads(path.read_text())
    except (OSError, ValueError):
        return f"no build record {path.name} beside it (built by an older version)"
    if not isinstance(rec, dict):
        return f"{path.name} is not a build record"
    now = build_identity(list(rec.get("archs") or []), toolkit_version())
    for field, what in (
        ("sources", "the C++ sources or nvcc flags"),
        ("torch", "torch"),
        ("torch_cuda", "torch's CUDA version"),
    ):
        if rec.get(field) != now[field]:
            return f"built for other {what} ({field} {rec.get(field)!r}, now {now[field]!r})"
    if now["toolkit"] is not None and rec.get("toolkit") != now["toolkit"]:
        return f"built with CUDA toolkit {rec.get('toolkit')!r}, installed {now['toolkit']!r}"
    return None


def build(out: Path | None, archs: list[str], jobs: int = 2, verbose: bool = False) -> Path:
    """Compile the kernels for `archs` (stubs for the others) and link the extension; returns
    the .so path. With the default (keyed) directory an extension already built there is
    reused: the key covers the sources, torch / CUDA and the archs. Raises BuildError naming
    the step that failed."""
    missing = [str(p) for p in source_files() if not p.is_file()]
    if missing:
        raise BuildError(f"CUTLASS sources missing from the installed package: {missing}")
    keyed = out is None  # the default directory is keyed by sources, torch and archs
    out = out or default_build_dir(archs)
    out.mkdir(parents=True, exist_ok=True)
    cached = [p for p in sorted(out.glob("mxplus_cutlass*.so")) if stale_reason(p) is None]
    if keyed and cached:  # same identity: built before on this machine
        print(f"[build] cached: {cached[0]} (archs {archs}; key {out.name})")
        return cached[0]
    real = [a for a in SOURCES if a in archs]
    # nvcc's optimizer threads per kernel file: the cores left over by the parallel files
    split = max(1, jobs // max(1, len(real)))
    procs = []
    for arch, name in SOURCES.items():
        obj = out / (Path(name).stem + ".o")
        built = arch in archs
        extra = (f"--split-compile={split}",) if built and split > 1 else ()
        cmd = nvcc_command(SOURCE_DIR / name, obj, arch if built else None, extra)
        if verbose:
            print(" ".join(cmd))
        procs.append((name, obj, time.time(), subprocess.Popen(cmd)))
        if len([p for p in procs if p[3].poll() is None]) >= jobs:
            procs[-1][3].wait()
    objs = []
    for name, obj, t0, p in procs:
        if p.wait() != 0:
            raise BuildError(f"nvcc failed on {name}")
        print(f"[build] {name}: {time.time() - t0:.0f} s")
        objs.append(str(obj))

    from torch.utils.cpp_extension import load

    defines = [f"-DMXPLUS_HAVE_SM{a.upper()}" for a in archs]
    try:
        mod = load(
            name="mxplus_cutlass",
            sources=[str(SOURCE_DIR / BINDINGS)],
            extra_cflags=["-O3", f"-I{SOURCE_DIR}", *defines],
            extra_ldflags=[*objs, "-lcudart"],
            build_directory=str(out),
            with_cuda=True,
            verbose=verbose,
        )
    except (OSError, RuntimeError, subprocess.SubprocessError) as e:
        # torch's extension builder: no CUDA torch / CUDA_HOME, or the bindings' compile
        raise BuildError(
            f"linking the extension failed ({type(e).__name__}: {e}); the kernels compiled "
            f"into {out}: it needs a CUDA build of torch and the toolkit (CUDA_HOME)"
        ) from e
    path = Path(mod.__file__)
    write_manifest(path, archs)
    print(f"[build] {path} (archs {archs}); found automatically, or set {EXT_ENV}={path}")
    return path


# ----------------------------------------------------------------------------- load
_EXT: ModuleType | None = None
_EXT_ERROR = "not loaded yet"


def candidate_paths() -> list[Path]:
    """Where load_extension looks, in order."""
    ext = settings.cutlass_ext()
    paths = [ext] if ext else []
    try:
        cache = cache_root()
        paths += sorted(cache.glob("*/mxplus_cutlass*.so"), key=lambda p: -p.stat().st_mtime)
    except OSError:
        pass
    checkout = Path(__file__).resolve().parents[3] / "kernels" / "build"  # a source checkout
    return paths + sorted(checkout.glob("mxplus_cutlass*.so"))


def _load_module(path: Path) -> ModuleType:
    loader = importlib.machinery.ExtensionFileLoader("mxplus_cutlass", str(path))
    spec = importlib.util.spec_from_loader("mxplus_cutlass", loader)
    if spec is None:
        raise ImportError(f"no module spec for {path}")
    mod = importlib.util.module_from_spec(spec)
    loader.exec_module(mod)
    return mod


def load_extension() -> ModuleType | None:
    """The compiled module, or None; the reason is kept for `is_available`. Only a .so whose
    build record matches (`stale_reason`) is loaded; the first match in `candidate_paths`
    order wins."""
    global _EXT, _EXT_ERROR
    if _EXT is not None or _EXT_ERROR != "not loaded yet":
        return _EXT
    rebuild = f"build it: python -m vllm_mxplus.backends.cutlass.build; or set {EXT_ENV}"
    skipped = []
    for path in candidate_paths():
        if not path.is_file():
            continue
        stale = stale_reason(path)
        if stale:
            skipped.append(f"{path}: {stale}")
            continue
        try:
            _EXT = _load_module(path)
            return _EXT
        except Exception as e:  # an incompatible build is a reason, not a crash
            skipped.append(f"{path}: loading failed: {type(e).__name__}: {e}")
    _EXT_ERROR = (
        f"no matching mxplus_cutlass extension ({rebuild}); skipped {'; '.join(skipped)}"
        if skipped
        else f"no mxplus_cutlass extension found ({rebuild})"
    )
    return None


def arch_of(device: torch.device | None = None) -> str | None:
    """'sm90a' / 'sm100a' when the device runs one of the kernels, else None."""
    if not torch.cuda.is_available() or torch.version.hip:
        return None
    return ARCH_OF_CAPABILITY.get(torch.cuda.get_device_capability(device))


def is_available(device: torch.device | None = None) -> tuple[bool, str]:
    """(True, "") when a CUTLASS prefill kernel can run on `device`; else (False, why)."""
    if not torch.cuda.is_available():
        return False, "no CUDA device"
    arch = arch_of(device)
    if arch is None:
        cap = torch.cuda.get_device_capability(device)
        return False, f"capability {cap} has no kernel (needs sm_90a or sm_100a exactly)"
    ext = load_extension()
    if ext is None:
        return False, _EXT_ERROR
    if arch not in ext.compiled_archs():
        return False, f"extension built without {arch} (built: {ext.compiled_archs()})"
    return True, ""


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        prog="python -m vllm_mxplus.backends.cutlass.build",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    ap.add_argument(
        "--archs", help="comma list of 90a, 100a (default: TORCH_CUDA_ARCH_LIST, else both)"
    )
    ap.add_argument(
        "--out",
        type=Path,
        default=None,
        help=f"build directory (default: ~/.cache/vllm-mxplus/cutlass/<key>, "
        f"root from {BUILD_ENV})",
    )
    ap.add_argument(
        "--jobs",
        type=int,
        default=2,
        help="cores to use: parallel nvcc processes, the rest as nvcc --split-compile threads",
    )
    ap.add_argument("-v", "--verbose", action="store_true")
    args = ap.parse_args(argv)
    try:
        build(args.out, requested_archs(args.archs), args.jobs, args.verbose)
    except BuildError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
