"""`mxplus kernels`: build the C++ CPU kernels now (instead of at the first model load) and
say which backend each scheme gets on this machine; or compile the GPU kernels ahead of time.

    mxplus kernels            # build if needed, print the build path and the CPU backends
    mxplus kernels --check    # also run a small bit-exactness self-test against formats
    mxplus kernels --aot      # compile every Triton kernel configuration for sm_80/90/100
                              # (no GPU needed); fails on a compile error, a register spill
                              # or shared memory over the limit
    mxplus kernels --aot --targets 80,90,100 --quick   # the representative subset CI runs
    mxplus kernels --aot --kernel decode_gemm       # one launcher's configurations only
    mxplus kernels --aot --macro-block 16,32,64     # the MBS configurations of these macro
                                                    # blocks only, one line per compile
    mxplus kernels --build-cutlass [--archs 90a,100a] [--cutlass-out DIR]
                              # build the CUTLASS prefill extension now (nvcc + the
                              # nvidia-cutlass headers; minutes): serving finds it by itself
    mxplus kernels --plan --device cuda --capability 90 --cutlass absent [--json]
                              # no GPU needed: which backend serves which M, per scheme, for
                              # linears and MoE experts (the selector's choice, minus the
                              # first-use self-test on the hardware)
"""

from __future__ import annotations

import argparse
import logging
import os
import time

import torch

from vllm_mxplus.backends.base import LinearSpec
from vllm_mxplus.backends.cpu import kernels as cpu_kernels
from vllm_mxplus.backends.selection import select
from vllm_mxplus.formats import SCHEMES, fake_quantize, get_scheme, quantize
from vllm_mxplus.kernel_tools import aot, plan
from vllm_mxplus.kernel_tools.aot_drivers import DRIVERS


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "kernels",
        help="build the C++ CPU kernels and show the CPU backend per scheme",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument(
        "--check",
        action="store_true",
        help="run a bit-exactness self-test of the kernels against vllm_mxplus.formats",
    )
    g = p.add_argument_group("plan: which backend will serve which M (no GPU needed)")
    g.add_argument("--plan", action="store_true", help="print the backend plan and exit")
    g.add_argument(
        "--device", default="cuda", choices=("cuda", "cpu"), help="platform (default: cuda)"
    )
    g.add_argument(
        "--capability",
        type=int,
        default=90,
        metavar="CC",
        help="compute capability as 10*major+minor: 80, 90, 100 (default: 90)",
    )
    g.add_argument(
        "--cutlass",
        choices=("built", "absent"),
        default="absent",
        help="whether the CUTLASS extension will be built on that machine (default: absent)",
    )
    g.add_argument(
        "--dtype",
        choices=("bfloat16", "float16", "float32"),
        default="bfloat16",
        help="the model dtype (default: bfloat16)",
    )
    g.add_argument(
        "--json",
        action="store_true",
        help="JSON: a list of {scheme, layer, m_min, m_max, backend} (m_max null: no bound)",
    )
    g = p.add_argument_group("the CUTLASS prefill extension (sm_90a / sm_100a; nvcc, no GPU)")
    g.add_argument(
        "--build-cutlass",
        action="store_true",
        help="compile and link the CUTLASS extension now into the per-user cache (reused "
        "while the sources, torch, CUDA toolkit and archs are the same), where serving "
        "loads it; exit 1 naming the failed step (nvcc missing, a compile error)",
    )
    g.add_argument(
        "--archs",
        default=None,
        help="for --build-cutlass: 90a, 100a, comma-separated (default: TORCH_CUDA_ARCH_LIST, "
        "else both)",
    )
    g.add_argument(
        "--cutlass-out",
        default=None,
        metavar="DIR",
        help="for --build-cutlass: build there instead of the cache (then point "
        "VLLM_MXPLUS_CUTLASS_EXT at the .so)",
    )
    g = p.add_argument_group("ahead-of-time GPU compilation (no GPU needed)")
    g.add_argument(
        "--aot",
        action="store_true",
        help="compile every Triton kernel configuration the launchers can launch to "
        "machine code with ptxas -v; exit 1 on a compile failure, a spill or "
        "shared memory over the target's limit",
    )
    g.add_argument(
        "--targets",
        default="80,90,100",
        help="compute capabilities to compile for, comma-separated (default: 80,90,100)",
    )
    g.add_argument(
        "--quick",
        action="store_true",
        help="a representative subset (every kernel, format and flag; fewer shapes "
        "and dtypes): a few minutes on 2 cores, what CI runs",
    )
    g.add_argument(
        "--kernel",
        default="",
        metavar="LAUNCHER[,LAUNCHER]",
        help="compile only these launchers' configurations: "
        + ", ".join(DRIVERS)
        + " (default: all)",
    )
    g.add_argument(
        "--macro-block",
        default="",
        metavar="N[,N]",
        help="compile only the MBS configurations of these macro blocks (the Triton kernels "
        "take 16, 32, ..., 2048; GPU paths per macro block: docs/numerics.md, Macro Block "
        "Scaling) and print registers / spills per configuration (default: all)",
    )
    g.add_argument(
        "--jobs",
        type=int,
        default=min(8, os.cpu_count() or 1),
        help="parallel compile processes (default: CPU count, at most 8)",
    )


