"""The Python side of scripts/gpu_check.sh: one step per call, its JSON under --out.

    python scripts/gpu_check.py --dry-run [--budget S]   # the plan and time boxes, no GPU
    python scripts/gpu_check.py STEP --out DIR           # STEP: served | speed | sweep |
                                                         #       stack | cutlass | correct
    GPU_CHECK_REHEARSE=1 python scripts/gpu_check.py STEP --out DIR
        # on a CPU, under TRITON_INTERPRET=1: the same checks on small shapes, CUDA graphs and
        # timings skipped (tests/kernels/test_gpu_check_rehearsal.py runs it, so that the
        # first GPU call does not fail on a stale API)

Each step writes DIR/<step>.json first with status "started", rewrites it after every check
(status "running", the checks so far), and last with "ok" or "failed"; gpu_check.sh marks a
file still "started"/"running" after its time box as "cut". A check that raises is recorded
as failed with its error, and the step goes on. The steps, most evidence first (the CUTLASS
build runs in the background meanwhile; until `cutlass`, VLLM_MXPLUS_BACKEND keeps the
Triton backends, so that a build finishing mid-step changes no choice):

  served   selection + first-use self-test on this device for every scheme: linears, and
           experts of every activation (silu, gelu, swigluoai) with and without biases
  speed    CUDA-graph replay timings, the L2 flushed before each: Llama-3-8B's four linears
           (act-quant included) per M against the same linears in bf16, beside the static
           estimate of the same case (benchmarks/results/gpu_static_model.json, made by
           `benchmarks/gpu_static_model.py --json`); act-quant against a bf16 copy; one
           expert's grouped GEMM at 64 tokens against bf16 beside its static estimate
  sweep    the replay floor; the 8B decode layer at VLLM_MXPLUS_GPU_PROGRAMS_PER_SM 2/3/4/8;
           the decode GEMM alone at each split-K x BLOCK_N x warps x stages (qkv and down at
           M 1 and 16, each case its own check), the replay floor, the FP8-chunk prefill's
           stages apart (mxfp4-mbs against mxfp4-16-oas), the 8B layer across the batched
           decode / prefill border (M 64 ... 512: decode path, served path, bf16), the MX+
           and NVFP4 layers' decode path against their mx_gemm path at M 1 / 4 / 16
  stack    a Llama-3-8B-shaped stack without attention (qkv, o, gate_up, down linears, an
           8-expert silu MoE layer, a gpt-oss-style swigluoai MoE layer with biases) under
           torch.compile, captured in CUDA graphs at M 1, 8, 16, 24, 64, 512: replay = eager
  cutlass  after the build: the prefill backend's self-test (random data within the
           accumulator bound, then exact-by-construction data bit for bit), FP8-subnormal and
           every-row-inexact probes at M 512, CUDA-graph capture, timing against bf16
  correct  every CUDA backend at Llama-3-8B shapes against float64, within the bound
"""

from __future__ import annotations

import argparse
import contextlib
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

REHEARSE = os.environ.get("GPU_CHECK_REHEARSE") == "1"
# vLLM's capture sizes: both ends and the borders (rehearsal: a decode and a prefill size)
CAPTURE_MS = (1, 24) if REHEARSE else (1, 8, 16, 24, 64, 512)
ALL_SCHEMES = ("mxfp4-mbs", "mxfp4-mbs-s", "mxfp4-mbs-h", "mxfp4-16-oas", "mxfp4-ocp", "mxplus")
ALL_SCHEMES += ("nvfp4",)
# GPU_CHECK_SCHEMES=a,b: only these (the rehearsal test's subset)
SCHEMES = tuple(s for s in os.environ.get("GPU_CHECK_SCHEMES", "").split(",") if s) or ALL_SCHEMES
# Llama-3-8B's linears (N, K); rehearsal: the same roles at toy sizes
REAL_SHAPES = (
    ("qkv", 6144, 4096),
    ("o", 4096, 4096),
    ("gate_up", 28672, 4096),
    ("down", 4096, 14336),
)
TOY_SHAPES = (("qkv", 384, 256), ("o", 256, 256), ("gate_up", 512, 256), ("down", 256, 256))
SHAPES = TOY_SHAPES if REHEARSE else REAL_SHAPES
HIDDEN = SHAPES[1][2]
# the MoE layers of the stack: experts, top-k, intermediate size
MOE = (4, 2, 64) if REHEARSE else (8, 2, 1024)
DECODE_MS, PREFILL_MS = (1, 8, 16), (32, 512, 4096)
# Until the `cutlass` step: the Triton backends only (CUTLASS is being built meanwhile)
TRITON_ONLY = (
    "linear:triton-decode,linear:triton-fp4-prefill,linear:triton-fp8-prefill,linear:triton-gemm,"
    "experts:triton-grouped"
)

# (step, time box in seconds at the default budget, what it does): gpu_check.sh reads this
PLAN = (
    ("prereq", 20, "python modules, nvcc, CUTLASS headers, the device"),
    ("build", 0, "CUTLASS extension for this arch, in the background from here until cutlass"),
    ("served", 60, "selection + self-test per scheme: linears first, then every expert kind"),
    (
        "speed",
        120,
        "graph-replay timings, L2 flushed: Llama-3-8B's linears per M against bf16 beside "
        "the static estimate; act-quant; one expert's GEMM at 64 tokens",
    ),
    (
        "sweep",
        90,
        "the replay floor, the decode layer per programs per SM, the decode GEMM alone per "
        "split-K x BLOCK_N x warps x stages (qkv, down; M 1, 16), the FP8-chunk prefill "
        "taken apart, MX+ / NVFP4 decode vs mx_gemm",
    ),
    (
        "stack",
        90,
        "8B-shaped stack (linears, MoE, gpt-oss MoE) under torch.compile, CUDA graphs at "
        "M 1/8/16/24/64/512, replay = eager",
    ),
    ("pytest_gpu", 70, "pytest: the Triton decode / x_hat tests on CUDA tensors, then -m gpu"),
    (
        "cutlass",
        80,
        "after the build: self-test (exact data), subnormal and inexact-row probes, "
        "capture, timing",
    ),
    ("correct", 0, "every CUDA backend at Llama-3-8B shapes vs float64, with what is left"),
)
DEFAULT_BUDGET = 570  # s: under the device tool's 600 s per call


