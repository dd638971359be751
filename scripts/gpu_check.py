"""The Python side of scripts/gpu_check.sh: one step per call, its JSON under --out.

    python scripts/gpu_check.py --dry-run [--budget S]   # the plan and time boxes, no GPU
    python scripts/gpu_check.py STEP --out DIR           # STEP: served | correct | speed

Each step writes DIR/<step>.json first with status "started", rewrites it after every check
(status "running", the checks so far), and last with "ok" or "failed"; gpu_check.sh marks a
file still "started"/"running" after its time box as "cut". A check that raises is recorded
as failed with its error, and the step goes on. Steps, most important first:

  served   what vLLM runs: backend selection + self-test on this device per scheme,
           `linear_dispatch` under torch.compile (dynamic M) = eager, CUDA-graph capture and
           replay at M 1, 16, 24, 512 of every backend that serves the M, MoE expert backends
  correct  every CUDA backend at real shapes (Llama-3-8B linears) against float64 x_hat W_hat^T
           within the self-test bound of its accumulator (docs/numerics.md)
  speed    decode vs bf16 at M 1/4/16; prefill MBS overhead against the same FP8 GEMM without
           per-chunk scales (torch._scaled_mm rowwise) and mxfp4-mbs against mxfp4-16-oas end
           to end; act-quant bandwidth vs a copy; MoE vs bf16 when a CUDA expert backend exists
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

CAPTURE_MS = (1, 16, 24, 512)
SCHEMES = ("mxfp4-mbs", "mxfp4-16-oas", "mxfp4-ocp", "nvfp4")
REAL_SHAPES = (
    ("qkv", 6144, 4096),
    ("o", 4096, 4096),
    ("gate_up", 28672, 4096),
    ("down", 4096, 14336),
)

# (step, time box in seconds at the default budget, what it does): gpu_check.sh reads this
PLAN = (
    ("prereq", 20, "python modules, nvcc, CUTLASS headers, the device"),
    ("build", 240, "CUTLASS extension for this arch, all cores, cached in ~/.cache between calls"),
    (
        "served",
        100,
        "selection + self-test, linear_dispatch under torch.compile, CUDA graphs at "
        "M 1/16/24/512 for every backend, MoE",
    ),
    ("correct", 80, "every CUDA backend at Llama-3-8B shapes against float64, self-test bound"),
    (
        "speed",
        110,
        "decode vs bf16 M 1/4/16; prefill MBS overhead vs the same GEMM without MBS; "
        "act-quant GB/s vs copy; MoE vs bf16",
    ),
    ("pytest_gpu", 0, "pytest -m gpu (tests/backends, tests/kernels) with what is left, >= 30 s"),
)
DEFAULT_BUDGET = 570  # s: under the device tool's 600 s per call


def time_boxes(budget: int) -> list[tuple[str, int, str]]:
    """The plan's boxes scaled to `budget` (never above their default, the build first)."""
    total = sum(box for _, box, _ in PLAN)
    scale = min(1.0, budget / total)
    return [(name, max(5, int(box * scale)) if box else 0, what) for name, box, what in PLAN]


def dry_run(budget: int) -> int:
    boxes = time_boxes(budget)
    print(f"[gpu_check] plan for a {budget} s budget (device tool: one call, 600 s at most)")
    for i, (name, box, what) in enumerate(boxes):
        print(f"  {i}. {name:<10} {box if box else 'rest':>4} s  {what}")
    print(
        f"  total of the boxes: {sum(b for _, b, _ in boxes)} s <= {budget} s "
        "(pytest_gpu: what is left; speed also takes what earlier steps left)"
    )
    print("  each step writes $OUT/<step>.json ('started' first; 'cut' if its box ran out)")
    return 0