def _self_test() -> list[str]:
    """Failures of a quick comparison with formats (empty: all bit-exact / in bound)."""
    bad = []
    g = torch.Generator().manual_seed(0)
    for wf, af in (
        ("mxfp4-mbs-d", "mxfp4-mbs-s"),
        ("mxfp4-ocp", "mxfp4-ocp"),
        ("mxplus", "mxplus"),
    ):
        w = torch.randn(64, 576, generator=g) * 0.05
        x = torch.randn(5, 576, generator=g).to(torch.bfloat16)
        q = quantize(w, wf)
        xq = fake_quantize(x, af)
        if not torch.equal(
            cpu_kernels.act_fake_quant(x, af, q.macro_block).view(torch.int32),
            xq.view(torch.int32),
        ):
            bad.append(f"activation fake-quant {af}")
        w_hat = q.dequantize()
        if wf != "mxplus" and not torch.equal(
            cpu_kernels.dequant_weight(q).view(torch.int32),
            w_hat.view(torch.int32),
        ):
            bad.append(f"weight dequantization {wf}")
        ref = xq.double() @ w_hat.double().T
        bound = 2.0**-16 * (xq.abs().double() @ w_hat.abs().double().T)
        for m in (1, 5):
            y = (
                cpu_kernels.mxplus_linear_packed(
                    x[:m], 64, 576, *cpu_kernels.pack_mxplus(q), None, torch.float32
                )
                if wf == "mxplus"
                else cpu_kernels.mx_linear(
                    x[:m], wf, af, q.codes, q.scales, q.mbs, 576, None, torch.float32, q.macro_block
                )
            )
            if not bool(((y.double() - ref[:m]).abs() <= bound[:m]).all()):
                bad.append(f"linear {wf} x {af}, M={m}")
    return bad


def _run_aot(args: argparse.Namespace) -> int:
    try:
        targets = aot.parse_targets(args.targets)
        launchers = aot.parse_kernels(args.kernel)
        macro_blocks = aot.parse_macro_blocks(getattr(args, "macro_block", ""))
    except ValueError as e:
        print(f"mxplus kernels: {e}")
        return 2
    try:
        return aot.run_aot(
            targets,
            args.quick,
            max(1, args.jobs),
            launchers=launchers,
            macro_blocks=macro_blocks,
        )
    except RuntimeError as e:  # triton missing, or a launcher recorded nothing
        print(f"mxplus kernels --aot: {e}")
        return 2


def _run_build_cutlass(args: argparse.Namespace) -> int:
    from pathlib import Path

    from vllm_mxplus.backends.cutlass import build

    t0 = time.time()
    try:
        archs = build.requested_archs(args.archs)
        out = Path(args.cutlass_out) if args.cutlass_out else None
        so = build.build(out, archs, max(1, args.jobs))
    except build.BuildError as e:
        print(f"mxplus kernels --build-cutlass: {e}")
        return 1
    print(f"CUTLASS extension: {so} (archs {','.join(archs)}; {time.time() - t0:.0f} s)")
    return 0


def _run_plan(args: argparse.Namespace) -> int:
    cap = args.capability if args.device == "cuda" else None
    rows = plan.plan(args.device, cap, args.cutlass == "built", getattr(torch, args.dtype))
    print(plan.render(rows, args.json))
    return 0


def run(args: argparse.Namespace) -> int:
    if getattr(args, "aot", False):
        return _run_aot(args)
    if getattr(args, "plan", False):
        return _run_plan(args)
    if getattr(args, "build_cutlass", False):
        return _run_build_cutlass(args)
    t0 = time.time()
    ok, why = cpu_kernels.load()
    if not ok:
        print(f"CPU kernels: unavailable: {why}")
        print("CPU backend for every scheme: reference (pure torch)")
        return 1
    print(
        f"CPU kernels: {cpu_kernels.build_dir()} ({time.time() - t0:.1f} s; "
        f"{' '.join(cpu_kernels.cflags()[:1])}, torch CPU capability "
        f"{torch.backends.cpu.get_cpu_capability()})"
    )
    quiet = logging.getLogger("vllm_mxplus.backends.selection")
    level, quiet.level = quiet.level, logging.ERROR  # the listing below says it all
    try:
        for name in SCHEMES:
            chosen = select(
                LinearSpec(get_scheme(name), n=16, k=128, out_dtype=torch.bfloat16), "cpu", None
            )
            print(f"  {name:14s} -> {' > '.join(b.name for b in chosen)}")
    finally:
        quiet.setLevel(level)
    if args.check:
        bad = _self_test()
        print(
            "self-test: "
            + ("bit-exact, linear within bound" if not bad else "FAILED: " + "; ".join(bad))
        )
        return 1 if bad else 0
    return 0
