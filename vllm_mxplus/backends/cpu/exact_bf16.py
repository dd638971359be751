"""The exact-bf16 GEMM path of the CPU backend for large M (docs/cpu_kernels.md, "Large M on
AMX hosts"): every scheme's operands are exact in bf16 once the factors that are not (MBS
factors, NVFP4 global scales) are kept out of them, so a bf16 GEMM with fp32 accumulation
(AMX-BF16 through oneDNN where the CPU has it) computes the W4A4 linear within a derived
bound of the spec (docs/numerics.md, "E8M0 block scales", "Macro Block Scaling", "NVFP4",
"MX+").

    E8M0 (mxfp4-*):  a_k = va_k * 2^(ea_b - 127)      w_k = vw_k * 2^(ew_b - 127)
    MX+:             the same, and the block max +-(4 + j/2) * 2^(e_b - 127) on either side
    NVFP4:           a_k = va_k * sa_b                w_k = vw_k * sw_b   (E4M3 s, no g)

    P_c[m, n] = sum over k in macro chunk c of a_k w_k          (fp32 accumulation, any order)
    y[m, n]   = sum over c of P_c / (Fa[m, c] * Fw[n, c])       (E8M0; one chunk without MBS)
    y[m, n]   = P[m, n] * fl(ga[m] * gw[n])                     (NVFP4; one chunk)
    y        += bias

The activation codes and scales are those of the C++ quantizers, bit-exact with formats:
`cpu_act_quant` (E8M0, with the MX+ rule for MX+: its block max is the code +-(8 + j) of
2 * value) and `cpu_nvfp4_act_quant` (2 * value codes, E4M3 bytes, the row's global scale ga).
The weight is decoded once at load and kept in bf16: E8M0 by `cpu_dequant_weight` (without
its MBS bytes), MX+ and NVFP4 by the spec's own block decoder (formats, per row tile) with the
NVFP4 global scale set to 1, i.e. the spec's fp32 value * s before its `* g`. On AMX tiles an
E8M0 weight is not kept in bf16: the tile GEMM decodes the same values from the integer
kernels' packed codes and E8M0 bytes per call (`packed`), a block the packer marks NaN (a NaN
scale, or a value that overflows: the spec's +-Inf) all NaN, as in the integer kernels.

Exact in bf16 (8 significant bits, fp32's exponent range, subnormals down to 2^-133): an E2M1
value has at most 2 significant bits (0.5 .. 6), an MX+ block max 4 (8 + j, j = 0..7, times
1/2), an E4M3 scale 4 (2^-9 <= s <= 448, its subnormals 3). So v * 2^(e-127) and the MX+
block max are multiples of 2^-128 with at most 4 significant bits, and v * s has at most 6
(3 * 15 = 45) and lies in [2^-10, 2688]: every operand is a bf16 value (and an fp32 one).
A value the spec itself overflows (E8M0 codes 253 / 254) is +-Inf in both. Every product a_k w_k
is exact in fp32 while it stays in the normal range: at most 8 significant bits for E8M0 and
MX+; for NVFP4 at most 12, in [2^-20, 2688^2], so NVFP4's GEMM never leaves the normal range
(its partial sums are multiples of 2^-20). Not bf16-exact, so kept out of the operands and
applied in fp32 after the GEMM: the MBS factors F = 1 + m/256 (9 significant bits; with MBS
on either side each macro chunk is its own GEMM, batched, and its partial sum is divided by
the exact product Fa * Fw, as in the integer kernel) and the NVFP4 global scales (any fp32:
one product G = fl(ga * gw) per output and one product P * G, as the integer kernel's
(ga * gw) * 1/4). The spec composes NVFP4 as x_hat = fl(fl(v * s) * g) = fl(a * g), v * s
being exact: the path's a * ga differs from x_hat by the spec's one rounding, counted below.

On hosts with AMX-INT8 as well (`int8_tiles`), E8M0 weights take the plugin's int8 tile
linear instead (csrc/mx_amx_int8_cpu.cpp, `cpu_amx_int8_linear`, from INT8_MIN_M rows): the
integer kernels' exact block sums, 64 elements per `tdpbssd`, the block scales folded into
the int8 operands where that is exact (a spread of at most 3 in E8M0 codes across the fold;
two folds or one product per block where it is larger), and each macro chunk's exact sum
scaled into y as below; its roundings are at most the tile GEMM's (`roundings` holds for
both), and what the fold cannot take exactly (NaN, tiny or extreme scales) runs on the
integer kernels inside the op. Its int8 B tiles are decoded from the packed weight once at
load by default (`held`, VLLM_MXPLUS_CPU_INT8_HELD), else per call: the same bytes.

Where the CPU has AMX-BF16 (`amx_tiles`: what serves), the GEMM is the plugin's tile kernel
(csrc/mx_amx_cpu.cpp: the weight as `tdpbf16ps` B tiles, decoded per task from the packed
codes for E8M0, held in bf16 for NVFP4 and MX+; each chunk's fp32 sums scaled by
fl(1/Fa) * fl(1/Fw) in one fused multiply-add: three roundings more than a division, counted
in `roundings`). Elsewhere (tests, and a host whose C++ side finds no AMX) it is torch's fp32
matmul with oneDNN's bf16 math mode switched on for the call
(`torch.backends.mkldnn.matmul.fp32_precision = "bf16"`, restored after): on a CPU with AMX-BF16
or AVX512-BF16 oneDNN converts the fp32 operands to bf16 (exact here) and accumulates in fp32
on the tiles; elsewhere the mode does nothing and the same fp32 GEMM runs. Error bound
(derivation in docs/cpu_kernels.md; u = 2^-24, gamma_n = n u / (1 - n u), x_hat and w_hat
the spec's values, y64 the float64 sum, S = sum_k |x_hat_k| |w_hat_k| + |b|):

    |y - y64| <= gamma_n S + 2^-124 (sum_k |x_hat_k| + sum_k |w_hat_k| + K)
                 [NVFP4, where 0 < ga gw < 2^-126: + 2^-125 K 2688^2]

with n (`ExactBf16Weight.roundings`) the most roundings on one product's way into y, plus
one for the float64 evaluation of y64 and S:

    E8M0 with MBS       n = L + n_c + 3    (L - 1 in the chunk, 1 division, n_c - 1 chunk
                                            additions, the bias, the spec's x_hat and w_hat;
                                            + 3 on AMX tiles)
    E8M0 without MBS, MX+   n = K + 1      (K - 1 additions, the bias; x_hat, w_hat exact)
    NVFP4               n = K + 5          (K - 1 additions, ga * gw, P * G, the bias, the
                                            spec's x_hat and w_hat)

(L the longest chunk in K, the macro block with MBS; n_c chunks.) The absolute term covers
AMX-BF16's denormals-are-zero inputs and flushed fp32 results, and the spec's own roundings to
fp32 subnormals; the bracketed one an NVFP4 product ga * gw below fp32's normal range (|a_k|,
|w_k| <= 6 * 448 = 2688).

Which hosts use it (`host_choice`): CPUs with `amx_bf16` in cpuinfo and the AMX tile
permission granted, for M >= MIN_M rows; every other CPU keeps the integer kernels (on an
AVX2 CPU the fp32 GEMM is slower than them: benchmarks/bench_cpu_linear.py --exact-bf16).
The first use on a host runs `self_test` against `vllm_mxplus.formats`, per scheme; a failure
is logged as an ERROR and the integer kernels serve.
"""