# ----------------------------------------------------------------------------- recording
class Step:
    """One step's JSON record, rewritten after every check."""

    def __init__(self, name: str, out: Path) -> None:
        self.path = out / f"{name}.json"
        self.rec: dict[str, Any] = {"step": name, "status": "started", "checks": []}
        self.t0 = time.perf_counter()
        out.mkdir(parents=True, exist_ok=True)
        self.write()

    def write(self) -> None:
        self.rec["seconds"] = round(time.perf_counter() - self.t0, 2)
        tmp = self.path.with_suffix(".tmp")
        tmp.write_text(json.dumps(self.rec, indent=1, default=str))
        tmp.replace(self.path)

    def check(self, name: str, fn: Callable[[], dict | None]) -> dict:
        t0 = time.perf_counter()
        try:
            res = fn() or {}
            ok = bool(res.pop("ok", True))
            entry = {"check": name, "ok": ok, **res}
        except Exception as e:  # recorded, the step goes on
            entry = {
                "check": name,
                "ok": False,
                "error": f"{type(e).__name__}: {e}",
                "where": traceback.format_exc(limit=3).splitlines()[-3:],
            }
        entry["seconds"] = round(time.perf_counter() - t0, 3)
        self.rec["checks"].append(entry)
        self.rec["status"] = "running"
        self.write()
        print(
            f"[gpu_check] {self.rec['step']}: {name}: {'ok' if entry['ok'] else 'FAILED'}"
            + ("" if entry["ok"] else f" {entry.get('error', entry)}"),
            flush=True,
        )
        return entry

    def finish(self) -> int:
        bad = [c["check"] for c in self.rec["checks"] if not c["ok"]]
        self.rec["status"] = "failed" if bad else "ok"
        self.rec["failed"] = bad
        self.write()
        return 1 if bad else 0


# ----------------------------------------------------------------------------- helpers
def _torch():
    import torch

    return torch


def _device():
    torch = _torch()
    if not torch.cuda.is_available():
        raise RuntimeError("no CUDA device")
    return torch.device("cuda", torch.cuda.current_device())


def _capability() -> int:
    major, minor = _torch().cuda.get_device_capability()
    return major * 10 + minor


def _spec(scheme: str, n: int, k: int, dtype=None):
    from vllm_mxplus.backends.base import LinearSpec

    return LinearSpec(
        scheme=scheme, n=n, k=k, out_dtype=dtype or _torch().bfloat16, device_type="cuda"
    )


def _layer_for(backend, scheme: str, n: int, k: int, seed: int = 0):
    """A bare module holding backend's runtime weights for a random [n, k] weight, and the
    weight's fp32 W_hat."""
    torch = _torch()
    from vllm_mxplus.formats import quantize

    g = torch.Generator(device="cpu").manual_seed(seed)
    w = (torch.randn(n, k, generator=g) * 0.02).to(_device())
    q = quantize(w, backend.spec.weight_format, macro_block=backend.spec.macro_block)
    layer = torch.nn.Module()
    backend.process_weights_after_loading(layer, q)
    return layer, q


def _resolve(ref):
    """A registry entry: the backend class, or "package.module:Class"."""
    if isinstance(ref, str):
        import importlib

        mod, _, cls = ref.partition(":")
        return getattr(importlib.import_module(mod), cls)
    return ref


def _cuda_backends(scheme: str, n: int, k: int, reference: bool = False) -> list:
    """Instances of every registered CUDA linear backend that runs here and can implement
    the layer (the self-test is the `served` step's business); the reference backend too
    when asked (it runs on CUDA where the others leave an M uncovered)."""
    from vllm_mxplus.backends import selection
    from vllm_mxplus.backends.reference.linear import ReferenceBackend

    cap = _capability()
    classes = [_resolve(r) for r in selection.registered_backends("cuda")]
    out = []
    for cls in classes + ([ReferenceBackend] if reference else []):
        spec = _spec(scheme, n, k)
        if cls.is_supported("cuda", cap)[0] and cls.can_implement(spec)[0]:
            out.append(cls(spec))
    return out


def _linear_dispatch_class():
    try:
        from vllm_mxplus.backends.linear_op import LinearDispatch
    except ImportError:
        from vllm_mxplus.backends.selection import LinearDispatch  # type: ignore[attr-defined,no-redef]
    return LinearDispatch


def _bits_equal(a, b) -> bool:
    torch = _torch()
    view = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[a.element_size()]
    return a.shape == b.shape and torch.equal(a.contiguous().view(view), b.contiguous().view(view))


def bench_ms(fn: Callable, rep: int = 30) -> float:
    from triton.testing import do_bench

    return float(do_bench(fn, warmup=5, rep=rep, return_mode="median"))