def time_boxes(budget: int) -> list[tuple[str, int, str]]:
    """The plan's boxes scaled to `budget` (never above their default; 0: what is left)."""
    total = sum(box for _, box, _ in PLAN)
    scale = min(1.0, budget / total)
    return [(name, max(5, int(box * scale)) if box else 0, what) for name, box, what in PLAN]


def dry_run(budget: int) -> int:
    boxes = time_boxes(budget)
    print(f"[gpu_check] plan for a {budget} s budget (device tool: one call, 600 s at most)")
    for i, (name, box, what) in enumerate(boxes):
        print(f"  {i}. {name:<10} {box if box else '-':>4} s  {what}")
    print(
        f"  total of the boxes: {sum(b for _, b, _ in boxes)} s <= {budget} s "
        "(build: in the background; correct: what is left)"
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
    if REHEARSE:
        return torch.device("cpu")
    if not torch.cuda.is_available():
        raise RuntimeError("no CUDA device")
    return torch.device("cuda", torch.cuda.current_device())


def _capability() -> int:
    if REHEARSE:
        return 90
    major, minor = _torch().cuda.get_device_capability()
    return major * 10 + minor


def _linear_spec(scheme: str, n: int, k: int, dtype=None):
    from vllm_mxplus.backends.base import LinearSpec

    return LinearSpec(
        scheme=scheme, n=n, k=k, out_dtype=dtype or _torch().bfloat16, device_type=_device().type
    )


def _expert_spec(scheme: str, activation: str, bias: bool):
    from vllm_mxplus.backends.base import ExpertSpec

    return ExpertSpec(
        scheme=scheme, activation=activation, has_bias=bias, device_type=_device().type
    )


def _select(spec, where: str) -> list:
    from vllm_mxplus.backends import selection

    return selection.select(spec, "cuda", _capability(), where)


def _names(backends: list) -> list[str]:
    return [b.name for b in backends]


def _randn(*shape: int, seed: int, scale: float = 1.0, dtype=None):
    torch = _torch()
    g = torch.Generator(device="cpu").manual_seed(seed)
    t = torch.randn(*shape, generator=g) * scale
    return t.to(device=_device(), dtype=dtype or torch.float32)


class QLinear:
    """A quantized linear as vLLM builds it: the selected backends behind one
    `LinearDispatch` (the `linear_dispatch` op, one graph for every layer), weights quantized
    from a random [n, k] weight, a bf16 bias."""

    def __init__(self, scheme: str, n: int, k: int, seed: int, prefix: str):
        torch = _torch()
        from vllm_mxplus.backends.linear_op import LinearDispatch
        from vllm_mxplus.formats import quantize

        self.spec = _linear_spec(scheme, n, k)
        self.dispatch = LinearDispatch(self.spec, _select(self.spec, prefix))
        self.layer = torch.nn.Module()
        self.layer.prefix = prefix
        w = _randn(n, k, seed=seed, scale=k**-0.5)
        self.q = quantize(w, self.spec.weight_format, macro_block=self.spec.macro_block)
        self.dispatch.process_weights_after_loading(self.layer, self.q)
        self.bias = _randn(n, seed=seed + 1, scale=0.1, dtype=torch.bfloat16)
        self.w_bf16 = w.to(torch.bfloat16)

    def __call__(self, x):
        return self.dispatch.apply(self.layer, x, self.bias)

    @property
    def backends(self) -> list[str]:
        return _names(self.dispatch.candidates)


class QExperts:
    """A routed MoE layer: the selected expert backend(s), E experts of [2I, H] / [H, I]
    quantized as the FusedMoE method does, torch.topk routing (capturable)."""

    def __init__(self, scheme: str, activation: str, bias: bool, seed: int, prefix: str):
        torch = _torch()
        from vllm_mxplus.backends.base import ExpertWeights
        from vllm_mxplus.backends.expert_layer import expert_activation
        from vllm_mxplus.backends.selftest_experts import _quantized

        e, self.topk, inter = MOE
        h = HIDDEN
        self.spec = _expert_spec(scheme, activation, bias)
        self.backends = _select(self.spec, prefix)
        self.act = expert_activation(activation)
        w13 = _randn(e, 2 * inter, h, seed=seed, scale=h**-0.5).cpu()
        w2 = _randn(e, h, inter, seed=seed + 1, scale=inter**-0.5).cpu()
        q = {"w13": _quantized(w13, self.spec), "w2": _quantized(w2, self.spec)}
        dev = _device()
        weights = ExpertWeights(
            quantized=lambda stem: (q[stem].to(dev), e),
            dequantized=lambda stem: (
                q[stem]
                .dequantize(torch.float32)
                .reshape((w13 if stem == "w13" else w2).shape)
                .to(dev)
            ),
        )
        self.layer = torch.nn.Module()
        self.layer.expert_map = None
        self.layer.mxplus_row_global_scale = None
        if bias:
            self.layer.w13_bias = _randn(
                e, 2 * inter, seed=seed + 2, scale=0.1, dtype=torch.bfloat16
            )
            self.layer.w2_bias = _randn(e, h, seed=seed + 3, scale=0.1, dtype=torch.bfloat16)
        for b in self.backends:
            b.process_weights_after_loading(self.layer, weights)
        self.router = _randn(e, h, seed=seed + 4, scale=h**-0.5, dtype=torch.bfloat16)

        self.index = len(_EXPERTS)
        _EXPERTS.append(self)
        _experts_op()  # registered now, never while torch.compile traces

    def eager(self, x):
        torch = _torch()
        from vllm_mxplus.backends.selection import pick

        logits = (x @ self.router.t()).float()
        wts, ids = torch.topk(torch.softmax(logits, -1), self.topk, dim=-1)
        backend = pick(self.backends, x.shape[0])
        return backend.apply(self.layer, x, wts, ids.to(torch.int32), self.act)

    def __call__(self, x):
        """Through an opaque custom op, as vLLM's FusedMoE runs its experts: torch.compile
        never traces the routing or the backend's Python."""
        return _torch().ops.gpu_check.experts(x, self.index)


_EXPERTS: list[QExperts] = []
_OP: list = []


def _experts_op():
    """torch.ops.gpu_check.experts(x, index): QExperts number `index`, registered once."""
    if not _OP:
        torch = _torch()

        @torch.library.custom_op(
            "gpu_check::experts", mutates_args=(), schema="(Tensor x, int index) -> Tensor"
        )
        def experts(x, index):
            return _EXPERTS[index].eager(x)

        @experts.register_fake
        def _(x, index):
            return torch.empty_like(x)

        _OP.append(torch.ops.gpu_check.experts)
    return _OP[0]


@contextlib.contextmanager
def _env(name: str, value: str):
    """os.environ[name] = value inside the block, its previous state restored after."""
    prev = os.environ.get(name)
    os.environ[name] = value
    try:
        yield
    finally:
        if prev is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = prev


def _bits_equal(a, b) -> bool:
    torch = _torch()
    view = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[a.element_size()]
    return a.shape == b.shape and torch.equal(a.contiguous().view(view), b.contiguous().view(view))


_FLUSH: dict[str, Any] = {}
FLUSH_BYTES = 512 * 2**20  # several times the L2 (H200 50 MB, B200 126 MB)


def _flush_l2() -> None:
    """Read FLUSH_BYTES on the current stream, so that the next kernel finds none of its
    operands in L2 (a served step's weights come from HBM: 32 layers are GBs). A read, not a
    write: overwritten lines stay dirty in L2 and are written back during the timed replay
    (the first H200 run flushed with zero_ and carried ~10 us per replay)."""
    buf = _FLUSH.get("buf")
    if buf is None:
        buf = _FLUSH["buf"] = _torch().zeros(
            FLUSH_BYTES // 4, dtype=_torch().int32, device=_device()
        )
        _torch().cuda.synchronize()
    _FLUSH["sink"] = buf.amax()


def _graph_replay_ms(fn: Callable, x, reps: int = 20) -> float:
    """Median ms of one CUDA-graph replay of fn(x) (captured after an eager warm-up on a side
    stream, as vLLM does), the L2 flushed before each replay outside the timed events: what a
    served decode or prefill step costs, launch overhead excluded as in vLLM."""
    torch = _torch()
    from vllm_mxplus.backends.graph_guard import capture_graph

    graph, _ = capture_graph(fn, x)
    graph.replay()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        _flush_l2()
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return sorted(times)[len(times) // 2]


# ----------------------------------------------------------------------------- served
def step_served(st: Step) -> None:
    from vllm_mxplus.backends.expert_layer import EXPERT_ACTIVATIONS

    os.environ["VLLM_MXPLUS_BACKEND"] = TRITON_ONLY
    st.rec["device"] = str(_device()) if REHEARSE else _torch().cuda.get_device_name()
    st.rec["capability"] = _capability()
    n, k = SHAPES[1][1], SHAPES[1][2]
    for scheme in SCHEMES:  # the linears of every scheme first: what every model serves

        def linear(scheme=scheme):
            names = _names(_select(_linear_spec(scheme, n, k), f"gpu_check linear {scheme}"))
            return {"chosen": names, "ok": bool(names) and "reference" not in names}

        st.check(f"select+selftest linear {scheme}", linear)
    for scheme in SCHEMES:
        for act in EXPERT_ACTIVATIONS:
            for bias in (False, True):

                def experts(scheme=scheme, act=act, bias=bias):
                    spec = _expert_spec(scheme, act, bias)
                    names = _names(_select(spec, f"gpu_check experts {scheme} {act}"))
                    return {"chosen": names, "ok": bool(names) and "reference" not in names}

                st.check(f"select+selftest experts {scheme} {act} bias={bias}", experts)


# ----------------------------------------------------------------------------- stack
class Stack:
    """One Llama-3-8B-shaped decoder block without attention, then two MoE layers: x ->
    qkv -> (first HIDDEN columns) -> o (+x) -> gate_up -> silu*up -> down (+) -> silu MoE
    (+) -> gpt-oss-style swigluoai MoE with biases (+)."""

    def __init__(self, scheme: str):
        self.lin = {
            name: QLinear(scheme, n, k, seed=i * 10, prefix=f"stack.{name}")
            for i, (name, n, k) in enumerate(SHAPES)
        }
        self.moe = QExperts(scheme, "silu", False, seed=100, prefix="stack.moe")
        self.moe_oss = QExperts(scheme, "swigluoai", True, seed=200, prefix="stack.moe_oss")

    def __call__(self, x):
        torch = _torch()
        h = self.lin["qkv"](x)[..., : x.shape[-1]]
        x = x + self.lin["o"](h)
        g, u = self.lin["gate_up"](x).chunk(2, dim=-1)
        x = x + self.lin["down"](torch.nn.functional.silu(g) * u)[..., : x.shape[-1]]
        x = x + self.moe(x)
        return x + self.moe_oss(x)

    def backends(self) -> dict[str, list[str]]:
        out = {name: lin.backends for name, lin in self.lin.items()}
        out["moe"] = _names(self.moe.backends)
        out["moe_oss"] = _names(self.moe_oss.backends)
        return out


def step_stack(st: Step) -> None:
    torch = _torch()
    os.environ["VLLM_MXPLUS_BACKEND"] = TRITON_ONLY
    for scheme in [s for s in ("mxfp4-mbs", "nvfp4") if s in SCHEMES]:
        stack: dict[str, Any] = {}

        def build(scheme=scheme, stack=stack):
            stack["model"] = Stack(scheme)
            return {"backends": stack["model"].backends()}

        if not st.check(f"stack {scheme}: build (load + self-tests)", build)["ok"]:
            continue
        model = stack["model"]
        # Dynamo + AOTAutograd alone (no Inductor fusion of the bf16 glue, which moves
        # roundings and so 4-bit codes and top-k routes): bit for bit the eager stack. This
        # is where a custom op's fake, the hoisted layer keys or dynamic M would go wrong.
        traced = torch.compile(model.__call__, dynamic=True, fullgraph=True, backend="aot_eager")
        # Inductor, as vLLM compiles: captured below, its replay against its own eager runs
        compiled = torch.compile(model.__call__, dynamic=True, fullgraph=True)

        def compile_equal(traced=traced, model=model):
            res = {}
            for m in CAPTURE_MS:
                x = _randn(m, HIDDEN, seed=m, dtype=torch.bfloat16)
                res[f"M{m}"] = _bits_equal(traced(x), model(x))
            return {"traced_equals_eager": res, "ok": all(res.values())}

        st.check(f"stack {scheme}: torch.compile (aot_eager, dynamic M) = eager", compile_equal)

        def graphs(compiled=compiled, model=model):
            from vllm_mxplus.backends.graph_guard import cuda_graph_replay_mismatch

            if REHEARSE:
                return {"skipped": "rehearsal: no CUDA graphs on a CPU"}
            res = {}
            for m in CAPTURE_MS:
                x = _randn(m, HIDDEN, seed=m, dtype=torch.bfloat16)
                fresh = _randn(m, HIDDEN, seed=1000 + m, scale=3.0, dtype=torch.bfloat16)
                # the compiled stack captured, its input refilled, replayed: equal bit for bit
                # to the compiled stack run without the graph on the new input
                res[f"M{m}"] = cuda_graph_replay_mismatch(compiled, x, fresh) or True
            return {"replay_equals_eager": res, "ok": all(v is True for v in res.values())}

        st.check(f"stack {scheme}: CUDA graphs at M {CAPTURE_MS}", graphs)


# ----------------------------------------------------------------------------- speed
# M per scheme: decode (1, 16), the batched decode / prefill border (128, 256) and a prefill
# (4096) for the default scheme; the others at decode and one prefill size
SPEED_MS = {
    "mxfp4-mbs": (1, 16, 128, 256, 4096),
    "mxfp4-16-oas": (1, 16, 4096),
    "nvfp4": (1, 16, 4096),
    "mxplus": (1, 16),
}
STATIC_JSON = ROOT / "benchmarks" / "results" / "gpu_static_model.json"


def static_beside(static: dict | None, capability: int, scheme: str, m: int) -> dict | None:
    """The static model's estimate for the case the speed step times (Llama-3-8B's four
    linears at m rows, one layer: the model's whole-forward figure / its layer count), from
    `benchmarks/gpu_static_model.py --json` saved in STATIC_JSON: the default scheme at every
    M it models, the other formats' decode at M = 1. None where the model has no such case."""
    if not static:
        return None
    from benchmarks import gpu_static_model as gsm

    gpu = gsm.gpu_of(capability)
    layers = gsm.LAYERS
    if gpu is None:
        return None
    if scheme == "mxfp4-mbs":
        rows = [r for r in static.get("estimates", {}).get(gpu, []) if r["M"] == m]
    elif m == 1:
        rows = [
            r for r in static.get("decode_per_format_m1", {}).get(gpu, []) if r["format"] == scheme
        ]
    else:
        rows = []
    if not rows:
        return None
    r = rows[0]
    return {
        "gpu_modelled": gpu,
        "commit": static.get("commit"),
        "ms": r["estimate_ms"] / layers,
        "bf16_ms": r["bf16_estimate_ms"] / layers,
        "speedup_vs_bf16": r["speedup_vs_bf16"],
    }


def step_speed(st: Step) -> None:
    torch = _torch()
    import torch.nn.functional as F

    os.environ["VLLM_MXPLUS_BACKEND"] = TRITON_ONLY
    if REHEARSE:
        st.check("speed", lambda: {"skipped": "rehearsal: no timings on a CPU"})
        return
    st.rec["device"] = torch.cuda.get_device_name()
    static = json.loads(STATIC_JSON.read_text()) if STATIC_JSON.exists() else None
    st.rec["static_estimate_from"] = static and {
        k: static.get(k) for k in ("command", "commit", "triton")
    }
    bf16_ms: dict[tuple[str, int], float] = {}  # the bf16 linears, timed once per (role, M)
    for scheme, ms in SPEED_MS.items():
        if scheme not in SCHEMES:
            continue
        lins: dict[str, QLinear] = {}

        def load(scheme=scheme, lins=lins):
            for name, n, k in SHAPES:
                lins[name] = QLinear(scheme, n, k, seed=n, prefix=f"speed.{name}")
            return {"backends": {name: lin.backends for name, lin in lins.items()}}

        if not st.check(f"{scheme}: Llama-3-8B linears loaded", load)["ok"]:
            continue
        for m in ms:

            def timing(scheme=scheme, m=m, lins=lins):
                per, ours, bf16 = {}, 0.0, 0.0
                for name, _n, k in SHAPES:
                    lin = lins[name]
                    x = _randn(m, k, seed=m, dtype=torch.bfloat16)
                    t_q = _graph_replay_ms(lin, x)
                    if (name, m) not in bf16_ms:
                        bf16_ms[name, m] = _graph_replay_ms(
                            lambda t, w=lin.w_bf16, b=lin.bias: F.linear(t, w, b), x
                        )
                    per[name] = {"ms": t_q, "bf16_ms": bf16_ms[name, m],
                                 "backend": lin.dispatch.pick(m).name}  # fmt: skip
                    ours += t_q
                    bf16 += bf16_ms[name, m]
                res = {"M": m, "ms": ours, "bf16_ms": bf16, "speedup_vs_bf16": bf16 / ours,
                       "linears": per}  # fmt: skip
                est = static_beside(static, _capability(), scheme, m)
                if est is not None:
                    res["static_estimate"] = est
                    res["measured_over_estimate"] = ours / est["ms"]
                print(f"[gpu_check] speed {scheme} M={m}: {ours:.4f} ms, bf16 {bf16:.4f} ms, "
                      f"{bf16 / ours:.2f}x; static estimate "
                      + (f"{est['ms']:.4f} ms, {est['speedup_vs_bf16']:.2f}x" if est else "-"),
                      flush=True)  # fmt: skip
                return res

            st.check(
                f"{scheme} Llama-3-8B linears M={m} vs bf16 (graph replay, L2 flushed)", timing
            )
        lins.clear()
        torch.cuda.empty_cache()

    def act_quant_vs_copy():
        from vllm_mxplus.backends.triton.act_quant import act_quant

        res = {}
        for m in (16, 4096):
            x = _randn(m, HIDDEN, seed=m, dtype=torch.bfloat16)
            t_copy = _graph_replay_ms(lambda t: t.clone(), x)
            for fmt in ("mxfp4-mbs-s", "mxfp4-16-oas"):
                t = _graph_replay_ms(lambda t, fmt=fmt: act_quant(t, fmt, macro_block=128), x)
                res[f"{fmt} M{m}"] = {"ms": t, "copy_ms": t_copy, "over_copy": t / t_copy}
        return {"results": res}

    st.check("act-quant vs a bf16 copy (graph replay)", act_quant_vs_copy)
    st.check("one expert's w13 GEMM at 64 tokens vs bf16 (graph replay)", expert_gemm_vs_bf16)


def replay_floor() -> dict:
    """What a replay of one tiny kernel costs with the L2 flush: the floor under every
    per-linear figure (each of ours launches 2-5 kernels, bf16 one)."""
    torch = _torch()
    x = torch.zeros(16, device=_device())
    return {"ms": _graph_replay_ms(lambda t: t.add(1.0), x)}


# the sweep's cases: Llama-3-8B's qkv (N 6144, K 4096) and down (N 4096, K 14336); the launch
# options, the heuristics' first (BLOCK_N 128, 4 warps, Triton's 3 stages)
SWEEP_SHAPES = (("qkv", 6144, 4096), ("down", 4096, 14336))
SWEEP_SPLITS = (1, 2, 4, 8, 16)
SWEEP_BLOCK_NS = (128, 64, 32)
# 2: the slim tile (`decode_gemm.slim_tile`), timed as it launches: the weight as the dots' A
SWEEP_WARPS = (2, 4, 8)
SWEEP_STAGES = (3, 2)


def step_sweep(st: Step) -> None:
    """The decode and prefill kernels taken apart (each case its own check, so a cut box
    keeps what it measured): the replay floor, the decode GEMM per launch option, the
    FP8-chunk prefill's stages."""
    os.environ["VLLM_MXPLUS_BACKEND"] = TRITON_ONLY
    if REHEARSE:
        st.check("sweep", lambda: {"skipped": "rehearsal: no timings on a CPU"})
        return
    st.check("replay floor: one tiny kernel (graph replay)", replay_floor)
    st.check("decode layer per VLLM_MXPLUS_GPU_PROGRAMS_PER_SM (mxfp4-mbs, M 1 / 16)", layer_per_sm)
    st.check("decode layer with / without programmatic dependent launch (VLLM_MXPLUS_GPU_PDL)",
             layer_pdl)  # fmt: skip
    for shape in SWEEP_SHAPES:
        for m in (1, 16):
            st.check(f"decode sweep {shape[0]} M={m} (mxfp4-mbs)",
                     lambda shape=shape, m=m: decode_sweep_case(shape, m))  # fmt: skip
    st.check("prefill apart: FP8-chunk pipeline stages, mxfp4-mbs vs mxfp4-16-oas", prefill_apart)
    st.check(
        f"batched decode border: decode path vs served path vs bf16 at M {BORDER_MS} (8B layer)",
        border_case,
    )
    for scheme in ("mxplus", "nvfp4"):
        st.check(f"{scheme}: decode GEMM vs mx_gemm at M 1/4/16 (qkv)",
                 lambda scheme=scheme: decode_vs_mx_gemm(scheme))  # fmt: skip


SWEEP_PER_SM = (2, 3, 4, 8)  # VLLM_MXPLUS_GPU_PROGRAMS_PER_SM values (2: the default)
# batched decode sizes across the decode / prefill border (triton.linear.BATCHED_DECODE_MAX_M)
BORDER_MS = (64, 128, 192, 256, 384, 512)


def border_case() -> dict:
    """Where the decode GEMM should hand over to the prefill pipeline: Llama-3-8B's four
    linears (mxfp4-mbs, act-quant and bias included) at each of BORDER_MS rows on the decode
    path (the triton-decode backend's `apply`, which tiles any M), on the path the dispatch
    serves that M with, and in bf16; each the sum of the four CUDA-graph replays."""
    torch = _torch()
    import torch.nn.functional as F

    lins = [QLinear("mxfp4-mbs", n, k, seed=n, prefix=f"border.{name}") for name, n, k in SHAPES]
    res: dict[str, Any] = {}
    for m in BORDER_MS:
        row = {"decode_us": 0.0, "served_us": 0.0, "bf16_us": 0.0, "served_by": []}
        for lin in lins:
            x = _randn(m, lin.spec.k, seed=m, dtype=torch.bfloat16)
            dec = lin.dispatch.pick(1)
            row["decode_us"] += 1e3 * _graph_replay_ms(
                lambda t, lin=lin, dec=dec: dec.apply(lin.layer, t, lin.bias), x
            )
            row["served_us"] += 1e3 * _graph_replay_ms(lin, x)
            row["bf16_us"] += 1e3 * _graph_replay_ms(
                lambda t, lin=lin: F.linear(t, lin.w_bf16, lin.bias), x
            )
            row["served_by"].append(lin.dispatch.pick(m).name)
        row["decode_vs_bf16"] = row["bf16_us"] / row["decode_us"]
        row["served_vs_bf16"] = row["bf16_us"] / row["served_us"]
        res[f"M{m}"] = row
        print(f"[gpu_check] border M={m}: decode {row['decode_us']:.1f} us, served "
              f"{row['served_us']:.1f} us ({row['served_by'][0]}), bf16 {row['bf16_us']:.1f} us",
              flush=True)  # fmt: skip
    return res


def _layer_per_setting(variable: str, values: tuple[str, ...], tag: str) -> dict:
    """Llama-3-8B's four linears (mxfp4-mbs, the layer as served: act-quant, decode GEMM,
    split-K sum) at M 1 and 16, summed CUDA-graph replays, with `variable` at each of
    `values` (read when each graph is captured): {f"{tag}{value} M{m}_us": us}."""
    torch = _torch()
    lins = [QLinear("mxfp4-mbs", n, k, seed=n, prefix=f"{tag}.{name}") for name, n, k in SHAPES]
    res: dict[str, Any] = {}
    for value in values:
        with _env(variable, value):
            for m in (1, 16):
                total = 0.0
                for lin in lins:
                    x = _randn(m, lin.spec.k, seed=m, dtype=torch.bfloat16)
                    total += _graph_replay_ms(lin, x)
                res[f"{tag}{value} M{m}_us"] = 1e3 * total
    return res


def layer_per_sm() -> dict:
    """The decode layer with the split-K heuristic aiming at each of SWEEP_PER_SM programs
    per SM."""
    res = _layer_per_setting(
        "VLLM_MXPLUS_GPU_PROGRAMS_PER_SM", tuple(map(str, SWEEP_PER_SM)), "per_sm"
    )
    print(f"[gpu_check] decode layer per programs per SM: {res}", flush=True)
    return res


def layer_pdl() -> dict:
    """The decode layer with its GEMM a programmatic dependent launch (VLLM_MXPLUS_GPU_PDL=1,
    the default: sm_90+) and a plain one (=0): what the overlap saves per layer, against the
    LAUNCH_S per GEMM that the static model takes as hidden."""
    res = _layer_per_setting("VLLM_MXPLUS_GPU_PDL", ("1", "0"), "pdl")
    print(f"[gpu_check] decode layer with / without PDL: {res}", flush=True)
    return res


def decode_vs_mx_gemm(scheme: str) -> dict:
    """Where the decode GEMM should stop for a scheme whose per-row cost grows with M (MX+:
    its block-max terms per live row) or that has its own scales (NVFP4): the layer's
    decode path (`apply`) against its `mx_gemm` path on the same layer, qkv, M 1 / 4 / 16."""
    torch = _torch()
    _, n, k = SWEEP_SHAPES[0]
    lin = QLinear(scheme, n, k, seed=n, prefix=f"sweep.{scheme}")
    be = lin.dispatch.pick(1)
    res: dict[str, Any] = {"backend": be.name}
    for m in (1, 4, 16):
        x = _randn(m, k, seed=m, dtype=torch.bfloat16)
        res[f"M{m}"] = {
            "decode_us": 1e3 * _graph_replay_ms(lambda t: be.apply(lin.layer, t, None), x),
            "mx_gemm_us": 1e3
            * _graph_replay_ms(lambda t: be._apply_mx_gemm(lin.layer, t, None, None), x),
        }
    return res


def decode_sweep_case(shape: tuple[str, int, int], m: int) -> dict:
    """One linear's decode step taken apart (mxfp4-mbs, MBS-128, no bias): the activation
    quantizer alone, then the decode GEMM alone (its split-K sum and cast included) at the
    default launch, with the weight as either operand of the dots, and at each split-K x
    BLOCK_N x warps x stages; beside the time the packed
    weight takes to stream at the H200's published 4.8 TB/s. Which launch reaches the
    bandwidth is what the next kernel change needs to know."""
    torch = _torch()
    from vllm_mxplus.backends.triton.decode_gemm import (
        SLIM_NUM_WARPS,
        decode_gemm,
        small_weight_scales,
    )
    from vllm_mxplus.backends.triton.linear import weight_operands
    from vllm_mxplus.backends.triton.ops import act_quant_hat_op
    from vllm_mxplus.formats import get_scheme

    s = get_scheme("mxfp4-mbs")
    _, n, k = shape
    q = _sweep_weight(n, k)
    wc, ws, wm, _ = weight_operands(q)
    small = small_weight_scales(ws)
    nbytes = wc.numel() + ws.numel() + (0 if wm is None else wm.numel())
    x = _randn(m, k, seed=m, dtype=torch.bfloat16)
    xc, xs, xm, _, xh, xg = act_quant_hat_op(x, s.activation_format, macro_block=128)

    def gemm(t, **kw):
        return decode_gemm(xc, xs, xm, wc, ws, wm, k, None, torch.bfloat16, 16, xh,
                           x_sigma=xg, macro_block=128, w_small_scales=small, **kw)  # fmt: skip

    res: dict[str, Any] = {
        "weight_bytes": nbytes,
        "stream_us_at_4p8TBs": nbytes / 4.8e6,
        "act_quant_us": 1e3
        * _graph_replay_ms(
            lambda t: act_quant_hat_op(t, s.activation_format, macro_block=128)[4], x
        ),
        "default_us": 1e3 * _graph_replay_ms(gemm, x),
    }
    # the default launch with the weight as the dots' other operand (`weight_is_a`: the
    # static model's choice per GPU, checked here)
    for wa in (True, False):
        try:
            res[f"weight_a {wa}"] = 1e3 * _graph_replay_ms(lambda t, o=wa: gemm(t, weight_a=o), x)
        except Exception as e:  # a launch that fails to compile: recorded, go on
            res[f"weight_a {wa}"] = f"{type(e).__name__}: {str(e)[:120]}"
    for bn in SWEEP_BLOCK_NS:
        for warps in SWEEP_WARPS:
            for stages in SWEEP_STAGES:
                for sk in SWEEP_SPLITS:
                    key = f"bn{bn} w{warps} s{stages} sk{sk}"
                    opts = {"block_n": bn, "split_k": sk, "num_warps": warps, "num_stages": stages}
                    if warps == SLIM_NUM_WARPS:  # asked-for warps keep the default operands
                        opts["weight_a"] = True
                    try:
                        res[key] = 1e3 * _graph_replay_ms(lambda t, o=opts: gemm(t, **o), x)
                    except Exception as e:  # a launch that fails to compile: recorded, go on
                        res[key] = f"{type(e).__name__}: {str(e)[:120]}"
    times = {kk: v for kk, v in res.items() if kk.startswith("bn") and isinstance(v, float)}
    if times:
        best = min(times, key=times.get)
        res["best"] = [best, times[best]]
    print(f"[gpu_check] decode sweep {shape[0]} M={m}: act-quant {res['act_quant_us']:.1f} us, "
          f"default {res['default_us']:.1f} us, best {res.get('best')}, weight stream "
          f"{res['stream_us_at_4p8TBs']:.1f} us", flush=True)  # fmt: skip
    return res


_SWEEP_WEIGHTS: dict[tuple[int, int], Any] = {}


def _sweep_weight(n: int, k: int):
    """The sweep's mxfp4-mbs weight [n, k], quantized once per shape."""
    if (n, k) not in _SWEEP_WEIGHTS:
        from vllm_mxplus.formats import get_scheme, quantize

        w = _randn(n, k, seed=n, scale=k**-0.5)
        _SWEEP_WEIGHTS[n, k] = quantize(w, get_scheme("mxfp4-mbs").weight_format, macro_block=128)
    return _SWEEP_WEIGHTS[n, k]


APART_NKM = (6144, 4096, 4096)  # Llama-3-8B's qkv at M 4096
PACKED_M = 256  # prefill apart also times the packed-weight GEMM at this M


def prefill_apart() -> dict:
    """The FP8-chunk prefill pipeline of Llama-3-8B's qkv (N 6144, K 4096) at M 4096 taken
    apart, for mxfp4-mbs and mxfp4-16-oas (the first run measured the second 7x slower on
    the same pipeline): the activations' FP8 encoder (`act_fp8`), the weight's per-call FP8
    form, the Triton FP8 GEMM alone, and the whole backend, each replayed alone; the whole
    backend again with the weight's FP8 form held (VLLM_MXPLUS_FP8_WEIGHT_HELD=1); the
    packed-weight GEMM against the weight encode + FP8 GEMM at M and PACKED_M rows."""
    torch = _torch()
    from vllm_mxplus.backends.cutlass import act_fp8
    from vllm_mxplus.backends.cutlass.fp8_chunks import CHUNK
    from vllm_mxplus.backends.cutlass.fp8_packed_gemm import fp8_packed_gemm
    from vllm_mxplus.backends.cutlass.weight_fp8 import weight_fp8_chunks
    from vllm_mxplus.backends.triton.fp8_chunk_gemm import fp8_chunk_gemm
    from vllm_mxplus.formats import get_scheme

    n, k, m = APART_NKM
    res: dict[str, Any] = {}
    for scheme in ("mxfp4-mbs", "mxfp4-16-oas"):
        s = get_scheme(scheme)
        lin = QLinear(scheme, n, k, seed=n, prefix=f"apart.{scheme}")
        q = lin.q
        x = _randn(m, k, seed=m, dtype=torch.bfloat16)
        xl = act_fp8.act_quant_fp8_chunks_op(x, s.activation_format, CHUNK)
        w8, ws = weight_fp8_chunks(q.codes, q.scales, q.mbs, k, n)
        res[scheme] = {
            "backend": lin.dispatch.pick(m).name,
            "exact_rows": int(xl.exact_rows.sum()),
            "act_fp8_us": 1e3
            * _graph_replay_ms(
                lambda t, f=s.activation_format: act_fp8.act_quant_fp8_chunks_op(t, f, CHUNK).fp8, x
            ),
            "weight_fp8_us": 1e3
            * _graph_replay_ms(
                lambda t, q=q: weight_fp8_chunks(q.codes, q.scales, q.mbs, k, n)[0], x
            ),
            "fp8_gemm_us": 1e3
            * _graph_replay_ms(
                lambda t, xl=xl, w8=w8, ws=ws: fp8_chunk_gemm(
                    xl.fp8, xl.scale, w8, ws, None, torch.bfloat16
                ),
                x,
            ),
            "whole_us": 1e3 * _graph_replay_ms(lin, x),
        }
        # the packed-weight GEMM (each weight chunk re-encoded in registers) against the
        # per-call weight encode + FP8 GEMM it replaces, at M and at PACKED_M rows: the
        # crossover behind `gemm.PACKED_WEIGHT_MAX_M`
        for rows in sorted({m, min(PACKED_M, m)}):
            xr = x[:rows]
            xlr = act_fp8.act_quant_fp8_chunks_op(xr, s.activation_format, CHUNK)
            res[scheme][f"packed_gemm_m{rows}_us"] = 1e3 * _graph_replay_ms(
                lambda t, xl=xlr, q=q: fp8_packed_gemm(
                    xl.fp8, xl.scale, q.codes, q.scales, q.mbs, k, None, torch.bfloat16
                ),
                xr,
            )
            res[scheme][f"reencode_gemm_m{rows}_us"] = 1e3 * _graph_replay_ms(
                lambda t, xl=xlr, q=q: fp8_chunk_gemm(
                    xl.fp8, xl.scale, *weight_fp8_chunks(q.codes, q.scales, q.mbs, k, n), None,
                    torch.bfloat16,
                ),
                xr,
            )  # fmt: skip
        with _env("VLLM_MXPLUS_FP8_WEIGHT_HELD", "1"):  # the weight's FP8 form held from load
            held = QLinear(scheme, n, k, seed=n, prefix=f"apart.held.{scheme}")
            res[scheme]["whole_weight_held_us"] = 1e3 * _graph_replay_ms(held, x)
        print(f"[gpu_check] prefill apart {scheme}: {res[scheme]}", flush=True)
    return {"results": res}


def expert_gemm_vs_bf16() -> dict:
    """The E8M0 experts' grouped GEMM (`moe_decode_gemm`, mxfp4-mbs, MBS-128) for one expert
    of Llama-3-8B's w13 shape (2 x 14336 x 4096) at 64 tokens routed to it, against the same
    GEMM in bf16, beside `benchmarks/gpu_static_model.py`'s static estimate of the same case."""
    torch = _torch()
    import torch.nn.functional as F

    from benchmarks import gpu_static_model as gsm
    from vllm_mxplus.backends.triton.decode_gemm import small_weight_scales
    from vllm_mxplus.backends.triton.linear import weight_operands
    from vllm_mxplus.backends.triton.moe_decode import moe_decode_gemm
    from vllm_mxplus.backends.triton.moe_gemm import moe_align, moe_block_m
    from vllm_mxplus.backends.triton.ops import act_quant_hat_op
    from vllm_mxplus.formats import get_scheme, quantize

    s, tokens, n, k = get_scheme("mxfp4-mbs"), 64, 2 * 14336, 4096
    w = _randn(n, k, seed=7, scale=0.02)
    q = quantize(w, s.weight_format, macro_block=128)
    codes, scales, mbs, _ = weight_operands(q)
    x = _randn(tokens, k, seed=8, dtype=torch.bfloat16)
    ids = torch.zeros((tokens, 1), dtype=torch.long, device=x.device)  # every token: expert 0
    block_m = moe_block_m(tokens, 1, wide=True)
    pairs, tile_expert = moe_align(ids, None, 1, block_m)
    small = small_weight_scales(scales)

    def ours(t):
        _, _, x_mbs, _, x_hat, _ = act_quant_hat_op(t, s.activation_format, macro_block=128)
        return moe_decode_gemm(
            x_hat, x_mbs, (codes, scales, mbs), pairs, tile_expert, experts=1, n=n, k=k,
            num_pairs=tokens, topk=1, out_dtype=torch.bfloat16, block_size=16,
            macro_block=128, block_m=block_m, w_small_scales=small,
        )  # fmt: skip

    w_bf16 = w.to(torch.bfloat16)
    t_q = _graph_replay_ms(ours, x)
    t_b = _graph_replay_ms(lambda t: F.linear(t, w_bf16), x)
    res = {"ms": t_q, "bf16_ms": t_b, "speedup_vs_bf16": t_b / t_q, "block_m": block_m}
    gpu = gsm.gpu_of(_capability())
    if gpu is not None:  # the static estimate of the same case, for the model's check
        name = gsm.EXPERT_CASES["decode kernel"]
        role, unit, drive = gsm._cases()[name]
        counts = {name: gsm.count(name, role, unit, drive, _capability())}
        res["static_estimate"] = gsm.experts_vs_bf16(counts, gpu, tokens)
    return res


# ----------------------------------------------------------------------------- cutlass
def step_cutlass(st: Step) -> None:
    torch = _torch()
    from vllm_mxplus.backends.cutlass import build as cb
    from vllm_mxplus.backends.cutlass.linear import CutlassPrefillBackend

    os.environ.pop("VLLM_MXPLUS_BACKEND", None)
    if REHEARSE:
        st.check("cutlass", lambda: {"skipped": "rehearsal: the extension needs a GPU"})
        return
    ok, why = cb.is_available()
    st.rec["available"] = [ok, why]
    if not ok:
        st.check("cutlass available", lambda: {"ok": False, "error": why})
        return
    from vllm_mxplus.backends import selftest

    for scheme in ("mxfp4-mbs", "mxfp4-16-oas"):
        spec = _linear_spec(scheme, 256, 4096)

        def self_test(spec=spec):
            why = selftest.run_self_test(CutlassPrefillBackend, spec, _device())
            return {"ok": why is None, "error": why}

        st.check(
            f"cutlass self-test {scheme} (random within bound, exact data bit for bit)", self_test
        )

    def probes():
        from vllm_mxplus.formats import quantize

        be = CutlassPrefillBackend(_linear_spec("mxfp4-mbs", 512, 4096))
        layer = torch.nn.Module()
        w = _randn(512, 4096, seed=5, scale=2**-6)
        q = quantize(w, be.spec.weight_format, macro_block=be.spec.macro_block)
        be.process_weights_after_loading(layer, q)
        w64 = q.dequantize(torch.float32).double()
        res = {}
        # every row outside the FP8 span (a block 20 binades under its chunk) at M = 512;
        # and rows of FP8 subnormals (blocks 8-11 binades under their chunk's top)
        for name, shift in (("every row inexact", -20.0), ("FP8 subnormals", -9.0)):
            x = _randn(512, 4096, seed=7).float()
            x[:, 16:32] *= 2.0**shift
            x = x.to(torch.bfloat16)
            y = be.apply(layer, x, None).double()
            xq = quantize(x.float(), be.spec.activation_format, macro_block=128)
            y64 = xq.dequantize(torch.float32).double() @ w64.t()
            rel = float((y - y64).abs().max() / y64.abs().max())
            res[name] = {"max_rel_err": rel, "nan_rows": int(torch.isnan(y).any(-1).sum())}
        ok = all(r["nan_rows"] == 0 and r["max_rel_err"] < 2**-7 for r in res.values())
        return {"results": res, "ok": ok}

    st.check("cutlass probes at M 512 (inexact rows, FP8 subnormals)", probes)

    def capture_and_time():
        import torch.nn.functional as F

        from vllm_mxplus.backends.graph_guard import cuda_graph_replay_mismatch

        res = {}
        for name, n, k in SHAPES:
            lin = QLinear("mxfp4-mbs", n, k, seed=n, prefix=f"cutlass.{name}")
            for m in (32, 512, 4096):
                x = _randn(m, k, seed=m, dtype=torch.bfloat16)
                fresh = _randn(m, k, seed=m + 1, scale=3.0, dtype=torch.bfloat16)
                bad = cuda_graph_replay_mismatch(lin, x, fresh)
                t_q = _graph_replay_ms(lin, x)
                t_b = _graph_replay_ms(lambda t, w=lin.w_bf16, b=lin.bias: F.linear(t, w, b), x)
                res[f"{name} M{m}"] = {
                    "replay_equals_eager": bad or True,
                    "backend": lin.dispatch.pick(m).name,
                    "ms": t_q,
                    "bf16_ms": t_b,
                    "speedup_vs_bf16": t_b / t_q,
                }
        return {"results": res, "ok": all(r["replay_equals_eager"] is True for r in res.values())}

    st.check("cutlass capture + timing vs bf16", capture_and_time)


# ----------------------------------------------------------------------------- correct
def step_correct(st: Step) -> None:
    torch = _torch()
    from vllm_mxplus.backends.checks import output_bound
    from vllm_mxplus.backends.selftest import accumulator_bits_of
    from vllm_mxplus.formats import fake_quantize

    os.environ.pop("VLLM_MXPLUS_BACKEND", None)
    dev = _device()
    for scheme in [s for s in ("mxfp4-mbs", "mxfp4-16-oas", "nvfp4", "mxplus") if s in SCHEMES]:
        for name, n, k in SHAPES:

            def one(scheme=scheme, name=name, n=n, k=k):
                lin = QLinear(scheme, n, k, seed=n + k, prefix=f"correct.{name}")
                w64 = lin.q.dequantize(torch.float32).to(torch.float64)
                res, worst = {}, 0.0
                for m in (1, 16, 512) if not REHEARSE else (1, 17):
                    backend = lin.dispatch.pick(m)
                    x = _randn(m, k, seed=m, dtype=torch.bfloat16)
                    y = backend.apply(lin.layer, x, None).to(torch.float64)
                    xq = fake_quantize(
                        x.float(),
                        lin.spec.activation_format,
                        macro_block=lin.spec.macro_block,
                        per_row=lin.spec.activation_per_row,
                    ).to(torch.float64)
                    y64 = xq @ w64.T
                    a = xq.abs() @ w64.abs().T
                    bits = accumulator_bits_of(type(backend), dev)
                    b = output_bound(a, y64, torch.zeros(n, dtype=torch.float64, device=dev), k,
                                     torch.bfloat16, bits, type(backend).accumulation_chunk)  # fmt: skip
                    err = (y - y64).abs()
                    res[f"M{m} {backend.name}"] = bool((err <= b).all())
                    worst = max(worst, float((err / b.clamp_min(1e-300)).max()))
                return {"within_bound": res, "worst_err_over_bound": worst, "ok": all(res.values())}

            st.check(f"{scheme} {name} {n}x{k} vs float64", one)


STEPS = {
    "served": step_served,
    "stack": step_stack,
    "speed": step_speed,
    "sweep": step_sweep,
    "cutlass": step_cutlass,
    "correct": step_correct,
}


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
