"""Offline quantizer throughput and peak memory: MBS-D (the paper's weight format) vs MBS-S.

Baseline: MBS-S (`mxfp4-mbs-s` scheme) on the same checkpoint in the same run; MBS-D is the
weight format of the default `mxfp4-mbs` scheme. Each run is a fresh subprocess, so its peak
RSS (getrusage) is its own. Workloads:
  * the embedded SmolLM2-135M bf16 checkpoint (vllm_mxplus.assets.prepare_smollm2), if present;
  * a synthetic Llama-3-8B-shaped stack: q/o [4096, 4096], k/v [1024, 4096], gate/up
    [14336, 4096], down [4096, 14336] per layer (bf16, N(0, 0.02)), written to a temp dir.
--quick: SmolLM2's first 2 layers and one 8B-shaped layer with 1/16 of the rows (same K).

    python benchmarks/bench_quantize.py [--quick] [--layers N] [--device cpu|cuda]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
from safetensors.torch import save_file

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from vllm_mxplus.checkpoint.safetensors_io import read_header, read_tensor  # noqa: E402
from vllm_mxplus.platform_amx import cpu_model_name  # noqa: E402

BASELINE, CANDIDATE = "mxfp4-mbs-s", "mxfp4-mbs"  # weight formats mxfp4-mbs-s / mxfp4-mbs-d
LLAMA3_8B = {"hidden": 4096, "intermediate": 14336, "kv": 1024, "vocab": 128256}

_CHILD = """
import json, resource, sys
from vllm_mxplus.checkpoint import quantize_checkpoint
def cpu():
    u = resource.getrusage(resource.RUSAGE_SELF)
    return u.ru_utime + u.ru_stime
c0 = cpu()
r = quantize_checkpoint(sys.argv[1], sys.argv[2], sys.argv[3], device=sys.argv[4],
                        force=True, progress=False)
print("RESULT " + json.dumps({"seconds": r.seconds, "cpu": cpu() - c0, "weights": r.weights_quantized,
      "peak_rss": r.peak_rss, "bytes_in": r.bytes_in, "bytes_out": r.bytes_out,
      "qsnr": r.qsnr_db, "tensors": r.n_quantized}))
"""
# Data preparation also runs in a child: Linux folds a process's RSS high-water mark into
# ru_maxrss across fork + exec, so a parent that held the synthetic tensors would inflate
# every later child's peak RSS.
_PREPARE = """
import sys
from pathlib import Path
sys.path.insert(0, sys.argv[1])
import bench_quantize as b
if sys.argv[2] == "synthetic":
    b.write_synthetic(Path(sys.argv[3]), int(sys.argv[4]), int(sys.argv[5]))
else:
    b.write_smollm2_subset(Path(sys.argv[3]), Path(sys.argv[4]), int(sys.argv[5]))