# ----------------------------------------------------------------------------- served
def step_served(st: Step) -> None:
    torch = _torch()
    from vllm_mxplus.backends import selection

    dev = _device()
    cap = _capability()
    st.rec["device"] = torch.cuda.get_device_name()
    st.rec["capability"] = cap
    n, k = 1024, 4096

    for scheme in SCHEMES:

        def select_one(scheme=scheme):
            chosen = selection.select(_spec(scheme, n, k), "cuda", cap, f"gpu_check {scheme}")
            names = [b.name for b in chosen]
            return {"chosen": names, "ok": bool(names)}

        st.check(f"select+selftest {scheme}", select_one)

    for scheme in ("mxfp4-mbs", "mxfp4-16-oas"):

        def compiled(scheme=scheme):
            from vllm_mxplus.backends.linear_op import register_layer
            from vllm_mxplus.formats import quantize

            LinearDispatch = _linear_dispatch_class()
            spec = _spec(scheme, n, k)
            chosen = selection.select(spec, "cuda", cap, "gpu_check compile")
            layer = torch.nn.Module()
            layer.prefix = f"gpu_check.{scheme}"
            dispatch = LinearDispatch(spec, chosen)
            g = torch.Generator(device="cpu").manual_seed(0)
            w = (torch.randn(n, k, generator=g) * 0.02).to(dev)
            q = quantize(w, spec.weight_format, macro_block=spec.macro_block)
            dispatch.process_weights_after_loading(layer, q)
            key = register_layer(layer, dispatch)
            bias = torch.randn(n, device=dev, dtype=torch.bfloat16)

            def f(x):
                return torch.ops.vllm_mxplus.linear_dispatch(x, bias, None, key)

            cf = torch.compile(f, dynamic=True, fullgraph=True)
            res = {}
            for m in CAPTURE_MS:
                x = torch.randn(m, k, device=dev, dtype=torch.bfloat16)
                res[f"M{m}"] = _bits_equal(cf(x), f(x))
            return {
                "equal_to_eager": res,
                "ok": all(res.values()),
                "backends": [b.name for b in chosen],
            }

        st.check(f"linear_dispatch torch.compile {scheme}", compiled)

    for scheme in ("mxfp4-mbs", "mxfp4-16-oas", "mxfp4-ocp"):
        for backend in _cuda_backends(scheme, n, k, reference=True):

            def captured(backend=backend, scheme=scheme):
                from vllm_mxplus.backends.graph_guard import cuda_graph_replay_mismatch

                layer, _ = _layer_for(backend, scheme, n, k)
                res = {}
                for m in CAPTURE_MS:
                    if not backend.supports_m(m):
                        continue
                    x = torch.randn(m, k, device=dev, dtype=torch.bfloat16)
                    fresh = torch.randn(m, k, device=dev, dtype=torch.bfloat16) * 3
                    bad = cuda_graph_replay_mismatch(
                        lambda t: backend.apply(layer, t, None), x, fresh
                    )
                    res[f"M{m}"] = bad or True
                ok = bool(res) and all(v is True for v in res.values())
                return {"replay_equals_eager": res, "ok": ok}

            st.check(f"cuda graph {backend.name} {scheme}", captured)

    def moe():
        from vllm_mxplus.backends import selection as sel

        try:
            experts = sel.registered_backends("cuda", "experts")  # type: ignore[call-arg]
        except TypeError:
            return {"skipped": "no expert kind in this selection API"}
        names = [c.name for c in map(_resolve, experts) if c.is_supported("cuda", cap)[0]]
        return {"cuda_expert_backends": names, "skipped": None if names else "none registered"}

    st.check("moe expert backends", moe)


# ----------------------------------------------------------------------------- correct
def _output_bound():
    try:
        from vllm_mxplus.backends.checks import output_bound  # type: ignore[import-not-found]
    except ImportError:
        from vllm_mxplus.backends.selftest import output_bound
    return output_bound


