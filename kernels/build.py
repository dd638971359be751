"""Build the optional CUTLASS extension `mxplus_cutlass` from a source checkout (a shim).

The sources and the build logic live in the package (`vllm_mxplus/backends/cutlass/csrc/`,
`vllm_mxplus/backends/cutlass/build.py`), so an installed wheel builds the same way with
`python -m vllm_mxplus.backends.cutlass.build`. This script keeps the checkout's habit: the default
output is kernels/build/, where the loader also looks.

    python kernels/build.py                      # archs from TORCH_CUDA_ARCH_LIST, else both
    python kernels/build.py --archs 90a          # H100 / H200 only
    python kernels/build.py --out /opt/mxplus    # export VLLM_MXPLUS_CUTLASS_EXT=<printed path>
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the checkout's package

from vllm_mxplus.backends.cutlass.build import main  # noqa: E402

if __name__ == "__main__":
    argv = sys.argv[1:]
    if not any(a == "--out" or a.startswith("--out=") for a in argv):
        argv += ["--out", str(Path(__file__).resolve().parent / "build")]
    sys.exit(main(argv))
