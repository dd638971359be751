"""Which vllm_mxplus modules a vLLM worker loads: the plugin registered, the integration layer
imported, and the backends of one platform resolved (what the selector imports for a layer).

    .venv/bin/python scripts/serving_imports.py [--platform cpu|cuda] [--json]

Each run is a fresh interpreter, so the count is exactly what serving loads. Modules are
grouped as offline tools (the quantizer driver, calibration, assets, evaluation, analysis,
kernel tools), kernel families (Triton, CUTLASS, the C++ CPU build) and the rest.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys

OFFLINE = (
    "vllm_mxplus.calibration",
    "vllm_mxplus.assets",
    "vllm_mxplus.evaluation",
    "vllm_mxplus.analysis",
    "vllm_mxplus.kernel_tools",
    "vllm_mxplus.checkpoint.quantizer",
    "vllm_mxplus.checkpoint.cli_quantize",
    "vllm_mxplus.checkpoint.shard_writer",
)
FAMILIES = {
    "triton": "vllm_mxplus.backends.triton",
    "cutlass": "vllm_mxplus.backends.cutlass",
    "cpu": "vllm_mxplus.backends.cpu",
}

_CHILD = """
import json, sys
import vllm_mxplus
vllm_mxplus.register()
import vllm_mxplus.integration.config, vllm_mxplus.integration.linear
import vllm_mxplus.integration.fused_moe, vllm_mxplus.integration.gpt_oss_model
from vllm_mxplus.backends.selection import registered_backends
for kind in ("linear", "experts"):
    registered_backends(sys.argv[1], kind)
print(json.dumps(sorted(m for m in sys.modules if m.split(".")[0] == "vllm_mxplus")))
"""


def loaded_modules(platform: str) -> list[str]:
    """The vllm_mxplus modules a fresh interpreter holds after registering and resolving."""
    out = subprocess.run(
        [sys.executable, "-c", _CHILD, platform], capture_output=True, text=True, check=False
    )
    if out.returncode != 0:
        raise RuntimeError(f"the import probe failed:\n{out.stderr[-4000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def classify(modules: list[str]) -> dict[str, list[str]]:
    """{"offline": [...], "triton": [...], "cutlass": [...], "cpu": [...]} of `modules`."""
    groups: dict[str, list[str]] = {"offline": [], **{k: [] for k in FAMILIES}}
    for m in modules:
        if any(m == p or m.startswith(p + ".") for p in OFFLINE):
            groups["offline"].append(m)
        for fam, prefix in FAMILIES.items():
            if m == prefix or m.startswith(prefix + "."):
                groups[fam].append(m)
    return groups


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--platform", choices=("cpu", "cuda"), default="cpu")
    ap.add_argument("--json", action="store_true", help="print the module lists as JSON")
    args = ap.parse_args(argv)
    mods = loaded_modules(args.platform)
    groups = classify(mods)
    if args.json:
        print(json.dumps({"platform": args.platform, "modules": mods, **groups}, indent=1))
    else:
        print(
            f"{args.platform}: {len(mods)} vllm_mxplus modules; "
            + ", ".join(f"{k} {len(v)}" for k, v in groups.items())
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