from __future__ import annotations

import dataclasses
import logging
import math
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch

from vllm_mxplus import settings
from vllm_mxplus.backends.base import is_cpu_kernel_pair
from vllm_mxplus.backends.cpu import kernels as cpu_kernels
from vllm_mxplus.formats import FormatSpec, QuantizedTensor, Scheme, quantize
from vllm_mxplus.formats.constants import E2M1_MAX, F8E4M3_MAX, ceil_div
from vllm_mxplus.log_once import log_once
from vllm_mxplus.platform_amx import AmxResult, cpu_flags, read_cpuinfo, request_amx_permission

logger = logging.getLogger(__name__)

# rows per call from which AMX hosts take this path: on the AMX Xeon of docs/cpu_kernels.md the
# tiles beat the integer kernels from M = 32 (1.3x on Llama-3-8B's o / down) and not at 16;
# the same with E8M0 weights decoded per task
MIN_M = 32
# rows per call from which AMX-INT8 hosts run E8M0 weights on int8 tiles (int8_tiles): on the
# AMX Xeon of docs/cpu_kernels.md they beat the integer kernels from about 10 rows (SmolLM2's
# layer: 1.03-1.16x at 12, 1.2-1.4x at 16) and the bf16 tiles at every M measured (to 1024)
INT8_MIN_M = 12
ROW_TILE = 512  # weight rows decoded per step (bounds the fp32 temporaries)
PARTIAL_BYTES = 32 << 20  # fp32 partial sums [chunks, M, rows] per batched GEMM, at most
U = 2.0**-24
FP32_TINY = torch.finfo(torch.float32).tiny  # 2^-126, the smallest normal fp32 (and bf16)
NVFP4_OPERAND_MAX = E2M1_MAX * F8E4M3_MAX  # |v * s| <= 6 * 448 = 2688, an NVFP4 operand's max

# 2^(e - 128) for E8M0 codes e = 0..254 (half the block scale: the int8 operand is 2 * value);
# code 255 is NaN. Exact fp32 values (2^-128 and 2^-127 are subnormal, still exact).
_HALF_SCALE = torch.tensor(
    [math.ldexp(1.0, e - 128) for e in range(255)] + [math.nan], dtype=torch.float32
)