def step_correct(st: Step) -> None:
    torch = _torch()
    from vllm_mxplus.formats import fake_quantize

    dev = _device()
    bound_fn = _output_bound()
    for scheme in ("mxfp4-mbs", "mxfp4-16-oas"):
        for name, n, k in REAL_SHAPES:
            for backend in _cuda_backends(scheme, n, k):

                def one(backend=backend, scheme=scheme, n=n, k=k):
                    layer, q = _layer_for(backend, scheme, n, k, seed=n + k)
                    w64 = q.dequantize(torch.float32).to(torch.float64)
                    res, worst = {}, 0.0
                    for m in (1, 16, 512, 2048):
                        if not backend.supports_m(m):
                            continue
                        x = torch.randn(m, k, device=dev, dtype=torch.bfloat16)
                        y = backend.apply(layer, x, None).to(torch.float64)
                        xq = fake_quantize(
                            x.float(),
                            backend.spec.activation_format,
                            macro_block=backend.spec.macro_block,
                        ).to(torch.float64)
                        y64 = xq @ w64.T
                        a = xq.abs() @ w64.abs().T
                        b = bound_fn(
                            a,
                            y64,
                            torch.zeros(n, dtype=torch.float64, device=dev),
                            k,
                            torch.bfloat16,
                            type(backend).accumulator_bits,
                        )
                        err = (y - y64).abs()
                        res[f"M{m}"] = bool((err <= b).all())
                        worst = max(worst, float((err / b.clamp_min(1e-300)).max()))
                    return {
                        "within_bound": res,
                        "worst_err_over_bound": worst,
                        "ok": bool(res) and all(res.values()),
                    }

                st.check(f"{backend.name} {scheme} {name} {n}x{k}", one)


