"""Build the optional CUTLASS extension `mxplus_cutlass` (never needed on CPU).

    python kernels/build.py                      # archs from TORCH_CUDA_ARCH_LIST, else both
    python kernels/build.py --archs 90a          # H100 / H200 only
    python kernels/build.py --out /opt/mxplus    # export VLLM_MXPLUS_CUTLASS_EXT=<printed path>

Each .cu file is compiled by nvcc for its own architecture only (sm90 -> sm_90a, sm100 ->
sm_100a); a file whose arch is not requested is compiled as a stub (-DMXPLUS_STUB) that
returns MXPLUS_ERR_NOT_COMPILED. The pybind wrapper (torch_bindings.cpp) is then built and
linked by torch.utils.cpp_extension.load. CUTLASS headers come from the `nvidia-cutlass`
wheel (or CUTLASS_DIR=<a CUTLASS checkout>); nothing of CUTLASS is vendored here.
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
SOURCES = {"90a": "sm90_fp8_chunk_scaled.cu", "100a": "sm100_fp4_mbs.cu"}
NVCC_FLAGS = ["-std=c++17", "--expt-relaxed-constexpr", "-O3", "-DNDEBUG",
              "-Xcompiler", "-fPIC", "-DCUTLASS_ENABLE_TENSOR_CORE_MMA=1"]


def cutlass_include_dirs() -> list[Path]:
    """[include, tools/util/include] of CUTLASS_DIR or of the nvidia-cutlass wheel."""
    root = os.environ.get("CUTLASS_DIR")
    if root:
        base = Path(root)
    else:
        try:
            import cutlass_library
        except ImportError as e:
            raise SystemExit("CUTLASS headers not found: pip install nvidia-cutlass "
                             "(or set CUTLASS_DIR)") from e
        base = Path(cutlass_library.__file__).parent / "source"
    dirs = [base / "include", base / "tools" / "util" / "include"]
    missing = [d for d in dirs if not (d / "cutlass").is_dir()]
    if missing:
        raise SystemExit(f"CUTLASS headers not found under {missing}")
    return dirs


def nvcc_path() -> str:
    cuda_home = os.environ.get("CUDA_HOME") or os.environ.get("CUDA_PATH")
    cand = Path(cuda_home) / "bin" / "nvcc" if cuda_home else None
    path = str(cand) if cand and cand.exists() else shutil.which("nvcc")
    if not path:
        raise SystemExit("nvcc not found (set CUDA_HOME)")
    return path


def nvcc_command(src: Path, obj: Path, arch: str | None, extra: list[str] = ()) -> list[str]:
    """nvcc -c for one file: arch like '90a' builds the kernel, None builds the stub."""
    inc = [f"-I{d}" for d in cutlass_include_dirs()] + [f"-I{HERE}"]
    gen = (["-gencode", f"arch=compute_{arch},code=sm_{arch}"] if arch else ["-DMXPLUS_STUB"])
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
        raise SystemExit(f"unsupported arch {bad}: choose from {list(SOURCES)}")
    return archs


def build(out: Path, archs: list[str], jobs: int = 2, verbose: bool = False) -> Path:
    out.mkdir(parents=True, exist_ok=True)
    procs = []
    for arch, name in SOURCES.items():
        obj = out / (Path(name).stem + ".o")
        cmd = nvcc_command(HERE / name, obj, arch if arch in archs else None)
        if verbose:
            print(" ".join(cmd))
        procs.append((name, obj, time.time(), subprocess.Popen(cmd)))
        if len([p for p in procs if p[3].poll() is None]) >= jobs:
            procs[-1][3].wait()
    objs = []
    for name, obj, t0, p in procs:
        if p.wait() != 0:
            raise SystemExit(f"nvcc failed on {name}")
        print(f"[build] {name}: {time.time() - t0:.0f} s")
        objs.append(str(obj))

    from torch.utils.cpp_extension import load

    defines = [f"-DMXPLUS_HAVE_SM{a.upper()}" for a in archs]
    mod = load(name="mxplus_cutlass", sources=[str(HERE / "torch_bindings.cpp")],
               extra_cflags=["-O3", f"-I{HERE}", *defines], extra_ldflags=[*objs, "-lcudart"],
               build_directory=str(out), with_cuda=True, verbose=verbose)
    path = Path(mod.__file__)
    print(f"[build] {path} (archs {archs}); set VLLM_MXPLUS_CUTLASS_EXT={path} or keep it in "
          f"kernels/build/")
    return path


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--archs",
                    help="comma list of 90a, 100a (default: TORCH_CUDA_ARCH_LIST, else both)")
    ap.add_argument("--out", type=Path, default=HERE / "build", help="build directory")
    ap.add_argument("--jobs", type=int, default=2, help="parallel nvcc processes")
    ap.add_argument("-v", "--verbose", action="store_true")
    args = ap.parse_args(argv)
    build(args.out, requested_archs(args.archs), args.jobs, args.verbose)
    return 0


if __name__ == "__main__":
    sys.exit(main())