def takes(scheme: Scheme) -> tuple[bool, str]:
    """Whether the path builds this scheme's operands: the pairs the C++ kernels take
    (`base.is_cpu_kernel_pair`: NVFP4 or MX+ on both sides, or an E8M0 pair), whose
    activation quantizers it uses. (True, "") or (False, why)."""
    w, a = scheme.weight, scheme.activation
    if is_cpu_kernel_pair(w, a):
        return True, ""
    return False, (
        f"the exact-bf16 path takes NVFP4, MX+ or an E8M0 pair of one block size and scale "
        f"rule, not weights {w.name} x activations {a.name}"
    )


def host_choice(
    cpuinfo: str | None = None, permission: AmxResult | None = None
) -> tuple[bool, str]:
    """Whether this host runs the exact-bf16 path for large M: (True, "") with `amx_bf16` in
    cpuinfo and the AMX tile permission held, else (False, why); decided once per process.
    The arguments replace the real machine (tests; not cached). VLLM_MXPLUS_CPU_EXACT_BF16=0
    turns the path off on every host (read at each call); VLLM_MXPLUS_CPU_AMX_EMULATE=1 (tests)
    takes it on the real machine wherever the emulated tiles run."""
    if not settings.cpu_exact_bf16():
        return False, (
            f"{settings.CPU_EXACT_BF16.name}=0 (slower prefill; NVFP4 and MX+ weights "
            "without their bf16 copy, 2 bytes per weight less memory)"
        )
    if cpuinfo is None and permission is None:
        if not _HOST:
            _HOST.extend(
                _emulated_choice(read_cpuinfo())
                if settings.cpu_amx_emulate()
                else _host_choice(read_cpuinfo(), request_amx_permission())
            )
        return _HOST[0], _HOST[1]
    return _host_choice(
        read_cpuinfo() if cpuinfo is None else cpuinfo,
        request_amx_permission() if permission is None else permission,
    )


_HOST: list = []  # this process's (ok, why), once decided
# /proc/cpuinfo's names of what the AMX code runs besides tiles (MXPLUS_AMX_TARGET,
# csrc/mx_amx_decode.h): with emulated tiles, what the host must have.
EMULATE_NEEDS = frozenset({"avx512f", "avx512bw", "avx512vl", "avx512dq", "avx512vbmi", "f16c"})


def _emulated_choice(cpuinfo: str) -> tuple[bool, str]:
    """VLLM_MXPLUS_CPU_AMX_EMULATE=1: the kernels' tiles are emulated in C++, so no AMX or
    tile permission is needed, only the AVX-512 the AMX code is compiled for."""
    missing = sorted(EMULATE_NEEDS - (cpu_flags(cpuinfo) or set()))
    if missing:
        return False, (
            f"{settings.CPU_AMX_EMULATE.name}=1 needs the AVX-512 the AMX code is built for; "
            f"the CPU lacks {', '.join(missing)}"
        )
    logger.warning(
        "mxplus: %s=1: the AMX path runs on tile instructions emulated in C++ (for tests: "
        "far slower than the integer kernels it replaces)",
        settings.CPU_AMX_EMULATE.name,
    )
    return True, ""


def _host_choice(cpuinfo: str, perm: AmxResult) -> tuple[bool, str]:
    flags = cpu_flags(cpuinfo) or set()
    if "amx_bf16" not in flags:
        return False, "the CPU has no amx_bf16 (the integer kernels are faster without it)"
    if perm.action not in ("already", "granted"):
        return False, f"no AMX tile permission ({perm.action}: {perm.detail})"
    return True, ""


@contextmanager
def bf16_math() -> Iterator[None]:
    """oneDNN's bf16 math mode for fp32 matmuls, for the duration of one call (exact here:
    every operand is a bf16 value); other fp32 GEMMs of the process are unaffected."""
    mode: Any = torch.backends.mkldnn.matmul  # type: ignore[attr-defined]  # set at import
    old = mode.fp32_precision
    mode.fp32_precision = "bf16"
    try:
        yield
    finally:
        mode.fp32_precision = old


def _mbs_factors(mbs: torch.Tensor, chunks: int) -> torch.Tensor:
    """F = 1 + m/256 (exact fp32) for MBS bytes [R, chunks]."""
    return 1.0 + mbs[:, :chunks].to(torch.float32) / 256.0


def _decode_rows(q: QuantizedTensor, n0: int, n1: int, macro_block: int) -> torch.Tensor:
    """Weight rows n0..n1 as operand values, fp32 [rows, K]: vw * 2^(ew-127) of an E8M0 weight
    by the C++ decoder without its MBS bytes (the factors stay apart); an MX+ or NVFP4 weight by
    the spec's block decoder (formats) with the NVFP4 global scale set to 1, giving the exact
    (value * s) * 1 = value * s that the spec then multiplies by g."""
    spec, k = q.spec, q.shape[-1]
    if not (spec.has_global_scale or spec.block_max_mantissa):
        return torch.ops.vllm_mxplus.cpu_dequant_weight(
            q.codes[n0:n1],
            q.scales[n0:n1],
            cpu_kernels.empty_mbs(q.codes.device),
            k,
            spec.block_size,
            macro_block,
        )
    bm = q.block_max_index
    rows = dataclasses.replace(
        q,
        codes=q.codes[n0:n1],
        scales=q.scales[n0:n1],
        shape=torch.Size((n1 - n0, k)),
        block_max_index=None if bm is None else bm[n0:n1],
        global_scale=None if q.global_scale is None else torch.ones((), device=q.codes.device),
    )
    return rows.dequantize()


