"""A static estimate of the GPU kernels' speed, read from their machine code (no GPU needed).

    python benchmarks/gpu_static_model.py [--arch 90,100] [--json]

For each Triton kernel a GPU layer runs (the decode GEMM, the prefill GEMM, the grouped
experts, the activation quantizer), the launcher is driven on meta tensors to get the
configuration it launches for a Llama-3-8B layer, that configuration is compiled for the
target by Triton's own compiler, disassembled with the nvdisasm of Triton's wheel, and its
hot loop counted (`vllm_mxplus.kernel_tools.sass`): instructions per warp per iteration, the
tensor-core instruction kinds, registers and spills. Per unit of work: warp-instructions per
weight (decode: each iteration covers BLOCK_N x BLOCK_K weights), per MAC (prefill, experts:
BLOCK_M x BLOCK_N x BLOCK_K), per element (act-quant: every K loop over BLOCK_M x BLOCK_K).

Then a STATIC ESTIMATE of a Llama-3-8B forward's linears (32 layers of qkv 6144x4096, o
4096x4096, gate_up 28672x4096, down 4096x14336) at M = 1, 16, 17, 64, 65, 128, 256, 512, 1024, 4096 (M
padded to the prefill kernel's whole row tiles above 16 rows) as the max of four
bounds: instruction issue (warp-instructions / the GPU's issue rate), tensor cores (MACs / the
dense peak of the instruction's kind: mma.sync counted at the bf16 peak, optimistic),
memory (bytes / bandwidth) and, for a loop that waits for its own asynchronous MMA every step
(`kernel_tools/mma_wait.py`, read from the TTGIR: column "MMA waited"), the serial bound
(issue + tensor) / the programs resident per SM (column "progs/SM", from registers, shared
memory and warps), next to the same estimate for bf16 (2 bytes per weight, the bf16
tensor peak) and the ratio. Published peak figures used (dense, boost clock):

    H200 SXM: 132 SMs x 4 schedulers x 1.98 GHz; HBM3e 4.8 TB/s; bf16 989, FP8 1979 TFLOPS
    B200:     148 SMs x 4 schedulers x 1.965 GHz; HBM3e 8.0 TB/s; bf16 2250, FP8 4500 TFLOPS

Above 16 rows three paths are estimated: the batched decode (the decode GEMM on x_hat with 32-
or 64-row tiles, one pass over the weight per row tile; `triton-decode` serves it up to
`BATCHED_DECODE_MAX_M`), the packed Triton GEMM (`mx_gemm`) and the FP8-chunk pipeline
(`triton-fp8-prefill`: the activations encoded by `act_fp8`, then up to
`gemm.PACKED_WEIGHT_MAX_M` rows `fp8_packed_gemm`, which re-encodes each weight chunk in
registers, above it the weight re-encoded to FP8 per call and the Triton FP8 GEMM, all on
the FP8 tensor cores); the table shows the path the backends pick at that M
(`FP8_PREFILL_MIN_M`) and the fastest other path's estimate beside it. Column `quant`: the
activation quantizer (with x_hat on the decode paths: its instruction count without x_hat, 2
more bytes per element written), or the encoders (FP8 path: the activations', and the
weight's where it is re-encoded per call).

Each path also pays LAUNCH_S (an assumption: `gpu_check`'s replay floor measures it) per
kernel launch, counted from the code's structure (`launches`: quantizer, GEMM, split-K sum;
bf16 one per linear), but for the decode GEMM on sm_90 and later, which launches with
programmatic dependent launch (`launch.pdl_launch`, VLLM_MXPLUS_GPU_PDL): its programs start
while the quantizer runs, and the model counts that launch as hidden (an assumption too:
`gpu_check`'s decode step times it with and without). What the model leaves out: latency at low occupancy (the decode grid
holds about 2 programs of 4 warps per SM, 2 warps per scheduler, and the issue bound assumes
each scheduler issues every cycle).

Every figure printed is an estimate from the code's instruction counts and these peaks, not
a measurement. `scripts/gpu_check.sh` times the same layers (speed step) when a GPU is lent;
the one H200 run (benchmarks/results/gpu_check_h200_5788301.json, Triton 3.6) measured our
Triton kernels 3.4-6.8x slower than these estimates (`benchmarks/gpu_measured_vs_static.py`).
The CUTLASS kernels' machine code is not counted here; their sm_100a block-scaled FP4 path is
estimated from its tensor-core and memory bounds alone (`cutlass_sm100`, B200 dense FP4
9000 TFLOPS published; a launch every LAUNCH_S): one full-K launch without MBS, and with MBS
one launch per 128-K chunk, each reading and writing the fp32 output once more. That bound
is what makes `cutlass_prefill` leave MBS layers to `triton-fp8-prefill` on sm_100
(`CutlassPrefillBackend.can_implement_on`).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import tempfile
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

GPUS = {
    # name: (capability, SMs, clock GHz, bandwidth B/s, bf16 dense FLOP/s, FP8 dense FLOP/s)
    "H200": (90, 132, 1.98, 4.8e12, 989e12, 1979e12),
    "B200": (100, 148, 1.965, 8.0e12, 2250e12, 4500e12),
}
LLAMA_8B = (("qkv", 6144, 4096), ("o", 4096, 4096), ("gate_up", 28672, 4096), ("down", 4096, 14336))
LAYERS = 32
SCHEME = "mxfp4-mbs"  # the scheme every estimate is for (MBS-H at macro block 128)
MS = (1, 16, 17, 32, 33, 64, 65, 128, 256, 512, 1024, 4096)
DECODE_MAX_M = 16  # the decode kernel's row tile: M <= 16 in one pass over the weight
SMALL_MACRO_BLOCKS = (16, 32, 64)  # MBS macro blocks besides the paper's 128 (decode per format)
BYTES_PER_WEIGHT = 0.5703  # mxfp4-mbs: 4 bits + E8M0 per 16 + MBS byte per 128
ACT_BYTES = 2.6  # act-quant per element: bf16 read, codes + E8M0 + MBS bytes written
HAT_BYTES = 2  # the decode path's x_hat per element: written by act-quant, read by the GEMM
FP8_BYTES = 1 + 4 / 128  # the FP8-chunk layout per element: a byte + an fp32 scale per 128
# act_fp8: bf16 read; FP8, scale, ref/MBS/exact written, and formats' codes and E8M0 scales
ACT_FP8_BYTES = 2 + FP8_BYTES + 6 / 128 + 0.5 + 1 / 16
FP4_FLOPS = {"B200": 9000e12}  # dense block-scaled FP4 (published); sm_90 has none
LAUNCH_S = 2e-6  # one kernel launch in a CUDA-graph replay, about (an assumption, not measured)
FP4_BYTES = 0.5 + 1 / 16  # sm_100a operands: E2M1 + a UE8M0 scale per 16
OUT_RMW_BYTES = 8  # the per-chunk MBS launch reads and writes each fp32 output once
# sm_100's Triton FP4 MMA (`triton-fp4-prefill`), its cases counted on sm_100 only
FP4_MBS, FP4_NO_MBS = "prefill fp4 MBS-128", "prefill fp4 (no MBS)"
FP4_MMA_ARCH = 100
SPLIT = " split"  # the same kernel with K split (a grid short of the SMs)
FP4_CASES = tuple(c + t for c in (FP4_MBS, FP4_NO_MBS) for t in ("", SPLIT))
# its operands per element: E2M1, a UE4M3 byte per 16, an fp32 factor per 128 (MBS) or per row
FP4_MMA_BYTES = {True: 0.5 + 1 / 16 + 4 / 128, False: 0.5 + 1 / 16}
# the relative scales of the activations per call: E8M0 + MBS bytes read, UE4M3 + factors written
REL_SCALE_BYTES = 1 / 16 + 1 / 128 + 1 / 16 + 4 / 128


@dataclass
class Count:
    kernel: str
    role: str  # decode | prefill | experts | act_quant
    unit: str  # weight | MAC | element
    arch: int
    loop_instructions: int
    warps: int
    work_per_iteration: int
    per_unit: float  # warp-instructions per unit of work
    tensor_core: dict[str, int]
    registers: int
    spill_bytes: int
    shared_bytes: int
    block_m: int  # rows per tile: M is padded to whole row tiles
    fp32_cycles: int = 0  # FP32-lane cycles per warp per iteration (`sass.FP32_PIPE`)
    waits_own_mma: bool = False  # each step waits for its own MMA (`mma_wait.waits_own_mma`)
    programs_per_sm: int = 1  # resident at once (`mma_wait.programs_per_sm`)
    block_n: int = 0  # columns per tile

    @property
    def cycles_per_unit(self) -> float:
        """Issue-slot cycles per unit of work: the loop's instructions, or its FP32-lane
        cycles where its packed FP32 arithmetic (sm_100's FFMA2 / FMUL2) takes longer."""
        return max(self.per_unit, self.fp32_cycles * self.warps / self.work_per_iteration)


def serial_s(g: Count, issue: float, tensor: float) -> float:
    """The bound of a loop that waits for its own MMA each step (`Count.waits_own_mma`): a
    program's step takes its instruction issue plus the MMA, overlapped only across the
    programs resident on an SM, so (issue + tensor) / programs; 0 where the loop keeps its
    MMA in flight (the issue and tensor bounds then overlap)."""
    return (issue + tensor) / g.programs_per_sm if g.waits_own_mma else 0.0


def gpu_of(capability: int) -> str | None:
    """The modelled GPU (a GPUS key) of a compute capability, None if none is modelled."""
    return next((g for g, spec in GPUS.items() if spec[0] == capability), None)


def _issue_rate(gpu: str) -> float:
    """Warp-instructions per second: SMs x 4 schedulers x clock."""
    _, sms, ghz, _, _, _ = GPUS[gpu]
    return sms * 4 * ghz * 1e9


def _whole_tiles(rows: int, tile: int) -> int:
    """rows padded to whole row tiles."""
    return -(-rows // tile) * tile


def _meta(shape, dtype):
    return torch.empty(shape, dtype=dtype, device="meta")


def _capture(drive: Callable[[], None], arch: int | None = None):
    """The first launch `drive` makes, with the tile choices of sm_<arch>."""
    from vllm_mxplus.backends.triton.launch import capture_launches

    with capture_launches(arch) as launches:
        drive()
    return launches[0]


def _cases() -> dict[str, tuple[str, str, Callable[[], None]]]:
    """name -> (role, unit, a call of the launcher as a Llama-3-8B layer would make it)."""
    from vllm_mxplus.backends.cutlass.act_fp8 import _fields as act_fp8_fields
    from vllm_mxplus.backends.cutlass.fp8_packed_gemm import fp8_packed_gemm
    from vllm_mxplus.backends.cutlass.weight_fp8 import weight_fp8_chunks
    from vllm_mxplus.backends.triton.act_quant import act_quant
    from vllm_mxplus.backends.triton.decode_gemm import decode_gemm
    from vllm_mxplus.backends.triton.fp8_chunk_gemm import fp8_chunk_gemm
    from vllm_mxplus.backends.triton.moe_decode import moe_decode_gemm
    from vllm_mxplus.backends.triton.moe_gemm import PackedExpertWeights, moe_block_m, moe_gemm
    from vllm_mxplus.backends.triton.mx_gemm import mx_gemm
    from vllm_mxplus.backends.triton.x_hat import hat_cols
    from vllm_mxplus.kernel_tools.aot_drivers import _gemm_operand, _moe_layout, _mx_operand

    n, k = 4096, 4096
    bf16 = torch.bfloat16

    def decode(
        af: str, wf: str, rows: int = 1, bs: int = 16, macro: int = 128
    ) -> Callable[[], None]:
        def go() -> None:  # rows > 16: the batched decode's 32- / 64-row tiles
            x, w = _gemm_operand(rows, k, af, bs, macro), _gemm_operand(n, k, wf, bs, macro)
            # the serving path: `act_quant_hat`'s x_hat, weight scales checked at load
            x_hat = _meta((rows, hat_cols(k)), bf16)
            # with MBS, `act_quant_hat`'s sigmas too
            sigma = _meta((rows, k // macro), torch.float32) if x[2] is not None else None
            decode_gemm(
                *x,
                *w,
                k,
                None,
                bf16,
                block_size=bs,
                macro_block=macro,
                w_small_scales=True,
                x_hat=x_hat,
                x_sigma=sigma,
            )

        return go

    def prefill(fmt: str, bs: int, macro: int | None) -> Callable[[], None]:
        def go() -> None:
            mx_gemm(_mx_operand(4096, k, fmt, bs, macro), _mx_operand(n, k, fmt, bs, macro), k,
                    None, bf16, fmt=fmt, block_size=bs, macro_block=macro or 128)  # fmt: skip

        return go

    def fp4_mma(mbs: bool, rows: int = 4096) -> Callable[[], None]:  # sm_100's FP4 MMA
        def go() -> None:  # rows = 256: a grid short of the SMs, K split
            from vllm_mxplus.backends.triton.fp4_rel_scales import aligned_rows
            from vllm_mxplus.backends.triton.fp4_scaled_gemm import fp4_scaled_gemm

            meta, groups = torch.device("meta"), k // 128 if mbs else 1

            def op(rows: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
                return (_meta((rows, k // 2), torch.uint8),
                        aligned_rows(rows, k // 16, torch.uint8, meta),
                        aligned_rows(groups, rows, torch.float32, meta))  # fmt: skip

            fp4_scaled_gemm(op(rows), op(n), k, None, bf16, per_chunk=mbs)

        return go

    def decode_nvfp4() -> None:  # NVFP4 on the decode GEMM: x_hat, E4M3 scales, g_x * g_w
        def operand(rows: int) -> tuple:
            return (_meta((rows, k // 2), torch.uint8),
                    _meta((rows, k // 16), torch.float8_e4m3fn), None)  # fmt: skip

        decode_gemm(*operand(1), *operand(n), k, None, bf16, block_size=16, macro_block=128,
                    split_k=1, x_hat=_meta((1, hat_cols(k)), bf16),
                    x_global=_meta((1,), torch.float32),
                    w_global=_meta((n,), torch.float32))  # fmt: skip

    def decode_mxplus(rows: int = 1) -> Callable[[], None]:
        # MX+ on the decode GEMM: x_hat, block maxima added per block (rows > 1: one pass
        # per live row, all of them counted at 16)
        def u8(r: int, cols: int) -> torch.Tensor:
            return _meta((r, cols), torch.uint8)

        def go() -> None:
            decode_gemm(u8(rows, k // 2), u8(rows, k // 32), None, u8(n, k // 2), u8(n, k // 32),
                        None, k, None, bf16, block_size=32, macro_block=128, split_k=1,
                        x_hat=_meta((rows, hat_cols(k)), bf16),
                        w_block_max=_meta((n, k // 32), torch.int16), w_small_scales=True)  # fmt: skip

        return go

    def decode_mx(fmt: str, bs: int) -> Callable[[], None]:
        def go() -> None:  # mx_gemm's decode tile: NVFP4 rows with given g, MX+ off x_hat
            mx_gemm(_mx_operand(1, k, fmt, bs, None), _mx_operand(n, k, fmt, bs, None, True), k,
                    None, bf16, fmt=fmt, block_size=bs, macro_block=128, split_k=1)  # fmt: skip

        return go

    e, pairs, topk, inter = 8, 4096, 2, 14336
    bm = moe_block_m(pairs, e, wide=True)  # 512 pairs per expert: the wide row tile

    def experts() -> None:  # E8M0 experts: the decode kernel's grouped mode on x_hat
        moe_decode_gemm(_meta((pairs // topk, hat_cols(k)), bf16),
                        _gemm_operand(pairs // topk, k, "mxfp4-mbs-s", 16, 128)[2],
                        _gemm_operand(e * 2 * inter, k, "mxfp4-mbs-d", 16, 128),
                        *_moe_layout(pairs, e, bm), experts=e, n=2 * inter,
                        k=k, num_pairs=pairs, topk=topk, out_dtype=bf16, block_size=16,
                        macro_block=128, block_m=bm, w_small_scales=True)  # fmt: skip

    def experts_mx() -> None:  # NVFP4 / MX+ experts and those off the x_hat path: mx_gemm's
        codes, scales, extra, g = _mx_operand(e * 2 * inter, k, "e8m0", 16, 128)
        w = PackedExpertWeights(codes, scales, extra, g, e, 2 * inter, k)
        moe_gemm(_mx_operand(pairs // topk, k, "e8m0", 16, 128), w,
                 *_moe_layout(pairs, e, bm), num_pairs=pairs,
                 topk=topk, out_dtype=bf16, fmt="e8m0", block_size=16,
                 macro_block=128, block_m=bm)  # fmt: skip

    def act(fmt: str) -> Callable[[], None]:
        return lambda: act_quant(_meta((4096, k), bf16), fmt, macro_block=128)

    def fp8_gemm() -> None:
        f8, f32, nc = torch.float8_e4m3fn, torch.float32, k // 128
        fp8_chunk_gemm(_meta((4096, k), f8), _meta((nc, 4096), f32), _meta((n, k), f8),
                       _meta((nc, n), f32), None, bf16)  # fmt: skip

    def fp8_packed() -> None:  # the weight's chunks re-encoded inside the GEMM
        f8, f32, nc = torch.float8_e4m3fn, torch.float32, k // 128
        w = _mx_operand(n, k, "e8m0", 16, 128)
        fp8_packed_gemm(_meta((4096, k), f8), _meta((nc, 4096), f32), w[0], w[1], w[2], k,
                        None, bf16)  # fmt: skip

    def weight_fp8() -> None:
        w = _mx_operand(n, k, "e8m0", 16, 128)
        weight_fp8_chunks(w[0], w[1], w[2], k, n)

    def act_fp8(fmt: str) -> Callable[[], None]:
        # the prefill's launch: the FP8 layout and the packed fields for the exact fallback
        return lambda: act_fp8_fields(_meta((4096, k), bf16), fmt, 128, packed=True)

    return {
        "decode mxfp4-mbs": ("decode", "weight", decode("mxfp4-mbs-s", "mxfp4-mbs-d")),
        "decode mxfp4-16-oas": ("decode", "weight", decode("mxfp4-16-oas", "mxfp4-16-oas")),
        "decode mxfp4-ocp": ("decode", "weight", decode("mxfp4-ocp", "mxfp4-ocp", bs=32)),
        **{
            f"decode mxfp4-mbs macro {mb}": (
                "decode",
                "weight",
                decode("mxfp4-mbs-s", "mxfp4-mbs-d", macro=mb),
            )
            for mb in SMALL_MACRO_BLOCKS
        },
        "decode mxfp4-mbs 32 rows": ("decode", "weight", decode("mxfp4-mbs-s", "mxfp4-mbs-d", 32)),
        "decode mxfp4-mbs 64 rows": ("decode", "weight", decode("mxfp4-mbs-s", "mxfp4-mbs-d", 64)),
        "decode nvfp4": ("decode", "weight", decode_nvfp4),
        "decode nvfp4 mx_gemm": ("decode", "weight", decode_mx("nvfp4", 16)),
        "decode mxplus": ("decode", "weight", decode_mxplus()),
        "decode mxplus 16 rows": ("decode", "weight", decode_mxplus(16)),
        "decode mxplus mx_gemm": ("decode", "weight", decode_mx("mxplus", 32)),
        "prefill e8m0+MBS-128": ("prefill", "MAC", prefill("e8m0", 16, 128)),
        "prefill e8m0 (no MBS)": ("prefill", "MAC", prefill("e8m0", 16, None)),
        "prefill nvfp4": ("prefill", "MAC", prefill("nvfp4", 16, None)),
        "experts e8m0+MBS-128": ("experts", "MAC", experts),
        "experts mx_gemm MBS-128": ("experts", "MAC", experts_mx),
        "act-quant mxfp4-mbs-s": ("act_quant", "element", act("mxfp4-mbs-s")),
        "prefill fp8-chunk gemm": ("prefill", "MAC", fp8_gemm),
        FP4_MBS: ("prefill", "MAC", fp4_mma(True)),
        FP4_NO_MBS: ("prefill", "MAC", fp4_mma(False)),
        FP4_MBS + SPLIT: ("prefill", "MAC", fp4_mma(True, 256)),
        FP4_NO_MBS + SPLIT: ("prefill", "MAC", fp4_mma(False, 256)),
        "prefill fp8 packed-weight": ("prefill", "MAC", fp8_packed),
        "encode weight-fp8": ("encode", "weight", weight_fp8),
        "encode act-fp8 mbs-s": ("encode", "element", act_fp8("mxfp4-mbs-s")),
    }


def _compile(launch, arch: int):
    """(compiled kernel, config) of a captured launch for sm_<arch>."""
    from vllm_mxplus.kernel_tools.aot import compile_kernel, config_of

    cfg = config_of(launch)
    return compile_kernel(cfg, arch), cfg


def count(name: str, role: str, unit: str, drive: Callable[[], None], arch: int) -> Count:
    from vllm_mxplus.kernel_tools import sass
    from vllm_mxplus.kernel_tools.aot import _ptxas_stats
    from vllm_mxplus.kernel_tools.mma_wait import programs_per_sm, waits_own_mma

    ck, cfg = _compile(_capture(drive, arch), arch)
    code = sass.parse(sass.disassemble(ck.asm["cubin"]))
    cx = dict(cfg.constexprs)
    warps = int(ck.metadata.num_warps)
    if role in ("act_quant", "encode"):  # every K loop of the kernel covers the row tile's elements
        loops = [
            lp
            for lp in code.loops()
            if not any(
                o is not lp and o.start <= lp.start and lp.end <= o.end for o in code.loops()
            )
        ]
        instr = sum(lp.count for lp in loops) if loops else code.count()
        fp32 = sum(lp.fp32_cycles for lp in loops) if loops else code.fp32_cycles
        kinds = code.kinds()
        work = cx["BLOCK_M"] * cx["BLOCK_K"]
    else:
        hot = code.hot_loop()
        if hot is None:
            raise RuntimeError(f"{name}: no loop in the machine code")
        instr, fp32, kinds = hot.count, hot.fp32_cycles, hot.kinds()
        work = cx["BLOCK_N"] * cx["BLOCK_K"] * (1 if role == "decode" else cx["BLOCK_M"])
    with tempfile.TemporaryDirectory() as d:
        regs, spill = _ptxas_stats(ck.asm["ptx"], arch, d)
    shared = int(getattr(ck.metadata, "shared", 0))
    return Count(name, role, unit, arch, instr, warps, work, instr * warps / work, kinds, regs,
                 spill, shared, int(cx["BLOCK_M"]), fp32, waits_own_mma(ck.asm["ttgir"]),
                 programs_per_sm(regs, warps, shared, arch), int(cx.get("BLOCK_N", 0)))  # fmt: skip


def _fp8_prefill_s(counts: dict[str, Count], gpu: str, m: int, act_k: int,
                   held: bool = False):  # fmt: skip
    """(issue, tensor, memory, serial) seconds of the FP8-chunk pipeline's GEMM at m rows, and the
    seconds of its encoders (the weight's per call unless `held` or `packed_serves`; the
    activations' FP8 form and, in the same launch, their packed form for the exact fallback),
    each kernel max(issue, memory). Up to PACKED_WEIGHT_MAX_M rows (not held)
    the GEMM is `fp8_packed_gemm`, reading the packed weight."""
    from vllm_mxplus.backends.cutlass.gemm import packed_serves

    _, _, _, bw, _, fp8_flops = GPUS[gpu]
    rate = _issue_rate(gpu)
    cap = GPUS[gpu][0]
    ew, ea = counts["encode weight-fp8"], counts["encode act-fp8 mbs-s"]
    issue = tensor = serial = enc_w = 0.0
    memory = m * act_k * FP8_BYTES / bw
    for _, n, k in LLAMA_8B:  # each linear by its own K (`packed_serves`)
        packed = not held and packed_serves(m, k, "triton", cap)
        g = counts["prefill fp8 packed-weight" if packed else "prefill fp8-chunk gemm"]
        padded = _whole_tiles(m, g.block_m)
        # a grid of fewer programs than SMs leaves the others idle; the packed-weight GEMM
        # splits K to fill them (`split_k_for`), its fp32 partials written and read once more
        tiles = padded // g.block_m * -(-n // g.block_n)
        split = _packed_split(tiles, k, gpu) if packed else 1
        fill = min(1.0, tiles * split / GPUS[gpu][1])
        step_issue = g.cycles_per_unit * padded * n * k * LAYERS / rate / fill
        step_tensor = padded * n * k * LAYERS / (fp8_flops / 2)
        issue += step_issue
        tensor += step_tensor
        serial += serial_s(g, step_issue, step_tensor / fill)
        w_bytes = BYTES_PER_WEIGHT if packed else FP8_BYTES
        memory += LAYERS * (n * k * w_bytes + (split > 1) * 8 * split * m * n) / bw
        if not held and not packed:  # the weight's FP8 copy, per call
            w = n * k * LAYERS
            enc_w += max(ew.cycles_per_unit * w / rate, w * (BYTES_PER_WEIGHT + FP8_BYTES) / bw)
    enc_a = max(ea.cycles_per_unit * m * act_k / rate, m * act_k * ACT_FP8_BYTES / bw)
    return (issue, tensor, memory, serial), enc_w + enc_a


def fp4_mma_s(counts: dict[str, Count], gpu: str, m: int, act_k: int, mbs: bool = True):
    """(issue, tensor, memory, serial) seconds of sm_100's FP4 MMA GEMM (`fp4_scaled_gemm`) over
    Llama-3-8B's linears at m rows, and the seconds of its activation side (the quantizer and
    the relative scales, each max(issue, memory)); None where the GPU has no FP4 MMA or the
    case was not counted. One tile per SM (its registers), a grid of fewer tiles than SMs
    leaves the rest idle."""
    name = FP4_MBS if mbs else FP4_NO_MBS
    if gpu not in FP4_FLOPS or name not in counts:
        return None
    aq = counts["act-quant mxfp4-mbs-s"]
    _, sms, _, bw, _, _ = GPUS[gpu]
    rate = _issue_rate(gpu)
    issue = tensor = serial = 0.0
    memory = m * act_k * FP4_MMA_BYTES[mbs] / bw
    for _, n, k in LLAMA_8B:
        split, bm, bn = fp4_split(m, n, k, mbs)
        g = counts[name + SPLIT if split > 1 else name]  # the variant's own hot loop
        padded = _whole_tiles(m, bm)
        tiles = padded // bm * -(-n // bn)
        fill = min(1.0, tiles * split / sms)
        step_issue = g.cycles_per_unit * padded * n * k * LAYERS / rate / fill
        step_tensor = padded * n * k * LAYERS / (FP4_FLOPS[gpu] / 2)
        issue += step_issue
        tensor += step_tensor
        serial += serial_s(g, step_issue, step_tensor / fill)
        # the weight, and split K's fp32 partials written and read again by the sum
        memory += LAYERS * (n * k * FP4_MMA_BYTES[mbs] + (split > 1) * 8 * split * m * n) / bw
    act = max(aq.cycles_per_unit * m * act_k / rate, m * act_k * (ACT_BYTES + REL_SCALE_BYTES) / bw)
    return (issue, tensor, memory, serial), act


def fp4_split(m: int, n: int, k: int, mbs: bool) -> tuple[int, int, int]:
    """(K slices, BLOCK_M, BLOCK_N) `fp4_scaled_gemm`'s launcher picks for one linear at m rows
    on B200, without a bias (`fp4_scaled_gemm.gpu_split`)."""
    from vllm_mxplus.backends.triton.fp4_scaled_gemm import gpu_split

    return gpu_split(m, n, k, mbs, False, GPUS["B200"][1])


def _packed_split(tiles: int, k: int, gpu: str) -> int:
    """K slices `fp8_packed_gemm` launches for `tiles` output tiles over K on `gpu`."""
    from vllm_mxplus import settings
    from vllm_mxplus.backends.triton.gemm_launch import split_k_count

    return split_k_count(tiles, -(-k // 128), GPUS[gpu][1], settings.gpu_programs_per_sm())


def _fp4_pipeline(m: int, n: int, k: int):
    """(fn, make_args) of one `triton-fp4-prefill` call (mxfp4-mbs, no bias, no inexact
    weight rows) on fake CUDA tensors."""
    from vllm_mxplus.backends.graph_guard import cuda_empty
    from vllm_mxplus.backends.triton.fp4_prefill import fp4_prefill_impl
    from vllm_mxplus.backends.triton.fp4_rel_scales import aligned_rows
    from vllm_mxplus.formats import get_scheme

    sch = get_scheme(SCHEME)

    def make_args() -> tuple:
        u8, dev = torch.uint8, torch.device("cuda")
        w = (cuda_empty((n, k // 2), u8), cuda_empty((n, k // 16), u8),
             cuda_empty((n, k // 128), u8), None)  # fmt: skip
        fp4 = (aligned_rows(n, k // 16, u8, dev), aligned_rows(k // 128, n, torch.float32, dev),
               cuda_empty((0,), torch.int64))  # fmt: skip
        return (cuda_empty((m, k), torch.bfloat16), sch.activation_format, sch.weight_format,
                128, *w, *fp4, None, None, torch.bfloat16)  # fmt: skip

    return fp4_prefill_impl, make_args


def _fp8_pipeline(m: int, n: int, k: int, held: bool):
    """(fn, make_args) of one `triton-fp8-prefill` call (mxfp4-mbs, no bias, no inexact
    weight rows; the weight's FP8 form held from load or not) on fake CUDA tensors: the
    fused activation encoder, then the prefill op's body."""
    import dataclasses

    from benchmarks.count_prefill_ops import sm90_weight
    from vllm_mxplus.backends.cutlass import gemm as cutlass_gemm
    from vllm_mxplus.backends.graph_guard import cuda_empty
    from vllm_mxplus.formats import get_scheme

    fmt = get_scheme(SCHEME).activation_format

    def make_args() -> tuple:
        rows, kp = -(-n // 8) * 8, -(-k // 128) * 128
        fp8 = (cuda_empty((rows, kp), torch.float8_e4m3fn), cuda_empty((kp // 128, rows)))
        w = dataclasses.replace(sm90_weight(n, k, 0), engine="triton",
                                held_fp8=fp8 if held else None)  # fmt: skip
        return cuda_empty((m, k), torch.bfloat16), w

    def call(x: torch.Tensor, w) -> None:  # noqa: ANN001 (PreparedWeight)
        fields = torch.ops.vllm_mxplus.triton_act_fp8_chunks_packed(x, fmt, 128)
        cutlass_gemm.prefill_sm90_fused_impl(
            x, fmt, *fields, *w.sm90_operands(), None, n, torch.bfloat16, w.engine
        )

    return call, make_args


def pipeline_kernels(kernel: str, m: int, n: int, k: int, capability: int, held: bool = False):
    """The kernels one linear [n, k] at m rows launches on the `fp4` or `fp8` prefill
    pipeline on sm_<capability>, traced from its code (`kernel_tools.launch_trace`)."""
    from vllm_mxplus.kernel_tools.launch_trace import trace

    fn, make_args = _fp4_pipeline(m, n, k) if kernel == "fp4" else _fp8_pipeline(m, n, k, held)
    return trace(fn, make_args, capability)


def launches(kernel: str, m: int, held: bool = False, block_m: int = 16,
             block_n: int = 128, block_k: int = 128, capability: int = 90) -> int:  # fmt: skip
    """Kernel launches of Llama-3-8B's four linears at m rows on a path, each a launch gap:
    decode / packed prefill = the activation quantizer, the GEMM, and the split-K sum where
    the grid splits K (`gemm_launch.split_k_count` on an H200's 132 SMs; the decode GEMM sums
    inside its own launch, `gemm_blocks.reduce_split_tile`), from the code's structure; the
    FP8 and FP4 pipelines traced from their code on sm_<capability> (`pipeline_kernels`:
    encoders, GEMM, split-K sum, the exact fallback's row list and GEMM, every glue op that
    launches a kernel). bf16: one each. A programmatic dependent launch right after a kernel
    that triggers it is not counted (sm_90+, VLLM_MXPLUS_GPU_PDL: its programs start while
    the kernel before it runs): the decode GEMM after its quantizer, the pipelines' launches
    after their GEMM (`kernel_tools.launch_trace`)."""
    from vllm_mxplus import settings
    from vllm_mxplus.backends.triton.gemm_launch import (
        NOMINAL_SMS,
        split_k_count,
        sums_in_launch,
    )
    from vllm_mxplus.backends.triton.launch import capture_launches, pdl_launch
    from vllm_mxplus.kernel_tools.launch_trace import counted

    if kernel == "bf16":
        return len(LLAMA_8B)
    if kernel in ("fp4", "fp8"):  # traced from the pipeline's code, glue ops included
        return sum(
            counted(pipeline_kernels(kernel, m, n, k, capability, held)) for _, n, k in LLAMA_8B
        )
    with capture_launches(capability):  # the launcher's own rule on sm_<capability>
        pdl = pdl_launch(torch.device("meta"))
    total = 0
    for _, n, k in LLAMA_8B:
        tiles = -(-n // block_n) * -(-m // block_m)
        split = split_k_count(tiles, -(-k // block_k), NOMINAL_SMS, settings.gpu_programs_per_sm())
        # the decode GEMM sums its slices in its own launch up to SPLIT_COUNTERS tiles
        in_launch = kernel == "decode" and sums_in_launch(tiles, split)
        hidden = kernel == "decode" and pdl
        total += 2 - hidden + (split > 1 and not in_launch)
    return total


BOUNDS = ("issue", "tensor", "memory", "serial")  # the bounds of a kernel, `estimate`'s order


def estimate(counts: dict[str, Count], gpu: str, held: bool = False) -> list[dict]:
    """Llama-3-8B linears at each M: our kernels (decode <= 16 rows; above, the packed
    prefill GEMM or the FP8-chunk pipeline, as the backends pick by M; the activation
    quantizer or encoder before each) and bf16, each max(issue, tensor, memory) + its
    launches (`launches`) x LAUNCH_S. held: with
    VLLM_MXPLUS_FP8_WEIGHT_HELD=1 (the weight's FP8 form held from load)."""
    from vllm_mxplus.backends.cutlass.linear import FP8_HELD_MIN_M, FP8_PREFILL_MIN_M
    from vllm_mxplus.backends.triton.decode_gemm import gpu_block_m
    from vllm_mxplus.backends.triton.fp4_prefill import FP4_PREFILL_MIN_M
    from vllm_mxplus.backends.triton.linear import BATCHED_DECODE_MAX_M, HELD_DECODE_MAX_M

    fp8_min_m = FP8_HELD_MIN_M if held else FP8_PREFILL_MIN_M
    wide_max_m = HELD_DECODE_MAX_M if held else BATCHED_DECODE_MAX_M

    _, _, _, bw, bf16_flops, _ = GPUS[gpu]
    issue_rate = _issue_rate(gpu)
    mac_rate = bf16_flops / 2
    weights = LAYERS * sum(n * k for _, n, k in LLAMA_8B)
    act_k = LAYERS * sum(k for _, _, k in LLAMA_8B)  # activation elements per row quantized
    dec, pre, aq = (counts["decode mxfp4-mbs"], counts["prefill e8m0+MBS-128"],
                    counts["act-quant mxfp4-mbs-s"])  # fmt: skip
    rows = []
    for m in MS:
        memory = (weights * BYTES_PER_WEIGHT + m * act_k * ACT_BYTES) / bw
        act = max(aq.cycles_per_unit * m * act_k / issue_rate, m * act_k * ACT_BYTES / bw)
        if m <= DECODE_MAX_M:
            issue = dec.cycles_per_unit * weights / issue_rate
            tensor = DECODE_MAX_M * weights / mac_rate  # the row tile is 16 rows
            kernel, bounds, fp8 = (
                "decode",
                (issue, tensor, memory, serial_s(dec, issue, tensor)),
                None,
            )
        else:
            padded = _whole_tiles(m, pre.block_m)
            pre_issue = pre.cycles_per_unit * padded * weights / issue_rate
            pre_tensor = padded * weights / mac_rate
            packed_bounds = (pre_issue, pre_tensor, memory, serial_s(pre, pre_issue, pre_tensor))
            kernel, bounds = "prefill", packed_bounds
            # the batched decode: 32- or 64-row tiles, each a pass over the weight
            tile = gpu_block_m(m, hat=True)
            wide = counts[f"decode mxfp4-mbs {tile} rows"]
            passes = -(-m // tile)
            wide_issue = wide.cycles_per_unit * weights * passes / issue_rate
            wide_tensor = passes * tile * weights / mac_rate
            wide_bounds = (wide_issue, wide_tensor,
                           (passes * weights * BYTES_PER_WEIGHT + m * act_k * HAT_BYTES) / bw,
                           serial_s(wide, wide_issue, wide_tensor))  # fmt: skip
            fp8_bounds, enc = _fp8_prefill_s(counts, gpu, m, act_k, held)
            # the quantizer also writes x_hat for the decode GEMM (2 bytes per element)
            act_hat = max(act, m * act_k * (ACT_BYTES + HAT_BYTES) / bw)
            cap = GPUS[gpu][0]

            def launch_s(kind: str, bm: int) -> float:
                return LAYERS * launches(kind, m, held, bm, capability=cap) * LAUNCH_S

            # each path with its own launches, so that "other path" compares like with like
            paths = {
                "prefill": max(packed_bounds) + act + launch_s("prefill", pre.block_m),
                "decode": max(wide_bounds) + act_hat + launch_s("decode", tile),
                "fp8": max(fp8_bounds) + enc + launch_s("fp8", 128),
            }
            fp4 = fp4_mma_s(counts, gpu, m, act_k)
            if fp4 is not None:
                paths["fp4"] = max(fp4[0]) + fp4[1] + launch_s("fp4", 128)
            # the selector's order: `triton-fp4-prefill` (sm_100) ahead of the decode GEMM
            if fp4 is not None and m >= FP4_PREFILL_MIN_M:
                kernel, (bounds, act) = "fp4", fp4
            elif m <= wide_max_m:
                kernel, bounds, act = "decode", wide_bounds, act_hat
            elif m >= fp8_min_m:
                kernel, bounds, act = "fp8", fp8_bounds, enc
            fp8 = min(v for p_, v in paths.items() if p_ != kernel)
        block_m = pre.block_m if kernel == "prefill" else gpu_block_m(m, hat=True)
        n_launch = launches(kernel, m, held, block_m, capability=GPUS[gpu][0])
        launch = LAYERS * n_launch * LAUNCH_S
        ours = max(bounds) + act + launch
        other = fp8  # the fastest path the backends do not take at this M
        bf16 = (
            max(weights * 2 / bw, m * weights / mac_rate) + LAYERS * launches("bf16", m) * LAUNCH_S
        )
        rows.append({
            "gpu": gpu, "M": m, "kernel": kernel,
            "issue_ms": bounds[0] * 1e3, "tensor_ms": bounds[1] * 1e3,
            "memory_ms": bounds[2] * 1e3, "serial_ms": bounds[3] * 1e3,
            "act_quant_ms": act * 1e3,
            "launches_per_layer": n_launch, "launch_ms": launch * 1e3,
            "estimate_ms": ours * 1e3, "bf16_estimate_ms": bf16 * 1e3,
            "speedup_vs_bf16": bf16 / ours,
            "other_path_ms": None if other is None else other * 1e3,
            "bound": max(zip(bounds, BOUNDS))[1],
        })  # fmt: skip
    return rows


EXPERT_CASES = {"decode kernel": "experts e8m0+MBS-128", "mx_gemm": "experts mx_gemm MBS-128"}


def experts_vs_bf16(counts: dict[str, Count], gpu: str, tokens: int = 64,
                    case: str = EXPERT_CASES["decode kernel"]) -> dict:  # fmt: skip
    """One expert's w13 GEMM (2 x 14336 x 4096, MBS-128) at `tokens` pairs on the kernel of
    `case` (the E8M0 experts' path by default), max(issue, tensor, memory) with the rows
    padded to the kernel's row tile, against bf16's max(memory, tensor) for the same GEMM."""
    _, _, _, bw, bf16_flops, _ = GPUS[gpu]
    ex = counts[case]
    weights = 2 * 14336 * 4096
    rows = _whole_tiles(tokens, ex.block_m)
    issue = ex.cycles_per_unit * rows * weights / _issue_rate(gpu)
    tensor = rows * weights / (bf16_flops / 2)
    ours = max(issue, tensor, weights * BYTES_PER_WEIGHT / bw, serial_s(ex, issue, tensor))
    bf16 = max(weights * 2 / bw, tokens * weights / (bf16_flops / 2))
    return {"gpu": gpu, "case": case, "tokens": tokens, "estimate_us": ours * 1e6,
            "bf16_estimate_us": bf16 * 1e6, "speedup_vs_bf16": bf16 / ours}  # fmt: skip


# the decode cases per weight format at M = 1, and their bytes per weight (4 bits + the
# scale byte per block + MBS byte per macro block / MX+'s 16-bit block-max word per 32,
# `plus_words`)
DECODE_FORMATS = {
    "mxfp4-mbs": ("decode mxfp4-mbs", BYTES_PER_WEIGHT),
    **{
        f"mxfp4-mbs/{mb}": (f"decode mxfp4-mbs macro {mb}", 0.5 + 1 / 16 + 1 / mb)
        for mb in SMALL_MACRO_BLOCKS
    },
    "mxfp4-16-oas": ("decode mxfp4-16-oas", 0.5625),
    "mxfp4-ocp": ("decode mxfp4-ocp", 0.5 + 1 / 32),
    "nvfp4": ("decode nvfp4", 0.5625),
    "mxplus": ("decode mxplus", 0.5 + 1 / 32 + 2 / 32),
}


def decode_formats_vs_bf16(counts: dict[str, Count], gpu: str) -> list[dict]:
    """Llama-3-8B's linears at M = 1 on each weight format's decode kernel, max(issue,
    memory) + its launches (`launches`), against bf16's memory time + one launch per linear
    (the activation quantizer's own time left out: ~1% at M = 1)."""
    bw = GPUS[gpu][3]
    weights = LAYERS * sum(n * k for _, n, k in LLAMA_8B)
    bf16 = weights * 2 / bw + LAYERS * launches("bf16", 1) * LAUNCH_S
    launch = LAYERS * launches("decode", 1) * LAUNCH_S
    rows = []
    for fmt, (case, nbytes) in DECODE_FORMATS.items():
        c = counts[case]
        issue, memory = c.cycles_per_unit * weights / _issue_rate(gpu), weights * nbytes / bw
        ours = max(issue, memory) + launch
        rows.append({"gpu": gpu, "format": fmt, "case": case, "per_weight": c.per_unit,
                     "issue_ms": issue * 1e3, "memory_ms": memory * 1e3,
                     "estimate_ms": ours * 1e3, "bf16_estimate_ms": bf16 * 1e3,
                     "speedup_vs_bf16": bf16 / ours})  # fmt: skip
    return rows


def cutlass_sm100(counts: dict[str, Count], gpu: str, m: int, mbs: bool) -> dict:
    """Llama-3-8B's linears at m rows on the CUTLASS sm_100a FP4 GEMM, a bound model (its
    machine code is not counted): per launch max(tensor at the FP4 peak, memory) + LAUNCH_S,
    one full-K launch per linear without MBS; with MBS one per 128-K chunk, each also reading
    and writing the fp32 output (OUT_RMW_BYTES per output) and a final cast. Plus the
    activation quantizer (the act-quant count), against bf16's max(memory, tensor)."""
    _, _, _, bw, bf16_flops, _ = GPUS[gpu]
    fp4 = FP4_FLOPS[gpu] / 2  # MACs per second
    aq = counts["act-quant mxfp4-mbs-s"]
    total = bf16 = 0.0
    for _, n, k in LLAMA_8B:
        chunks = k // 128 if mbs else 1
        kc = k // chunks
        per_launch = max(m * n * kc / fp4,
                         ((n + m) * kc * FP4_BYTES + (m * n * OUT_RMW_BYTES if mbs else 0)) / bw)  # fmt: skip
        cast = m * n * (4 + 2) / bw + LAUNCH_S if mbs else 0.0
        act = max(aq.cycles_per_unit * m * k / _issue_rate(gpu), m * k * ACT_BYTES / bw) + LAUNCH_S
        total += LAYERS * (chunks * (per_launch + LAUNCH_S) + cast + act)
        bf16 += LAYERS * max(n * k * 2 / bw, m * n * k / (bf16_flops / 2))
    return {"gpu": gpu, "M": m, "mbs": mbs, "estimate_ms": total * 1e3,
            "bf16_estimate_ms": bf16 * 1e3, "speedup_vs_bf16": bf16 / total}  # fmt: skip


def act_quant_vs_copy(counts: dict[str, Count], gpu: str) -> dict:
    """The activation quantizer per element, max(issue, memory: 2 bytes read, 0.57 written),
    against a bf16 copy of the same activation (2 bytes read, 2 written) at the bandwidth."""
    bw = GPUS[gpu][3]
    aq = counts["act-quant mxfp4-mbs-s"]
    ours = max(aq.cycles_per_unit / _issue_rate(gpu), ACT_BYTES / bw)
    copy = 4.0 / bw
    return {"gpu": gpu, "act_quant_ps_per_element": ours * 1e12,
            "bf16_copy_ps_per_element": copy * 1e12, "time_vs_copy": ours / copy}  # fmt: skip


def fp4_formats_vs_bf16(counts: dict[str, Count], gpu: str) -> list[dict]:
    """sm_100's FP4 MMA prefill per kind of format at M = 256, 512, 4096: MBS (MXFP4-MBS-*, a
    promotion per 128-K chunk) and without (MXFP4-16-OAS, MXFP4-OCP, NVFP4: the MMA accumulates
    over K), bf16, and the MBS kernel's time over the one without."""
    rows = []
    weights = LAYERS * sum(n * k for _, n, k in LLAMA_8B)
    act_k = LAYERS * sum(k for _, _, k in LLAMA_8B)
    cap, _, _, bw, bf16_flops, _ = GPUS[gpu]
    for m in (256, 512, 4096):
        bf16 = max(weights * 2 / bw, m * weights / (bf16_flops / 2))
        bf16 += LAYERS * launches("bf16", m) * LAUNCH_S
        per = {}
        for mbs in (True, False):
            r = fp4_mma_s(counts, gpu, m, act_k, mbs)
            if r is None:
                return []
            per[mbs] = max(r[0]) + r[1] + LAYERS * launches("fp4", m, capability=cap) * LAUNCH_S
        rows.append({"gpu": gpu, "M": m, "mbs_ms": per[True] * 1e3, "no_mbs_ms": per[False] * 1e3,
                     "bf16_estimate_ms": bf16 * 1e3, "mbs_vs_bf16": bf16 / per[True],
                     "no_mbs_vs_bf16": bf16 / per[False],
                     "mbs_overhead": per[True] / per[False] - 1})  # fmt: skip
    return rows


# MBS's promotion per output element and 128-K chunk: the factors' product and the
# accumulation, acc += part * (fa * fb) (`fp4_scaled_gemm`, `fp8_chunk_gemm`); two FP32
# operations however they are packed (fa and fb vary per row and per column, and per chunk)
MBS_PROMOTION_FP32_OPS = 2
FP32_LANES_PER_SM = 128  # FP32 FMAs per SM and clock (H200, B200)


def mbs_promotion_ceiling(gpu: str) -> dict:
    """The most a per-chunk MBS promotion in fp32 lets a block-scaled MMA do, whatever its
    code: per output element and 128-K chunk the tensor cores do CHUNK MACs and the FP32
    lanes MBS_PROMOTION_FP32_OPS operations. With the two overlapped perfectly (warp
    specialization) and nothing else in the loop, MBS takes max(MMA, promotion); without MBS
    the MMA alone. On the GPU's lowest-precision MMA that has block scales: FP4 on sm_100,
    FP8 (the E4M3 re-encoding) on sm_90."""
    from vllm_mxplus.formats.constants import MACRO_BLOCK

    _, sms, ghz, _, bf16_flops, fp8_flops = GPUS[gpu]
    kind, flops = ("FP4", FP4_FLOPS[gpu]) if gpu in FP4_FLOPS else ("FP8", fp8_flops)
    mma = MACRO_BLOCK / (flops / 2)  # seconds per output element and chunk, the whole GPU
    promotion = MBS_PROMOTION_FP32_OPS / (sms * FP32_LANES_PER_SM * ghz * 1e9)
    bf16 = MACRO_BLOCK / (bf16_flops / 2)
    return {"gpu": gpu, "mma": kind, "promotion_over_mma": promotion / mma,
            "min_mbs_overhead": max(0.0, promotion / mma - 1),
            "max_mbs_vs_bf16": bf16 / max(mma, promotion), "max_no_mbs_vs_bf16": bf16 / mma}  # fmt: skip


def _commit() -> str:
    try:
        return subprocess.run(["git", "-C", str(ROOT), "rev-parse", "--short", "HEAD"],
                              capture_output=True, text=True).stdout.strip()  # fmt: skip
    except OSError:
        return "unknown"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--arch", default="90,100", help="targets, comma-separated (90, 100)")
    ap.add_argument("--json", action="store_true", help="JSON instead of tables")
    ap.add_argument(
        "--no-packed-weight",
        action="store_true",
        help="estimate the FP8 pipeline without the packed-weight GEMM (the weight re-encoded "
        "per call at every M), as before it existed",
    )
    args = ap.parse_args(argv)
    if args.no_packed_weight:
        from vllm_mxplus.backends.cutlass import gemm

        gemm.PACKED_WEIGHT_MAX_M.update(dict.fromkeys(gemm.PACKED_WEIGHT_MAX_M, 0))
    archs = [int(a) for a in args.arch.split(",") if a]
    import triton

    os.environ.setdefault("TRITON_CACHE_DIR", tempfile.mkdtemp(prefix="mxplus-static-"))
    counts = {
        arch: {
            name: count(name, role, unit, drive, arch)
            for name, (role, unit, drive) in _cases().items()
            if name not in FP4_CASES or arch == FP4_MMA_ARCH
        }  # fmt: skip
        for arch in archs
    }
    gpus = [g for g, spec in GPUS.items() if spec[0] in archs]
    est = {g: estimate(counts[GPUS[g][0]], g) for g in gpus}
    held = {g: estimate(counts[GPUS[g][0]], g, held=True) for g in gpus}
    act = {g: act_quant_vs_copy(counts[GPUS[g][0]], g) for g in gpus}
    formats = {g: decode_formats_vs_bf16(counts[GPUS[g][0]], g) for g in gpus}
    fp4_formats = {g: fp4_formats_vs_bf16(counts[GPUS[g][0]], g) for g in gpus}
    ceilings = [mbs_promotion_ceiling(g) for g in gpus]
    sm100 = [
        cutlass_sm100(counts[GPUS[g][0]], g, m, mbs)
        for g in gpus
        if g in FP4_FLOPS
        for m in MS
        if m > DECODE_MAX_M
        for mbs in (False, True)
    ]
    moe = {
        (g, path): experts_vs_bf16(counts[GPUS[g][0]], g, case=case)
        for g in gpus
        for path, case in EXPERT_CASES.items()
    }
    doc = {
        "what": "static estimate (instruction counts of the compiled code x published peaks)",
        "command": "python benchmarks/gpu_static_model.py --arch "
        + args.arch
        + (" --no-packed-weight" if args.no_packed_weight else ""),
        "commit": _commit(),
        "triton": triton.__version__,
        "host": platform.processor() or platform.machine(),
        "counts": {a: [asdict(c) for c in cs.values()] for a, cs in counts.items()},
        "estimates": est,
        "estimates_fp8_weight_held": held,
        "decode_per_format_m1": formats,
        "fp4_mma_prefill_per_format": fp4_formats,
        "mbs_promotion_ceiling": ceilings,
        "cutlass_sm100_bound_model": sm100,
        "act_quant_vs_bf16_copy": act,
        "expert_gemm_vs_bf16": list(moe.values()),
    }
    if args.json:
        print(json.dumps(doc, indent=1))
        return 0
    print(f"# {doc['what']}\n# {doc['command']}  (commit {doc['commit']}, triton "
          f"{doc['triton']})")  # fmt: skip
    for arch, cs in counts.items():
        print(f"\n## sm_{arch}: hot loops")
        print(f"{'kernel':<28}{'instr/warp/iter':>16}{'warps':>6}{'work/iter':>10}"
              f"{'per unit':>10} {'unit':<8}{'tensor core':<14}{'regs':>5}{'spill':>6}"
              f"{'MMA waited':>11}{'progs/SM':>9}")  # fmt: skip
        for c in cs.values():
            tc = ",".join(f"{k}x{v}" for k, v in c.tensor_core.items()) or "-"
            print(f"{c.kernel:<28}{c.loop_instructions:>16}{c.warps:>6}{c.work_per_iteration:>10}"
                  f"{c.per_unit:>10.4f} {c.unit:<8}{tc:<14}{c.registers:>5}{c.spill_bytes:>6}"
                  f"{'yes' if c.waits_own_mma else '-':>11}{c.programs_per_sm:>9}")  # fmt: skip
    for gpu, rows in est.items():
        print(f"\n## {gpu}: Llama-3-8B linears, one forward, STATIC ESTIMATE (ms)")
        print(f"{'M':>5} {'kernel':<8}{'issue':>9}{'tensor':>9}{'memory':>9}{'serial':>9}{'quant':>8}"
              f"{'launch':>8}{'ours':>9}{'bf16':>9}{'ratio':>7}  {'bound':<7}"
              f"{'other path':>11}")  # fmt: skip
        for r in rows:
            other = "" if r["other_path_ms"] is None else f"{r['other_path_ms']:>11.3f}"
            print(f"{r['M']:>5} {r['kernel']:<8}{r['issue_ms']:>9.3f}{r['tensor_ms']:>9.3f}"
                  f"{r['memory_ms']:>9.3f}{r['serial_ms']:>9.3f}{r['act_quant_ms']:>8.3f}"
                  f"{r['launch_ms']:>8.3f}"
                  f"{r['estimate_ms']:>9.3f}"
                  f"{r['bf16_estimate_ms']:>9.3f}{r['speedup_vs_bf16']:>6.2f}x  {r['bound']:<7}"
                  f"{other}")  # fmt: skip
    for gpu, rows in held.items():
        print(f"\n## {gpu} with VLLM_MXPLUS_FP8_WEIGHT_HELD=1 (+1.03 bytes per weight held), "
              "M > 16, STATIC ESTIMATE (ms)")  # fmt: skip
        for r in rows:
            if r["M"] > DECODE_MAX_M:
                print(f"{r['M']:>5} {r['kernel']:<8}{r['estimate_ms']:>9.3f}"
                      f"{r['bf16_estimate_ms']:>9.3f}{r['speedup_vs_bf16']:>6.2f}x  {r['bound']}")  # fmt: skip
    for gpu, rows in formats.items():
        print(f"\n## {gpu}: decode per weight format, Llama-3-8B linears at M = 1, STATIC "
              "ESTIMATE (ms)")  # fmt: skip
        print(f"{'format':<14}{'per weight':>11}{'issue':>9}{'memory':>9}{'ours':>9}"
              f"{'bf16':>9}{'ratio':>7}")  # fmt: skip
        for r in rows:
            print(f"{r['format']:<14}{r['per_weight']:>11.4f}{r['issue_ms']:>9.3f}"
                  f"{r['memory_ms']:>9.3f}{r['estimate_ms']:>9.3f}{r['bf16_estimate_ms']:>9.3f}"
                  f"{r['speedup_vs_bf16']:>6.2f}x")  # fmt: skip
    for gpu, rows in fp4_formats.items():
        if not rows:
            continue
        print(f"\n## {gpu}: prefill on the FP4 MMA (triton-fp4-prefill) with and without MBS, "
              "Llama-3-8B linears, STATIC ESTIMATE (ms)")  # fmt: skip
        print(f"{'M':>5}{'MBS':>9}{'ratio':>7}{'no MBS':>9}{'ratio':>7}{'bf16':>9}"
              f"{'MBS over no MBS':>17}")  # fmt: skip
        for r in rows:
            print(f"{r['M']:>5}{r['mbs_ms']:>9.3f}{r['mbs_vs_bf16']:>6.2f}x{r['no_mbs_ms']:>9.3f}"
                  f"{r['no_mbs_vs_bf16']:>6.2f}x{r['bf16_estimate_ms']:>9.3f}"
                  f"{r['mbs_overhead']:>+16.0%}")  # fmt: skip
    print("\n## MBS's per-chunk promotion (2 FP32 operations per output element and 128-K "
          "chunk, 128 FP32 lanes per SM) against the MMA's 128 MACs: the CEILING of any MBS "
          "prefill kernel, STATIC ESTIMATE")  # fmt: skip
    for c in ceilings:
        print(f"{c['gpu']:<6}{c['mma']} MMA: promotion {c['promotion_over_mma']:.2f}x the MMA's "
              f"time; MBS at least {c['min_mbs_overhead']:+.0%} over no MBS; at most "
              f"{c['max_mbs_vs_bf16']:.2f}x bf16 (no MBS {c['max_no_mbs_vs_bf16']:.2f}x)")  # fmt: skip
    if sm100:
        print("\n## CUTLASS sm_100a FP4 GEMM, Llama-3-8B linears: BOUND MODEL (tensor, memory, "
              "launches; its machine code not counted), STATIC ESTIMATE (ms)")  # fmt: skip
        print(f"{'gpu':<6}{'M':>6}  {'launches':<22}{'ours':>9}{'bf16':>9}{'ratio':>7}")
        for r in sm100:
            kind = "one per 128-K chunk" if r["mbs"] else "one (no MBS)"
            print(f"{r['gpu']:<6}{r['M']:>6}  {kind:<22}{r['estimate_ms']:>9.3f}"
                  f"{r['bf16_estimate_ms']:>9.3f}{r['speedup_vs_bf16']:>6.2f}x")  # fmt: skip
    for gpu, a in act.items():
        print(f"\n{gpu} act-quant (mxfp4-mbs-s) STATIC ESTIMATE: {a['act_quant_ps_per_element']:.3f}"
              f" ps per element, a bf16 copy {a['bf16_copy_ps_per_element']:.3f}: "
              f"{a['time_vs_copy']:.2f}x the copy's time")  # fmt: skip
    for (gpu, path), e in moe.items():
        print(f"{gpu} one expert's w13 GEMM at {e['tokens']} tokens (MBS-128, {path}) STATIC "
              f"ESTIMATE: {e['estimate_us']:.2f} us, bf16 {e['bf16_estimate_us']:.2f} us: "
              f"{e['speedup_vs_bf16']:.2f}x")  # fmt: skip
    print("\nratio = bf16 estimate / ours (> 1: ours faster). Estimates, not measurements.")
    return 0


if __name__ == "__main__":
    sys.exit(main())