# ----------------------------------------------------------------------------- speed
def step_speed(st: Step) -> None:
    torch = _torch()
    import torch.nn.functional as F

    dev = _device()
    st.rec["device"] = torch.cuda.get_device_name()
    n, k = 4096, 4096  # the o projection of Llama-3-8B

    # 1. decode vs bf16
    for scheme in ("mxfp4-mbs", "mxfp4-16-oas"):
        for backend in _cuda_backends(scheme, n, k):
            if not backend.supports_m(1):
                continue

            def decode(backend=backend, scheme=scheme):
                layer, _ = _layer_for(backend, scheme, n, k)
                wb = torch.randn(n, k, device=dev, dtype=torch.bfloat16)
                res = {}
                for m in (1, 4, 16):
                    x = torch.randn(m, k, device=dev, dtype=torch.bfloat16)
                    t_q = bench_ms(lambda x=x: backend.apply(layer, x, None))
                    t_b = bench_ms(lambda x=x: F.linear(x, wb))
                    res[f"M{m}"] = {"ms": t_q, "bf16_ms": t_b, "speedup_vs_bf16": t_b / t_q}
                return {"shape": [n, k], "results": res}

            st.check(f"decode {backend.name} {scheme} vs bf16", decode)

    # 2. prefill MBS overhead, against the same FP8 GEMM without per-chunk scales
    def prefill_overhead():
        from vllm_mxplus.backends.cutlass import build as cb
        from vllm_mxplus.backends.cutlass.fp8_chunks import encode_fp8_chunks
        from vllm_mxplus.backends.cutlass.gemm import prepare_weight
        from vllm_mxplus.backends.cutlass.linear import CutlassPrefillBackend
        from vllm_mxplus.backends.cutlass.ops import fp8_chunk_gemm
        from vllm_mxplus.formats import quantize

        if cb.arch_of(dev) != "sm90a":
            return {"skipped": f"arch {cb.arch_of(dev)}: the FP8 comparison is sm_90a's"}
        res = {}
        for lname, nn, kk in REAL_SHAPES:
            for m in (1024, 4096):
                x = torch.randn(m, kk, device=dev, dtype=torch.bfloat16)
                w = torch.randn(nn, kk, device=dev) * 0.02
                qx = quantize(x.float(), "mxfp4-mbs-s")
                xl = encode_fp8_chunks(qx.codes, qx.scales, qx.mbs, kk)
                wl = prepare_weight(quantize(w, "mxfp4-mbs-d"), "sm90a").layout
                t_chunk = bench_ms(
                    lambda xl=xl, wl=wl: fp8_chunk_gemm(
                        xl.fp8, xl.scale, wl.fp8, wl.scale, None, torch.bfloat16
                    )
                )
                # the same FP8 operands, one scale per row / column over the whole K
                sa = xl.scale[0][:, None].contiguous()
                sb = wl.scale[0][None, :].contiguous()
                t_plain = bench_ms(
                    lambda xl=xl, wl=wl, sa=sa, sb=sb: torch._scaled_mm(
                        xl.fp8, wl.fp8.t(), scale_a=sa, scale_b=sb, out_dtype=torch.bfloat16
                    )
                )
                e2e = {}
                for scheme in ("mxfp4-mbs", "mxfp4-16-oas"):
                    be = CutlassPrefillBackend(_spec(scheme, nn, kk))
                    layer, _ = _layer_for(be, scheme, nn, kk)
                    e2e[scheme] = bench_ms(lambda be=be, layer=layer, x=x: be.apply(layer, x, None))
                res[f"{lname} M{m}"] = {
                    "chunk_scaled_gemm_ms": t_chunk,
                    "fp8_rowwise_gemm_ms": t_plain,
                    "per_chunk_scaling_overhead": t_chunk / t_plain - 1,
                    "e2e_mbs_ms": e2e["mxfp4-mbs"],
                    "e2e_no_mbs_ms": e2e["mxfp4-16-oas"],
                    "e2e_mbs_overhead": e2e["mxfp4-mbs"] / e2e["mxfp4-16-oas"] - 1,
                }
        return {"results": res}

    st.check("prefill MBS overhead vs the GEMM without MBS", prefill_overhead)

    # 3. act-quant bandwidth vs a copy
    def act_quant_bw():
        from vllm_mxplus.backends.triton.act_quant import act_quant

        res = {}
        for m in (16, 4096):
            x = torch.randn(m, 4096, device=dev, dtype=torch.bfloat16)
            for fmt in ("mxfp4-mbs-s", "mxfp4-16-oas"):
                t = bench_ms(lambda fmt=fmt, x=x: act_quant(x, fmt, macro_block=128))
                moved = x.numel() * 2 + x.numel() // 2 + x.numel() // 16 + x.numel() // 128
                res[f"{fmt} M{m}"] = {"ms": t, "GB_s": moved / t / 1e6}
            t_copy = bench_ms(lambda x=x: x.clone())
            res[f"copy M{m}"] = {"ms": t_copy, "GB_s": 2 * x.numel() * 2 / t_copy / 1e6}
        return {"results": res}

    st.check("act-quant bandwidth vs copy", act_quant_bw)

    def moe_speed():
        from vllm_mxplus.backends import selection as sel

        try:
            experts = [
                c
                for c in map(_resolve, sel.registered_backends("cuda", "experts"))  # type: ignore[call-arg]
                if c.is_supported("cuda", _capability())[0]
            ]
        except TypeError:
            experts = []
        if not experts:
            return {"skipped": "no CUDA expert backend registered"}
        return {
            "skipped": f"expert backends {[c.name for c in experts]}: no MoE timing yet",
            "ok": False,
        }

    st.check("moe vs bf16", moe_speed)


STEPS = {"served": step_served, "correct": step_correct, "speed": step_speed}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("step", nargs="?", choices=sorted(STEPS))
    ap.add_argument("--out", type=Path, default=Path(os.environ.get("OUT", "out")))
    ap.add_argument("--budget", type=int, default=DEFAULT_BUDGET)
    ap.add_argument("--dry-run", action="store_true")
    ap.add_argument("--boxes", action="store_true", help="print 'step seconds' lines")
    args = ap.parse_args(argv)
    if args.boxes:
        for name, box, _ in time_boxes(args.budget):
            print(name, box)
        return 0
    if args.dry_run or args.step is None:
        return dry_run(args.budget)
    st = Step(args.step, args.out)
    try:
        STEPS[args.step](st)
    except Exception as e:  # the step could not start (no CUDA, import error): recorded
        st.rec["error"] = f"{type(e).__name__}: {e}"
        st.rec["checks"].append({"check": "start", "ok": False, "error": st.rec["error"]})
    return st.finish()


if __name__ == "__main__":
    sys.exit(main())