@dataclass
class ExactBf16Weight:
    """A weight [N, K] as the path's operand: bf16 [N, chunks*chunk] (exact; zero-padded; 2
    bytes per weight) of vw * 2^(ew-127), MX+ block maxima included, or of NVFP4's vw * sw;
    the MBS factors Fw fp32 [N, chunks] or None; the NVFP4 global scales gw fp32 [N] or None;
    with what the path needs to run it."""

    operand: torch.Tensor | None  # None where `tiles` or `packed` holds it
    fw: torch.Tensor | None
    gw: torch.Tensor | None
    n: int
    k: int
    weight: FormatSpec
    activation: FormatSpec
    macro_block: int
    # the operand in AMX tile layout (`amx_pack`: bf16 [Np/16, Kp/32, 16, 32], Np and Kp
    # zero-padded to `TILE_PAD`) and the reciprocals 1/Fw fp32 [chunks, Np] (padding 1) where
    # the GEMM runs on AMX tiles (csrc/mx_amx_cpu.cpp); None for torch's GEMM
    tiles: torch.Tensor | None = None
    rw: torch.Tensor | None = None
    # E8M0 weights on AMX tiles: no bf16 copy at all; the GEMM decodes the same B tiles per
    # task from the integer kernels' packed codes and scales (`cpu_pack_weight`, ~0.57 byte
    # per weight, shared with the integer kernels): (codes, scales, MBS bytes), `tiles` None
    packed: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None
    # E8M0 weights on AMX-INT8 hosts (`int8_tiles`): the `linear_args` of cpu_amx_int8_linear,
    # which runs the packed weight on int8 tiles instead of the bf16 tile GEMM; else None
    int8: tuple | None = None
    # with `int8`: the int8 B tiles and their fold data decoded at load (`amx_int8_hold`,
    # VLLM_MXPLUS_CPU_INT8_HELD=1), or None: decoded from `packed` per call
    held: tuple[torch.Tensor, torch.Tensor] | None = None

    @classmethod
    def from_quantized(
        cls,
        q: QuantizedTensor,
        scheme: Scheme,
        tiles: bool = False,
        packed: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None,
        int8: bool | None = None,
        held: bool | None = None,
    ) -> ExactBf16Weight:
        """The operand of weight q for the scheme's activations (and macro block): the pair
        of q's own format and the scheme's activation format must be one the path `takes`.
        tiles: run it on AMX tiles (`amx_tiles` says where it runs): an E8M0 weight from its
        packed FP4 tiles (`packed`, the integer kernels' codes, scales and MBS bytes of q: the
        caller's, shared; packed here when None), NVFP4 and MX+ from a bf16 copy in tile
        layout (2 bytes per weight); else torch's row-major bf16 operand. int8: an E8M0
        weight on tiles runs on AMX-INT8 (`cpu_amx_int8_linear`) rather than the bf16 tile
        GEMM; None: where this host and scheme take it (`int8_tiles`)."""
        w, a = q.spec, scheme.activation
        ok, why = takes(dataclasses.replace(scheme, weight_format=w.name))
        if not ok:
            raise ValueError(why)
        loaded, why = cpu_kernels.load()
        if not loaded:
            raise RuntimeError(f"mxplus CPU kernels unavailable: {why}")
        n, k = q.codes.shape[0], q.shape[-1]
        chunk = scheme.macro_block if (w.mbs or a.mbs) else k
        chunks = ceil_div(k, chunk)
        fw = _mbs_factors(q._field("mbs"), chunks) if w.mbs else None
        gw = cpu_kernels.nvfp4_row_global_scales(q).clone() if w.has_global_scale else None
        out = cls(None, fw, gw, n, k, w, a, scheme.macro_block)
        if tiles and out.e8m0:
            if packed is None:
                packed = cpu_kernels.pack_weight(
                    q.codes,
                    q.scales,
                    q._field("mbs") if w.mbs else None,
                    k,
                    w,
                    scheme.macro_block,
                )
            out.packed = packed
            if int8 is None:
                int8 = int8_tiles(dataclasses.replace(scheme, weight_format=w.name))[0]
            if int8:
                out.int8 = cpu_kernels.linear_args(w, a, n, k, scheme.macro_block)
                if held if held is not None else settings.cpu_int8_held():
                    out.held = cpu_kernels.amx_int8_hold(out.int8, *packed)
        else:
            operand = torch.zeros(n, chunks * chunk, dtype=torch.bfloat16, device=q.codes.device)
            for n0 in range(0, n, ROW_TILE):  # decoded in row tiles: no whole fp32 copy at once
                n1 = min(n, n0 + ROW_TILE)
                operand[n0:n1, :k] = _decode_rows(q, n0, n1, scheme.macro_block)
            if tiles:
                out.tiles = amx_pack(_pad_to(operand, TILE_PAD, out.kp_tiles))
            else:
                out.operand = operand
        if tiles and out.chunked:
            f = fw if fw is not None else torch.ones(n, chunks)
            out.rw = _pad_to(1.0 / f, TILE_PAD, chunks, value=1.0).t().contiguous()
        return out

    @property
    def min_m(self) -> int:
        """Rows per call from which the path serves: INT8_MIN_M on int8 tiles, else MIN_M."""
        return INT8_MIN_M if self.int8 is not None else MIN_M

    @property
    def e8m0(self) -> bool:
        """An E8M0 weight (no NVFP4 global scale, no MX+ block maxima)."""
        return not (self.weight.has_global_scale or self.weight.block_max_mantissa)

    @property
    def on_tiles(self) -> bool:
        """The GEMM runs on AMX tiles (`cpu_amx_gemm` / `cpu_amx_packed_gemm`)."""
        return self.tiles is not None or self.packed is not None

    @property
    def kp_tiles(self) -> int:
        """K of the tile layout: the chunks (each a multiple of 32 with MBS), else K rounded
        up to a multiple of 32 (one chunk)."""
        return self.chunks * self.chunk if self.chunked else ceil_div(self.k, TILE_PAD) * TILE_PAD

    @property
    def chunked(self) -> bool:
        """MBS on either side: one fp32 partial sum per macro chunk."""
        return bool(self.weight.mbs or self.activation.mbs)

    @property
    def chunk(self) -> int:
        return self.macro_block if self.chunked else self.k

    @property
    def chunks(self) -> int:
        return ceil_div(self.k, self.chunk)

    @property
    def roundings(self) -> int:
        """n of the bound's gamma_n (module docstring): the most fp32 roundings on one
        product's way into y, plus one for the float64 evaluation of y64 and S."""
        in_chunk = min(self.chunk, self.k) - 1  # the GEMM's additions, any order
        after = self.chunks if self.chunked else 0  # a division per chunk, n_c - 1 additions
        if self.chunked and self.on_tiles:
            after += 3  # fl(1/Fa), fl(1/Fw), their product; a fused multiply-add per chunk
        spec = 0  # the spec's own roundings of x_hat and w_hat (none: E2M1 * 2^e, MX+)
        if self.chunked:
            spec = 2  # x_hat = fl(a / Fa), w_hat = fl(w / Fw)
        if self.gw is not None:
            after, spec = 2, 2  # G = fl(ga * gw), fl(P * G); x_hat = fl(a * ga), fl(w * gw)
        return in_chunk + after + 1 + spec + 1  # + the bias, + y64

    def weight_rows(self, n0: int, n1: int) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Rows n0..n1 as the GEMM's operand: (vw * 2^(ew-127) or vw * sw, fp32 [rows,
        chunks*chunk], zero-padded; Fw [rows, chunks] or None)."""
        rows = self.operand[n0:n1] if self.operand is not None else self._untiled(n0, n1)
        return rows.float(), None if self.fw is None else self.fw[n0:n1]

    def _untiled(self, n0: int, n1: int) -> torch.Tensor:
        t = self.tiles
        if t is None:  # the packed tiles, by the scalar reference decoder
            assert self.packed is not None
            codes, scales, _ = self.packed
            t = torch.ops.vllm_mxplus.cpu_amx_unpack(
                codes, scales, self.weight.block_size, self.k, self.n, self.kp_tiles, True
            )
        full = t.view(t.shape[0], t.shape[1], 16, 16, 2).permute(0, 3, 1, 2, 4)
        return full.reshape(t.shape[0] * 16, -1)[n0:n1, : self.chunks * self.chunk]


def act_operand(
    x2d: torch.Tensor, activation: FormatSpec, macro_block: int, chunk: int, chunks: int
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """Rows x [M, K] as the GEMM's operand: (a fp32 [M, chunks*chunk], zero padded, NaN in a
    block with the NaN scale; Fa [M, chunks] or None; ga fp32 [M] or None). a is va * 2^(ea-127)
    (E8M0, MX+ block maxima included) from `cpu_act_quant`'s codes, E8M0 codes and MBS bytes,
    or va * sa (NVFP4) from `cpu_nvfp4_act_quant`'s codes, E4M3 bytes and row global scales:
    both bit-exact with formats.quantize (per row for NVFP4). The int8 codes are 2 * value, so
    each block's codes are multiplied by half its scale: 2^(ea-128), or sa / 2 (>= 2^-10)."""
    ga = None
    if activation.has_global_scale:
        codes, sbytes, ga = cpu_kernels.nvfp4_act_quant(x2d)
        half = _nvfp4_half(sbytes)
        mbs = None
    else:
        codes, e, mbs = cpu_kernels.act_quant(x2d, activation, macro_block)
        half = _HALF_SCALE.to(x2d.device)[e.long()]
    m, k = codes.shape
    block = activation.block_size
    nb = half.shape[1]
    a = torch.zeros(m, nb * block, dtype=torch.float32, device=x2d.device)
    a[:, :k] = codes
    a = (a.view(m, nb, block) * half[..., None]).view(m, -1)
    kp = chunks * chunk
    a = a[:, :kp] if a.shape[1] >= kp else torch.nn.functional.pad(a, (0, kp - a.shape[1]))
    f = _mbs_factors(mbs, chunks) if mbs is not None and activation.mbs else None
    return a, f, ga


