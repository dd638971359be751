"""One quantized linear on CPU: the cpu-packed backend (C++ integer-dot-product GEMM) vs bf16
F.linear (and, with --reference, the pure-torch reference backend), in one run.

    python benchmarks/bench_cpu_linear.py [--scheme mxfp4-mbs] [--model smollm2|llama8b|all]
                                          [--m 1,4,16,64,256,1024] [--threads N] [--reference]
                                          [--min-iters 5] [--min-time 0.3] [--macro-block N]
                                          [--exact-bf16]

For each linear shape (N, K) of the model and each row count M it prints the median wall
time of:
  bf16      torch.nn.functional.linear on bf16 weights (the unquantized baseline; oneDNN)
  vllm      what vLLM's CPU backend runs for the same bf16 linear (its
            dispatch_cpu_unquantized_gemm: oneDNN's GEMM on a weight it packs once, AMX's
            sgl-kernel for small weights on AMX hosts, zentorch where installed): the
            baseline a served bf16 model has (nan without vLLM)
  fp32      the same on fp32 weights and activations (the stronger baseline on a CPU without
            avx512_bf16 / AMX, where bf16 F.linear converts to fp32 on the fly)
  packed    CpuPackedBackend.apply (packed FP4 weight: activation quantization + integer GEMM)
  reference ReferenceBackend.apply (fp32 dequantized weight, torch fake-quant; --reference)
  exact     the exact-bf16 path of cpu-packed (backends/cpu/exact_bf16.py; --exact-bf16): the
            one AMX hosts take from exact_bf16.MIN_M rows (E8M0 on AMX-INT8 from
            INT8_MIN_M), timed here whatever the host (on a CPU without
            native bf16 its GEMM is a plain fp32 one), with the ratios bf16/exact and
            packed/exact; next to it `int`, cpu-packed's integer kernels whatever M (int/exact
            >= 1: the exact path is faster than them), and on AMX hosts for E8M0 weights
            `held`, the bf16 tile GEMM on B tiles held as a bf16 copy (2 bytes per weight)
            instead of decoded per call from the packed codes, and `tiles`, the bf16 tile
            GEMM on the packed codes (where E8M0 weights run on AMX-INT8 tiles, `exact` is
            that int8 linear: tiles/exact >= 1 says it is faster), and `decoded`, that int8
            linear with its tiles decoded per call instead of held from load
            (VLLM_MXPLUS_CPU_INT8_HELD=0; decoded/exact >= 1: holding them is faster)
and the ratios bf16/packed, vllm/packed and fp32/packed (>= 1: packed is faster). The data are
random (weights N(0, 0.02^2), rows N(0, 1)) unless --real-layer L: then SmolLM2's own layer L,
its weights (q|k|v and gate|up stacked as vLLM stacks them) and the rows each linear reads on
the first 1,024 tokens of the embedded calibration text (`mxplus prepare`; the first M rows
per M), where outlier channels spread block scales as random rows do not. With --macro-block N (an MBS
scheme; `mxplus quantize --macro-block`) packed uses macro blocks of N and the packed kernel
at 128 is timed next to it (column `packed128`, ratio `N/128` = its time over 128's: the cost
of the smaller macro blocks). The caches: by default they are evicted before each timed call;
--stream instead rotates over copies of every weight (per timed kind, enough copies for twice
the L3), so each call reads its weight from memory while the previous call's traffic is
still in flight, as a model larger than the caches does step after step; --warm keeps one
copy (in cache where it fits). Weight bytes per element:
bf16 2, reference 4, packed ~0.57. The CPU model, its SIMD flags and the load average (before
and after) are printed: on a shared machine only the ratios measured in one run mean much.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import platform
import statistics
import time

import torch

from vllm_mxplus.platform_amx import cpu_flags, cpu_model_name, read_cpuinfo

SHAPES = {
    # SmolLM2-135M: qkv, o, gate_up, down (hidden 576, FFN 1536, 9 + 3 + 3 heads of 64)
    "smollm2": [(960, 576), (576, 576), (3072, 576), (576, 1536)],
    # Llama-3.1-8B: qkv, o, gate_up, down
    "llama8b": [(6144, 4096), (4096, 4096), (28672, 4096), (4096, 14336)],
}
SHAPE_NAMES = ("qkv", "o", "gate_up", "down")  # the order of each model's SHAPES


_FLUSH: list[torch.Tensor] = []


def _l3_bytes() -> int:
    """The last-level cache of cpu0 (sysfs), 32 MiB if it cannot be read."""
    try:
        size = open("/sys/devices/system/cpu/cpu0/cache/index3/size").read().strip()  # noqa: SIM115
        return int(size[:-1]) << {"K": 10, "M": 20}[size[-1]]
    except (OSError, ValueError, KeyError):
        return 32 << 20


def _flush_caches() -> None:
    """Write twice the L3 (at least 96 MiB, at most 1 GiB) so the next call reads its weights
    from DRAM, as in a model whose weights exceed the caches (each layer's are read once per
    step)."""
    if not _FLUSH:
        nbytes = min(max(2 * _l3_bytes(), 96 << 20), 1 << 30)
        _FLUSH.append(torch.empty(nbytes // 4, dtype=torch.float32))
    _FLUSH[0].fill_(1.0)


def _medians_us(
    fns: list, cold: bool, min_time: float = 0.3, min_iters: int = 5, clock=time.perf_counter
) -> list[float]:
    """Median time of each callable, timed in alternation (a, b, c, a, b, c, ...) so that
    load from other processes on a shared machine falls on all of them alike. `clock`:
    time.perf_counter (wall) or time.thread_time (this thread's CPU time: with one torch
    thread, the time the call ran, without the time other processes held the core)."""
    for fn in fns:
        fn()
    times: list[list[float]] = [[] for _ in fns]
    t_end = time.perf_counter() + min_time * len(fns)
    while len(times[0]) < min_iters or time.perf_counter() < t_end:
        for fn, ts in zip(fns, times):
            if cold:
                _flush_caches()
            t0 = clock()
            fn()
            ts.append(clock() - t0)
    return [statistics.median(ts) * 1e6 for ts in times]


def cpu_description() -> str:
    """The CPU model and the flags that matter for these kernels (from /proc/cpuinfo)."""
    model = cpu_model_name(platform.processor() or platform.machine())
    flags = cpu_flags(read_cpuinfo()) or set()
    keep = (
        "avx2",
        "avx_vnni",
        "avx512f",
        "avx512bw",
        "avx512_vnni",
        "avx512vbmi",
        "avx512_bf16",
        "amx_bf16",
        "amx_int8",
        "amx_tile",
    )
    return f"{model} [{' '.join(f for f in keep if f in flags)}]"


def _copies(nbytes: int) -> int:
    """--stream: how many copies of an `nbytes` weight make a rotation that misses the L3
    (twice its size, at least 2)."""
    return max(2, -(-2 * _l3_bytes() // max(1, nbytes)))


def _rotating(items: list, call):
    """A callable that runs `call(item)` on the next of `items` each time (round robin)."""
    state = {"i": 0}

    def run():
        item = items[state["i"] % len(items)]
        state["i"] += 1
        return call(item)

    return run


def _vllm_bf16_linear(w_bf16: torch.Tensor):
    """The GEMM vLLM's CPU backend serves this bf16 weight with (its own dispatch, the
    weight kept), as a callable x -> y; None without vLLM."""
    try:
        from vllm.model_executor.layers.utils import dispatch_cpu_unquantized_gemm
    except ImportError:
        return None
    layer = torch.nn.Module()
    layer.weight = torch.nn.Parameter(w_bf16, requires_grad=False)
    dispatch_cpu_unquantized_gemm(layer, remove_weight=False)
    return lambda x: layer.cpu_linear(x, layer.weight, None)


def machine_line(*extra: str) -> str:
    """The `machine :` banner line of the CPU benchmarks, then `extra` fields."""
    fields = [
        f"machine : {cpu_description()} cores={os.cpu_count()}",
        f"torch_threads={torch.get_num_threads()}",
        f"OMP_NUM_THREADS={os.environ.get('OMP_NUM_THREADS', '-')}",
        f"load={os.getloadavg()}",
    ]
    return " ".join(fields + list(extra))


REAL_ROWS = 1024  # --real-layer: tokens of the calibration text run through SmolLM2


def _real_operands(layer: int) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """SHAPE_NAMES -> (fp32 weight [N, K], fp32 rows [REAL_ROWS, K]) of the embedded SmolLM2's
    decoder layer `layer`: the rows each of its linears reads (forward pre-hooks) on one window
    of the calibration text."""
    from transformers import AutoModelForCausalLM

    from vllm_mxplus.assets import prepare_smollm2
    from vllm_mxplus.calibration.data import calibration_tokens

    path = prepare_smollm2()
    model = AutoModelForCausalLM.from_pretrained(str(path), torch_dtype=torch.bfloat16)
    layers = model.model.layers
    if not 0 <= layer < len(layers):
        raise SystemExit(f"--real-layer {layer}: SmolLM2 has layers 0..{len(layers) - 1}")
    blk = layers[layer]
    lin = {"q": blk.self_attn.q_proj, "k": blk.self_attn.k_proj, "v": blk.self_attn.v_proj,
           "o": blk.self_attn.o_proj, "gate": blk.mlp.gate_proj, "up": blk.mlp.up_proj,
           "down": blk.mlp.down_proj}  # fmt: skip
    rows: dict[str, torch.Tensor] = {}
    hooks = [
        mod.register_forward_pre_hook(
            lambda _m, a, name=name: rows.__setitem__(name, a[0].reshape(-1, a[0].shape[-1]))
        )
        for name, mod in lin.items()
    ]
    ids = calibration_tokens(path, nsamples=1, seqlen=REAL_ROWS)
    with torch.no_grad():
        model(ids)
    for h in hooks:
        h.remove()

    def w(*names: str) -> torch.Tensor:
        return torch.cat([lin[n].weight.detach().float() for n in names])

    return {
        "qkv": (w("q", "k", "v"), rows["q"].float()),
        "o": (w("o"), rows["o"].float()),
        "gate_up": (w("gate", "up"), rows["gate"].float()),
        "down": (w("down"), rows["down"].float()),
    }


def _linear_spec(spec_cls: type, scheme: str, n: int, k: int, macro_block: int):
    """A LinearSpec for one bf16-output linear, whether the spec carries the macro block itself
    or inside its Scheme (`get_scheme(name, macro_block=...)`)."""
    if "macro_block" in {f.name for f in dataclasses.fields(spec_cls)}:
        return spec_cls(scheme=scheme, n=n, k=k, out_dtype=torch.bfloat16, macro_block=macro_block)
    from vllm_mxplus.formats import MACRO_BLOCK, get_scheme

    macro = None if macro_block == MACRO_BLOCK else macro_block
    return spec_cls(scheme=get_scheme(scheme, macro), n=n, k=k, out_dtype=torch.bfloat16)


def _held_tiles(exact_bf16, q, scheme):
    """The exact path's weight with its B tiles held as a bf16 copy (2 bytes per weight; the
    layout E8M0 weights had before they were decoded from their packed codes per task)."""
    w = exact_bf16.ExactBf16Weight.from_quantized(q, scheme, tiles=True, int8=False)
    rows = exact_bf16._pad_to(w._untiled(0, w.n).float(), exact_bf16.TILE_PAD, w.kp_tiles)
    w.tiles = exact_bf16.amx_pack(rows.to(torch.bfloat16))
    w.packed = None
    return w


def main() -> int:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--scheme", default="mxfp4-mbs")
    ap.add_argument("--model", default="smollm2", choices=[*SHAPES, "all"])
    ap.add_argument("--m", default="1,4,16,64,256,1024", help="comma-separated row counts")
    ap.add_argument(
        "--shapes",
        default=",".join(SHAPE_NAMES),
        help=f"comma-separated subset of {','.join(SHAPE_NAMES)} (default: all)",
    )
    ap.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    ap.add_argument("--min-iters", type=int, default=5, help="timed calls per backend, at least")
    ap.add_argument(
        "--min-time", type=float, default=0.3, help="seconds per backend per row, at least"
    )
    ap.add_argument(
        "--clock",
        default="wall",
        choices=["wall", "cpu"],
        help="wall time (default) or this thread's CPU time (--threads 1 only: on a shared "
        "machine it leaves out the time other processes held the core)",
    )
    ap.add_argument(
        "--warm",
        action="store_true",
        help="keep the weights in cache between calls (default: evict the caches "
        "before each timed call, as serving a model larger than L3 does)",
    )
    ap.add_argument(
        "--stream",
        action="store_true",
        help="rotate over copies of each weight (twice the L3 per timed kind) instead of "
        "evicting the caches: each call streams its weight from memory, as serving does",
    )
    ap.add_argument(
        "--macro-block",
        type=int,
        default=128,
        metavar="N",
        help="MBS macro block of the packed layer (default 128; else 128 is timed too)",
    )
    ap.add_argument(
        "--real-layer",
        type=int,
        default=None,
        metavar="L",
        help="SmolLM2's own weights and activations of decoder layer L instead of random data "
        f"(--model smollm2, M <= {REAL_ROWS}; needs `mxplus prepare`)",
    )
    for flag, what in (
        ("--exact-bf16", "the exact-bf16 path (the large-M path of AMX hosts) on this CPU"),
        ("--reference", "the reference backend (fp32 weight copy; slow at large M)"),
    ):
        ap.add_argument(flag, action="store_true", help=f"also time {what}")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.clock == "cpu" and torch.get_num_threads() != 1:
        raise SystemExit("--clock cpu times one thread: pass --threads 1")
    clock = time.thread_time if args.clock == "cpu" else time.perf_counter

    from vllm_mxplus.backends.base import LinearSpec
    from vllm_mxplus.backends.cpu import kernels as cpu_kernels
    from vllm_mxplus.backends.cpu.linear import CpuPackedBackend, cpu_linear
    from vllm_mxplus.backends.reference.linear import ReferenceBackend
    from vllm_mxplus.formats import MACRO_BLOCK, quantize

    ok, why = cpu_kernels.load()
    if not ok:
        raise SystemExit(f"CPU kernels unavailable: {why}")
    print(machine_line(f"torch_cpu={torch.backends.cpu.get_cpu_capability()}"))
    print(
        f"versions: torch {torch.__version__}; scheme {args.scheme}; build {cpu_kernels.build_name()}"
    )
    if args.warm and args.stream:
        raise SystemExit("--warm and --stream exclude each other")
    cold = not (args.warm or args.stream)
    caches = (
        "warm (weights stay cached)"
        if args.warm
        else f"streamed (copies of each weight rotated, >= 2x L3 of {_l3_bytes() >> 20} MiB)"
        if args.stream
        else "evicted before each call"
    )
    print(f"caches  : {caches}")
    print(f"clock   : {'thread CPU time' if args.clock == 'cpu' else 'wall time'}")
    models = list(SHAPES) if args.model == "all" else [args.model]
    ms = [int(v) for v in args.m.split(",")]
    real = None
    if args.real_layer is not None:
        if models != ["smollm2"] or max(ms) > REAL_ROWS:
            raise SystemExit(f"--real-layer needs --model smollm2 and --m <= {REAL_ROWS}")
        real = _real_operands(args.real_layer)
        print(f"data    : SmolLM2 layer {args.real_layer}, its weights and its rows on the "
              "calibration text")  # fmt: skip
    print(
        f"{'model':8s} {'N':>6s} {'K':>6s} {'M':>4s} {'bf16 us':>9s} {'vllm us':>9s} "
        f"{'fp32 us':>9s} {'ref us':>9s} {'packed us':>9s} {'bf16/packed':>11s} "
        f"{'vllm/packed':>11s} {'fp32/packed':>11s} {'ref/packed':>10s}"
        + (f" {'packed128':>9s} {'N/128':>6s}" if args.macro_block != 128 else "")
        + (
            f" {'exact us':>9s} {'bf16/exact':>10s} {'packed/exact':>12s} {'int us':>9s} "
            f"{'int/exact':>9s} {'held us':>9s} {'held/exact':>10s} {'tiles us':>9s} "
            f"{'tiles/exact':>11s} {'decoded us':>10s} {'decoded/exact':>13s}"
            if args.exact_bf16
            else ""
        )
    )
    g = torch.Generator().manual_seed(0)
    kinds = [
        "bf16",
        "vllm",
        "fp32",
        "packed",
        "p128",
        "ref",
        "exact",
        "int",
        "held",
        "tiles",
        "decoded",
    ]
    tot = dict.fromkeys(kinds, 0.0)
    for model in models:
        for name, (n, k) in zip(SHAPE_NAMES, SHAPES[model]):
            if name not in args.shapes.split(","):
                continue
            w = torch.randn(n, k, generator=g) * 0.02 if real is None else real[name][0]
            spec = _linear_spec(LinearSpec, args.scheme, n, k, args.macro_block)
            q = quantize(w, spec.weight_format, macro_block=args.macro_block)
            packed = CpuPackedBackend(spec)
            ok, why = packed.can_implement(spec)
            if not ok:
                raise SystemExit(why)

            def layer_of(backend, qw):
                layer = torch.nn.Module()
                backend.process_weights_after_loading(layer, qw)
                return layer

            # per timed kind: (make one copy of the weight, bytes per copy, call(copy, x, xf))
            makers: dict = {
                "bf16": (
                    lambda: w.to(torch.bfloat16),
                    2,
                    lambda wb, x, xf: torch.nn.functional.linear(x, wb),
                ),
                "vllm": (
                    lambda: _vllm_bf16_linear(w.to(torch.bfloat16)),
                    2,
                    lambda f, x, xf: f(x),
                ),
                "fp32": (
                    lambda: w.clone(),
                    4,
                    lambda w32, x, xf: torch.nn.functional.linear(xf, w32),
                ),
                "packed": (
                    lambda: layer_of(packed, q),
                    9 / 16,
                    lambda layer, x, xf: packed.apply(layer, x, None),
                ),
            }
            if args.macro_block != 128:
                p128 = CpuPackedBackend(_linear_spec(LinearSpec, args.scheme, n, k, MACRO_BLOCK))
                q128 = quantize(w, spec.weight_format)
                makers["p128"] = (
                    lambda: layer_of(p128, q128),
                    9 / 16,
                    lambda layer, x, xf: p128.apply(layer, x, None),
                )
            if args.reference:
                ref = ReferenceBackend(spec)
                makers["ref"] = (
                    lambda: layer_of(ref, q),
                    4,
                    lambda layer, x, xf: ref.apply(layer, x, None),
                )
            if args.exact_bf16:
                from vllm_mxplus.backends.cpu import exact_bf16

                on_tiles = exact_bf16.amx_tiles(spec.scheme)[0]  # as the backend decides
                probe = exact_bf16.ExactBf16Weight.from_quantized(q, spec.scheme, tiles=on_tiles)
                makers["exact"] = (
                    lambda: exact_bf16.ExactBf16Weight.from_quantized(
                        q, spec.scheme, tiles=on_tiles
                    ),
                    9 / 16 if probe.packed is not None else 2,
                    lambda ew, x, xf: exact_bf16.linear(x, ew, None, torch.bfloat16),
                )

                # the integer kernels whatever M (the backend with its large-M path off)
                makers["int"] = (
                    lambda: layer_of(packed, q),
                    9 / 16,
                    lambda layer, x, xf: cpu_linear(
                        x,
                        packed._args,
                        (layer.mxplus_cpu_codes, layer.mxplus_cpu_scales, layer.mxplus_cpu_mbs),
                        None,
                        torch.bfloat16,
                    ),
                )
                if probe.packed is not None:  # the same tiles held as a bf16 copy (2 B/weight)
                    makers["held"] = (
                        lambda: _held_tiles(exact_bf16, q, spec.scheme),
                        2,
                        lambda ew, x, xf: exact_bf16.linear(x, ew, None, torch.bfloat16),
                    )
                if probe.int8 is not None:  # the bf16 tile GEMM on the same packed codes
                    makers["tiles"] = (
                        lambda: exact_bf16.ExactBf16Weight.from_quantized(
                            q, spec.scheme, tiles=True, int8=False
                        ),
                        9 / 16,
                        lambda ew, x, xf: exact_bf16.linear(x, ew, None, torch.bfloat16),
                    )
                if probe.held is not None:  # the int8 linear decoding its tiles per call
                    makers["decoded"] = (
                        lambda: exact_bf16.ExactBf16Weight.from_quantized(
                            q, spec.scheme, tiles=True, int8=True, held=False
                        ),
                        9 / 16,
                        lambda ew, x, xf: exact_bf16.linear(x, ew, None, torch.bfloat16),
                    )
            copies: dict = {}
            for kind, (make, per_weight, _) in makers.items():
                reps = _copies(int(per_weight * n * k)) if args.stream else 1
                copies[kind] = [make() for _ in range(reps)]
                if copies[kind][0] is None:  # no vLLM here
                    del copies[kind]
            for m in ms:
                rows = torch.randn(m, k, generator=g) if real is None else real[name][1][:m]
                x = rows.to(torch.bfloat16)
                xf = x.float()
                timed = [kind for kind in kinds if kind in copies]
                fns = [
                    _rotating(copies[kind], lambda c, f=makers[kind][2]: f(c, x, xf))
                    for kind in timed
                ]
                t = dict.fromkeys(kinds, float("nan"))
                t.update(zip(timed, _medians_us(fns, cold, args.min_time, args.min_iters, clock)))
                for kind in kinds:
                    tot[kind] += t[kind]
                t_p = t["packed"]
                print(
                    f"{model:8s} {n:6d} {k:6d} {m:4d} {t['bf16']:9.1f} {t['vllm']:9.1f} "
                    f"{t['fp32']:9.1f} {t['ref']:9.1f} {t_p:9.1f} {t['bf16'] / t_p:11.2f} "
                    f"{t['vllm'] / t_p:11.2f} {t['fp32'] / t_p:11.2f} {t['ref'] / t_p:10.2f}"
                    + (
                        f" {t['p128']:9.1f} {t_p / t['p128']:6.2f}"
                        if args.macro_block != 128
                        else ""
                    )
                    + (
                        f" {t['exact']:9.1f} {t['bf16'] / t['exact']:10.2f} "
                        f"{t_p / t['exact']:12.2f} {t['int']:9.1f} {t['int'] / t['exact']:9.2f} "
                        f"{t['held']:9.1f} {t['held'] / t['exact']:10.2f} "
                        f"{t['tiles']:9.1f} {t['tiles'] / t['exact']:11.2f} "
                        f"{t['decoded']:10.1f} {t['decoded'] / t['exact']:13.2f}"
                        if args.exact_bf16
                        else ""
                    ),
                    flush=True,
                )
    print(
        f"sum over rows: bf16/packed = {tot['bf16'] / tot['packed']:.2f}x, "
        f"vllm/packed = {tot['vllm'] / tot['packed']:.2f}x, "
        f"fp32/packed = {tot['fp32'] / tot['packed']:.2f}x, "
        f"reference/packed = {tot['ref'] / tot['packed']:.2f}x"
        + (
            f", packed at {args.macro_block} / packed at 128 = {tot['packed'] / tot['p128']:.2f}x"
            if args.macro_block != 128
            else ""
        )
        + (
            f", bf16/exact = {tot['bf16'] / tot['exact']:.2f}x, "
            f"packed/exact = {tot['packed'] / tot['exact']:.2f}x, "
            f"int/exact = {tot['int'] / tot['exact']:.2f}x, "
            f"held/exact = {tot['held'] / tot['exact']:.2f}x, "
            f"tiles/exact = {tot['tiles'] / tot['exact']:.2f}x, "
            f"decoded/exact = {tot['decoded'] / tot['exact']:.2f}x"
            if args.exact_bf16
            else ""
        )
    )
    print(f"load average after: {os.getloadavg()}")
    print(
        "rerun: python benchmarks/bench_cpu_linear.py "
        + " ".join(
            f"--{a} {v}"
            for a, v in (
                ("scheme", args.scheme),
                ("model", args.model),
                ("m", args.m),
                ("shapes", args.shapes),
                ("min-iters", args.min_iters),
                ("min-time", args.min_time),
                ("macro-block", args.macro_block),
                ("clock", args.clock),
            )
        )
        + (f" --threads {args.threads}" if args.threads else "")
        + (" --reference" if args.reference else "")
        + (" --exact-bf16" if args.exact_bf16 else "")
        + (" --warm" if args.warm else "")
        + (" --stream" if args.stream else "")
        + (f" --real-layer {args.real_layer}" if args.real_layer is not None else "")
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