print("RESULT null")
"""
_IDLE = """
import resource
import vllm_mxplus.checkpoint
print("RESULT", resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024)
"""


def machine() -> str:
    cpu = cpu_model_name(platform.processor() or "?")
    mem = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30
    gpu = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "none"
    return (
        f"{platform.node()}: {cpu}, {os.cpu_count()} logical cores, {mem:.1f} GiB RAM, "
        f"GPU {gpu}, load average {os.getloadavg()[0]:.2f}"
    )


def versions() -> str:
    import safetensors

    import vllm_mxplus

    try:
        commit = subprocess.run(
            ["git", "-C", str(ROOT), "rev-parse", "--short", "HEAD"],
            capture_output=True,
            text=True,
            check=True,
        ).stdout.strip()
        dirty = subprocess.run(
            ["git", "-C", str(ROOT), "status", "--porcelain", "vllm_mxplus"],
            capture_output=True,
            text=True,
        ).stdout.strip()
        commit += "+dirty" if dirty else ""
    except (OSError, subprocess.CalledProcessError):
        commit = "?"
    return (
        f"python {platform.python_version()}, torch {torch.__version__} "
        f"({torch.get_num_threads()} threads), safetensors {safetensors.__version__}, "
        f"vllm-mxplus {vllm_mxplus.__version__} @ {commit}"
    )


def write_synthetic(path: Path, layers: int, row_div: int) -> Path:
    """An 8B-shaped Llama stack (linears only + norms), one safetensors shard per layer."""
    h, i, kv = LLAMA3_8B["hidden"], LLAMA3_8B["intermediate"], LLAMA3_8B["kv"]
    shapes = {
        "self_attn.q_proj": (h, h),
        "self_attn.k_proj": (kv, h),
        "self_attn.v_proj": (kv, h),
        "self_attn.o_proj": (h, h),
        "mlp.gate_proj": (i, h),
        "mlp.up_proj": (i, h),
        "mlp.down_proj": (h, i),
    }
    path.mkdir(parents=True)
    gen = torch.Generator().manual_seed(0)
    weight_map = {}
    for layer in range(layers):
        tensors = {
            f"model.layers.{layer}.input_layernorm.weight": torch.ones(h, dtype=torch.bfloat16)
        }
        for name, (n, k) in shapes.items():
            w = torch.randn(n // row_div, k, generator=gen) * 0.02
            tensors[f"model.layers.{layer}.{name}.weight"] = w.to(torch.bfloat16)
        file = f"model-{layer + 1:05d}-of-{layers:05d}.safetensors"
        save_file(tensors, str(path / file), metadata={"format": "pt"})
        weight_map.update({t: file for t in tensors})
        del tensors
    (path / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    (path / "config.json").write_text(
        json.dumps(
            {
                "model_type": "llama",
                "architectures": ["LlamaForCausalLM"],
                "hidden_size": h,
                "intermediate_size": i,
                "num_hidden_layers": layers,
                "num_key_value_heads": 8,
                "num_attention_heads": 32,
                "vocab_size": LLAMA3_8B["vocab"],
                "torch_dtype": "bfloat16",
            }
        )
    )
    return path


def smollm2_source(tmp: Path, quick: bool) -> tuple[Path | None, str]:
    try:
        from vllm_mxplus.assets.smollm2 import MARKER, smollm2_dir
    except ImportError as e:
        return None, f"vllm_mxplus.assets unavailable ({e})"
    path = smollm2_dir()
    if not (path / MARKER).is_file():
        return None, f"not prepared at {path} (run vllm_mxplus.assets.prepare_smollm2())"
    if not quick:
        return path, str(path)
    sub = tmp / "smollm2-2layers"
    run_child(_PREPARE, str(Path(__file__).parent), "smollm2", str(sub), str(path), "2")
    return sub, f"{path} (first 2 layers)"


def write_smollm2_subset(sub: Path, path: Path, layers: int) -> None:
    """The first `layers` decoder layers of the model at path, plus embeddings and norms."""
    sub.mkdir()
    keep = {}
    for f in sorted(path.glob("*.safetensors")):
        for t in read_header(f)[0]:
            if ".layers." not in t.name or any(f".layers.{i}." in t.name for i in range(layers)):
                keep[t.name] = read_tensor(t)
    save_file(keep, str(sub / "model.safetensors"), metadata={"format": "pt"})
    cfg = json.loads((path / "config.json").read_text())
    cfg["num_hidden_layers"] = layers
    (sub / "config.json").write_text(json.dumps(cfg))


def run_child(code: str, *args: str) -> object:
    env = dict(os.environ, PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    out = subprocess.run(
        [sys.executable, "-c", code, *args], capture_output=True, text=True, env=env
    )
    if out.returncode != 0:
        raise RuntimeError(f"benchmark child failed:\n{out.stderr[-3000:]}")
    line = next(l for l in out.stdout.splitlines() if l.startswith("RESULT "))  # noqa: E741
    return json.loads(line[len("RESULT ") :])


def bench(name: str, src: Path, tmp: Path, device: str, schemes: list[str]) -> None:
    res = {}
    for scheme in schemes:
        t0 = time.perf_counter()
        res[scheme] = run_child(_CHILD, str(src), str(tmp / f"out-{scheme}"), scheme, device)
        res[scheme]["wall"] = time.perf_counter() - t0
    first = res[schemes[0]]
    print(
        f"\n{name}: {first['tensors']} quantized tensors, {first['weights'] / 1e6:.1f} M weights, "
        f"{first['bytes_in'] / 2**20:.0f} MiB in"
    )
    print(
        f"  {'scheme (weights)':26s} {'wall s':>8s} {'cpu s':>8s} {'M weights/s':>12s} "
        f"{'M w/cpu-s':>10s} {'peak RSS':>10s} {'out MiB':>8s} {'QSNR dB':>8s}"
    )
    for scheme, r in res.items():
        fmt, q = next(iter(r["qsnr"].items()))
        print(
            f"  {scheme + ' (' + fmt + ')':26s} {r['seconds']:8.2f} {r['cpu']:8.2f} "
            f"{r['weights'] / r['seconds'] / 1e6:12.3f} {r['weights'] / r['cpu'] / 1e6:10.3f} "
            f"{r['peak_rss'] / 2**20:6.0f} MiB {r['bytes_out'] / 2**20:8.1f} {q:8.2f}"
        )
    if BASELINE in res and CANDIDATE in res:
        wall = res[CANDIDATE]["seconds"] / res[BASELINE]["seconds"]
        cpu = res[CANDIDATE]["cpu"] / res[BASELINE]["cpu"]
        print(
            f"  ratio MBS-D / MBS-S: {wall:.1f}x wall time, {cpu:.1f}x CPU time "
            "(MBS-S is the baseline; CPU time is the steadier figure on a shared machine)"
        )


def main() -> int:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--quick", action="store_true", help="small workloads (about a minute or two)")
    p.add_argument(
        "--layers", type=int, default=None, help="8B-shaped layers (default: 2, or 1 with --quick)"
    )
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--skip-smollm2", action="store_true")
    p.add_argument(
        "--schemes",
        default=f"{BASELINE},{CANDIDATE}",
        help="comma-separated schemes to run (default: %(default)s; the ratio needs both)",
    )
    args = p.parse_args()
    schemes = [x.strip() for x in args.schemes.split(",") if x.strip()]
    layers = args.layers or (1 if args.quick else 2)
    row_div = 16 if args.quick else 1
    print(f"machine:  {machine()}")
    print("note:     wall s = end-to-end run (read, quantize, QSNR, write); cpu s = its user+sys")
    print(f"versions: {versions()}")
    print(f"device:   {args.device}")
    with tempfile.TemporaryDirectory(prefix="bench-quantize-") as d:
        tmp = Path(d)
        idle = run_child(_IDLE)
        print(f"idle RSS after imports: {idle / 2**20:.0f} MiB")
        if args.skip_smollm2:
            print("\nSmolLM2-135M: skipped (--skip-smollm2)")
        else:
            src, where = smollm2_source(tmp, args.quick)
            if src is None:
                print(f"\nSmolLM2-135M: {where}")
            else:
                bench(f"SmolLM2-135M bf16 [{where}]", src, tmp / "smol", args.device, schemes)
        rows = f", rows / {row_div}" if row_div > 1 else ""
        src = tmp / "synthetic"
        run_child(
            _PREPARE, str(Path(__file__).parent), "synthetic", str(src), str(layers), str(row_div)
        )
        largest = LLAMA3_8B["intermediate"] // row_div * LLAMA3_8B["hidden"] * 2 / 2**20
        bench(
            f"synthetic Llama-3-8B-shaped stack ({layers} layer{'s' * (layers > 1)}{rows}; "
            f"largest tensor {largest:.0f} MiB bf16)",
            src,
            tmp / "syn",
            args.device,
            schemes,
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