def _nvfp4_half(sbytes: torch.Tensor) -> torch.Tensor:
    """Half of each NVFP4 E4M3 block scale (the codes are 2 * value), fp32, exact (>= 2^-10);
    NaN for the NaN scale."""
    return sbytes.view(torch.float8_e4m3fn).to(torch.float32) * 0.5


def global_product(ga: torch.Tensor, gw: torch.Tensor) -> torch.Tensor:
    """G = fl(ga[m] * gw[n]) [M, rows]: the NVFP4 global scales of one output, one fp32
    rounding (the integer kernel's (ga * gw) * 1/4 without the 1/4 of its doubled codes)."""
    return ga[:, None] * gw[None, :]


def linear(
    x: torch.Tensor,
    w: ExactBf16Weight,
    bias: torch.Tensor | None,
    out_dtype: torch.dtype,
    amx: bool = True,
) -> torch.Tensor:
    """Q_act(x) @ W_hat^T (+ bias) by the exact-bf16 path; amx: oneDNN's bf16 math mode on
    (False: the same fp32 GEMM without it, for hosts without native bf16 and for tests)."""
    if w.int8 is not None and w.packed is not None:  # the whole linear in one op, any shape
        rw = w.rw if w.rw is not None else _EMPTY
        return cpu_kernels.amx_int8_linear(x, w.int8, *w.packed, rw, bias, out_dtype, w.held)
    lead = x.shape[:-1]
    x2d = x.reshape(-1, w.k)
    m = x2d.shape[0]
    if m == 0:
        return torch.empty(*lead, w.n, dtype=out_dtype, device=x.device)
    if w.on_tiles:
        return _tiled(x2d, w, bias, out_dtype).reshape(*lead, w.n)
    out = torch.empty(m, w.n, dtype=torch.float32, device=x.device)
    a, fa, ga = act_operand(x2d, w.activation, w.macro_block, w.chunk, w.chunks)
    with bf16_math() if amx else _nothing():
        for n0 in range(0, w.n, ROW_TILE):
            n1 = min(w.n, n0 + ROW_TILE)
            wt, fw = w.weight_rows(n0, n1)
            if w.chunked:
                out[:, n0:n1] = _chunked(a, fa, wt, fw, w.chunk, w.chunks)
            elif ga is None or w.gw is None:
                out[:, n0:n1] = a @ wt.t()
            else:  # NVFP4: P * fl(ga * gw), the global scales outside the bf16 operands
                out[:, n0:n1] = (a @ wt.t()).mul_(global_product(ga, w.gw[n0:n1]))
    if bias is not None:
        out += bias.to(torch.float32)
    return out.to(out_dtype).reshape(*lead, w.n)


@contextmanager
def _nothing() -> Iterator[None]:
    yield


# ------------------------------------------------------------------ the GEMM on AMX tiles
TILE_PAD = 32  # rows, columns and K of the AMX layout are padded to a multiple of this


def amx_tiles(scheme: Scheme) -> tuple[bool, str]:
    """Whether the path's GEMM runs on AMX-BF16 tiles (`cpu_amx_gemm`) for this scheme: the
    host takes the path (`host_choice`), the kernels were built with AMX code, and with MBS
    the macro block is a multiple of 32 (a chunk of whole tile steps). (True, "") or (False,
    why); elsewhere the path's GEMM is torch's (oneDNN)."""
    ok, why = host_choice()
    if not ok:
        return False, why
    loaded, why = cpu_kernels.load()
    if not loaded:
        return False, why
    if not torch.ops.vllm_mxplus.cpu_amx_available():  # cpuid and the permission, in C++
        return False, "no AMX-BF16 tiles in this process (CPU, permission or compiler)"
    if (scheme.weight.mbs or scheme.activation.mbs) and scheme.macro_block % TILE_PAD:
        return False, f"macro block {scheme.macro_block} is not a multiple of {TILE_PAD}"
    return True, ""


def int8_tiles(scheme: Scheme) -> tuple[bool, str]:
    """Whether E8M0 weights of this scheme run on AMX-INT8 tiles (`cpu_amx_int8_linear`):
    the GEMM runs on AMX tiles (`amx_tiles`), the scheme is an E8M0 pair, the C++ side finds
    AMX-INT8 and the tile permission, and with MBS the macro block is a multiple of 64 (a
    chunk of whole int8 steps). (True, "") or (False, why)."""
    ok, why = amx_tiles(scheme)
    if not ok:
        return False, why
    if scheme.weight.has_global_scale or scheme.weight.block_max_mantissa:
        return False, f"{scheme.weight.name} weights are not E8M0 (int8 tiles take E8M0 only)"
    if not torch.ops.vllm_mxplus.cpu_amx_int8_available():
        return False, "no AMX-INT8 tiles in this process (CPU, permission or compiler)"
    if (scheme.weight.mbs or scheme.activation.mbs) and scheme.macro_block % 64:
        return False, f"macro block {scheme.macro_block} is not a multiple of 64"
    return True, ""


def amx_pack(operand: torch.Tensor) -> torch.Tensor:
    """bf16 [Np, Kp] (multiples of 16 and 32) -> the B tiles of `tdpbf16ps`, bf16 [Np/16, Kp/32,
    16, 32]: per 16 columns and 32-K step, row r holds the 16 columns' pairs (k = 2r, 2r+1)."""
    n, k = operand.shape
    tiles = operand.view(n // 16, 16, k // 32, 16, 2).permute(0, 2, 3, 1, 4)
    return tiles.contiguous().view(n // 16, k // 32, 16, 32)


def _pad_to(t: torch.Tensor, rows: int, cols: int, value: float = 0.0) -> torch.Tensor:
    """t [R, C] zero- (or value-) padded to rows a multiple of `rows` and exactly cols columns."""
    r, c = t.shape
    pad = (0, cols - c, 0, ceil_div(r, rows) * rows - r)
    return torch.nn.functional.pad(t, pad, value=value) if any(pad) else t.contiguous()


def _tiled(
    x2d: torch.Tensor, w: ExactBf16Weight, bias: torch.Tensor | None, out_dtype: torch.dtype
) -> torch.Tensor:
    """Q_act(x) @ W^T (+ bias) [M, N] of out_dtype on AMX tiles: the activation operand
    expanded to bf16 by `cpu_amx_act_operand` (codes times half their block scale, exact), the
    chunks' partial sums scaled by fl(1/Fa) * fl(1/Fw), then NVFP4's P * fl(ga * gw), the bias
    and the cast, all in `cpu_amx_gemm` (the same operations in the same order as `linear`;
    `cpu_amx_packed_gemm` for a packed E8M0 weight, its B tiles decoded per task)."""
    ops = torch.ops.vllm_mxplus
    m, act = x2d.shape[0], w.activation
    mp, kp = ceil_div(m, TILE_PAD) * TILE_PAD, w.kp_tiles
    ga = None
    if act.has_global_scale:  # NVFP4 (never chunked): codes and E4M3 bytes, then expanded
        codes, sbytes, ga = cpu_kernels.nvfp4_act_quant(x2d)
        a = ops.cpu_amx_act_operand(codes, _nvfp4_half(sbytes), act.block_size, mp, kp)
        ra = _EMPTY
        ga = ga.reshape(-1).contiguous()
    else:  # quantized and expanded in one pass, with fl(1/Fa) per chunk (none: [Mp, 0])
        chunks = w.chunks if w.chunked else 0
        a, ra = cpu_kernels.amx_act_quant(x2d, act, w.macro_block, mp, kp, chunks)
    rw = w.rw if w.rw is not None else _EMPTY
    chunk = w.chunk if w.chunked else kp
    gw = w.gw if ga is not None else None
    b = None if bias is None else bias.to(torch.float32).contiguous()
    if w.packed is not None:
        codes, scales, _ = w.packed
        block = w.weight.block_size
        return ops.cpu_amx_packed_gemm(
            a, codes, scales, block, w.k, ra, rw, chunk, m, w.n, b, out_dtype
        )
    return ops.cpu_amx_gemm(a, w.tiles, ra, rw, chunk, m, w.n, ga, gw, b, out_dtype)


_EMPTY = torch.empty(0)


def _chunked(
    a: torch.Tensor,
    fa: torch.Tensor | None,
    wt: torch.Tensor,
    fw: torch.Tensor | None,
    chunk: int,
    chunks: int,
) -> torch.Tensor:
    """sum over c of (A_c W_c^T) / (Fa[:, c] Fw[:, c]) for one tile of weight rows: batched
    GEMMs over groups of chunks, each partial sum divided once by the exact product."""
    m, rows = a.shape[0], wt.shape[0]
    acc = torch.zeros(m, rows, dtype=torch.float32, device=a.device)
    group = max(1, min(chunks, PARTIAL_BYTES // max(1, 4 * m * rows)))
    av = a.view(m, chunks, chunk)
    wv = wt.view(rows, chunks, chunk)
    for c0 in range(0, chunks, group):
        c1 = min(chunks, c0 + group)
        p = torch.bmm(av[:, c0:c1].transpose(0, 1), wv[:, c0:c1].permute(1, 2, 0))
        one_a = torch.ones(m, c1 - c0, device=a.device)
        one_w = torch.ones(rows, c1 - c0, device=a.device)
        da = (fa[:, c0:c1] if fa is not None else one_a).t()[:, :, None]
        dw = (fw[:, c0:c1] if fw is not None else one_w).t()[:, None, :]
        p /= da * dw  # Fa * Fw: a product of two 9-bit significands, exact
        acc += p.sum(0)
    return acc


# ------------------------------------------------------------------ first-use self-test
_VERDICT: dict[tuple, tuple[bool, str]] = {}


def bound(
    x_hat: torch.Tensor,
    w_hat: torch.Tensor,
    bias: torch.Tensor | None,
    roundings: int,
    global_scales: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(y64, bound) of the module docstring for spec values x_hat [M, K], w_hat [N, K]:
    gamma_n S + 2^-124 (|x_hat|_1 + |w_hat|_1 + K) with n = `ExactBf16Weight.roundings`;
    global_scales (NVFP4: the spec's ga [M] or [M, 1], gw [N]) adds 2^-125 K 2688^2 where
    0 < ga gw < 2^-126."""
    xd, wd = x_hat.double(), w_hat.double()
    y = xd @ wd.T
    scale = xd.abs().nan_to_num() @ wd.abs().nan_to_num().T
    if bias is not None:
        y = y + bias.double()
        scale = scale + bias.double().abs()
    k = x_hat.shape[-1]
    l1 = xd.abs().nan_to_num().sum(-1, keepdim=True) + wd.abs().nan_to_num().sum(-1)[None, :]
    gamma = roundings * U / (1 - roundings * U)
    b = gamma * scale + 2.0**-124 * (l1 + k)
    if global_scales is not None:
        ga, gw = (g.double().reshape(-1) for g in global_scales)
        g = ga[:, None] * gw[None, :]  # exact in float64
        b = b + torch.where(
            (g > 0) & (g < FP32_TINY), 2.0 * FP32_TINY * k * NVFP4_OPERAND_MAX**2, 0.0
        )
    return y, b


def self_test(scheme: Scheme, amx: bool = True, tiles: bool = False) -> tuple[bool, str]:
    """The path on a small problem (M = MIN_M + 3, K with a partial block and a partial chunk,
    blocks whose scales spread past one int8 fold in some rows and one column tile, rows whose
    two 64-element steps of one 128-element unit lie one fold apart; the other column block's
    tiles fold, so the int8 tiles' unit path runs too) against
    `vllm_mxplus.formats` within the bound; cached per (scheme, macro block, amx, tiles);
    tiles: the GEMM on AMX tiles (`amx_tiles`; E8M0 on int8 tiles where `int8_tiles` says).
    (True, "") or (False, the first output out of bound)."""
    key = (scheme.name, scheme.macro_block, amx, tiles)
    if key in _VERDICT:
        return _VERDICT[key]
    g = torch.Generator().manual_seed(0)
    n, k, m = 80, 2 * scheme.macro_block + 40, MIN_M + 3
    wsrc = torch.randn(n, k, generator=g) * 0.05
    wsrc[3, 16:32] *= 2.0**6  # block scales 6 apart: one 16-column tile past any fold
    wq = quantize(wsrc, scheme.weight_format, macro_block=scheme.macro_block)
    x = torch.randn(m, k, generator=g)
    x[::5, 16:32] *= 2.0**5  # rows whose scales need two folds of the int8 tiles
    x[(3, 9), 48:64] *= 2.0**9  # and two rows (one 16-row tile) a product per block
    x[1::7, 128:192] *= 2.0**5  # a step two folds above the other of its unit
    x = x.to(torch.bfloat16)
    bias = torch.randn(n, generator=g)
    w = ExactBf16Weight.from_quantized(wq, scheme, tiles=tiles)
    y = linear(x, w, bias, torch.float32, amx)
    xq = quantize(
        x,
        scheme.activation_format,
        macro_block=scheme.macro_block,
        per_row=scheme.activations_per_row,
    )
    gs = None
    if xq.global_scale is not None:
        gs = (xq.global_scale, cpu_kernels.nvfp4_row_global_scales(wq))
    y64, b = bound(xq.dequantize(), wq.dequantize(), bias, w.roundings, gs)
    bad = ~((y.double() - y64).abs() <= b)
    if bad.any():
        i, j = bad.nonzero()[0].tolist()
        verdict = (
            False,
            f"M={m}, N={n}, K={k}: y[{i}, {j}] = {float(y[i, j])}, want {float(y64[i, j])} "
            f"± {float(b[i, j]):.3g} ({int(bad.sum())} of {bad.numel()} outside the bound)",
        )
    else:
        verdict = (True, "")
    _VERDICT[key] = verdict
    if not verdict[0]:
        log_once(
            logger,
            ("exact-bf16", key),
            logging.ERROR,
            "mxplus self-test: the exact-bf16 CPU path is REJECTED for %s: %s. The integer "
            "kernels serve every M; please report this with the CPU model and versions.",
            scheme,
            verdict[1],
        )
    return verdict
