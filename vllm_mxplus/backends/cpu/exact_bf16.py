"""The exact-bf16 GEMM path of the CPU backend for large M (docs/cpu_kernels.md, "Large M on
AMX hosts"): the E8M0 formats' operands are exact in bf16, so a bf16 GEMM with fp32
accumulation (AMX-BF16 through oneDNN where the CPU has it) computes the W4A4 linear within a
derived bound of the spec.

    operand a_k = va_k * 2^(ea_b - 127)       (activation codes of `cpu_act_quant`, bit-exact)
    operand w_k = vw_k * 2^(ew_b - 127)       (weight codes decoded once at load by
                                               `cpu_dequant_weight`, kept in bf16: exact)
    P_c[m, n]   = sum over k in macro chunk c of a_k w_k      (fp32 accumulation, any order)
    y[m, n]     = sum over c of P_c / (Fa[m, c] * Fw[n, c])   (+ bias)

va, vw are E2M1 values (2 significant bits) and 2^e a power of two, so a_k and w_k are exact
bf16 values (and exact fp32 values); each product a_k w_k is exact in fp32 (at most 4
significant bits) until it falls below fp32's normal range. The MBS factors F = 1 + m/256 are
not bf16-exact, so they are not folded into the operands: with MBS on either side each macro
chunk is its own GEMM (batched) and its fp32 partial sum is divided by the exact product
Fa * Fw, as in the integer kernel; without MBS the whole row is one chunk (one GEMM).

The GEMM is torch's fp32 matmul with oneDNN's bf16 math mode switched on for the call
(`torch.backends.mkldnn.matmul.fp32_precision = "bf16"`, restored after): on a CPU with AMX-BF16
or AVX512-BF16 oneDNN converts the fp32 operands to bf16 (exact here) and accumulates in fp32
on the tiles; elsewhere the mode does nothing and the same fp32 GEMM runs. Error bound
(derivation in docs/cpu_kernels.md; u = 2^-24, L the longest chunk's length in K, 128 with MBS
and K without, n_c chunks, x_hat and w_hat the spec's values, y64 the float64 sum):

    |y - y64| <= (L + n_c + 5) u (sum_k |x_hat_k| |w_hat_k| + |b|)
                 + 2^-124 (sum_k |x_hat_k| + sum_k |w_hat_k| + K)

The absolute term covers AMX-BF16's denormals-are-zero inputs and flushed fp32 outputs.

Which hosts use it (`host_choice`): CPUs with `amx_bf16` in cpuinfo and the AMX tile
permission granted, for M >= MIN_M rows; every other CPU keeps the integer kernels (on an
AVX2 CPU the fp32 GEMM is slower than them: benchmarks/bench_cpu_linear.py --exact-bf16).
The first use on a host runs `self_test` against `vllm_mxplus.formats`; a failure is logged as
an ERROR and the integer kernels serve.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch

from vllm_mxplus.backends.cpu import kernels as cpu_kernels
from vllm_mxplus.formats import FormatSpec, QuantizedTensor, Scheme, fake_quantize, quantize
from vllm_mxplus.formats.constants import ceil_div
from vllm_mxplus.log_once import log_once
from vllm_mxplus.platform_amx import AmxResult, cpu_flags, read_cpuinfo, request_amx_permission

logger = logging.getLogger(__name__)

MIN_M = 64  # rows per call from which AMX hosts take this path (unmeasured on AMX: see docs)
ROW_TILE = 512  # weight rows decoded per step (bounds the fp32 temporaries)
PARTIAL_BYTES = 32 << 20  # fp32 partial sums [chunks, M, rows] per batched GEMM, at most
U = 2.0**-24

# 2^(e - 128) for E8M0 codes e = 0..254 (half the block scale: the int8 operand is 2 * value);
# code 255 is NaN. Exact fp32 values (2^-128 and 2^-127 are subnormal, still exact).
_HALF_SCALE = torch.tensor(
    [math.ldexp(1.0, e - 128) for e in range(255)] + [math.nan], dtype=torch.float32
)


def host_choice(
    cpuinfo: str | None = None, permission: AmxResult | None = None
) -> tuple[bool, str]:
    """Whether this host runs the exact-bf16 path for large M: (True, "") with `amx_bf16` in
    cpuinfo and the AMX tile permission held, else (False, why); decided once per process.
    The arguments replace the real machine (tests; not cached)."""
    if cpuinfo is None and permission is None:
        if not _HOST:
            _HOST.extend(_host_choice(read_cpuinfo(), request_amx_permission()))
        return _HOST[0], _HOST[1]
    return _host_choice(
        read_cpuinfo() if cpuinfo is None else cpuinfo,
        request_amx_permission() if permission is None else permission,
    )


_HOST: list = []  # this process's (ok, why), once decided


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


@dataclass
class ExactBf16Weight:
    """A weight [N, K] of the E8M0 family as the path's operand: vw * 2^(ew-127) in bf16 [N,
    chunks*chunk] (exact; zero-padded; 2 bytes per weight) and the MBS factors Fw fp32 [N,
    chunks] or None, with what the path needs to run it."""

    operand: torch.Tensor
    fw: torch.Tensor | None
    n: int
    k: int
    weight: FormatSpec
    activation: FormatSpec
    macro_block: int

    @classmethod
    def from_quantized(cls, q: QuantizedTensor, scheme: Scheme) -> ExactBf16Weight:
        w, a = scheme.weight, scheme.activation
        if not (w.scale_is_e8m0 and a.scale_is_e8m0) or w.block_max_mantissa:
            raise ValueError(
                f"the exact-bf16 path takes E8M0 weights without block maxima, not {w.name}"
            )
        if a.block_max_mantissa or w.block_size != a.block_size:
            raise ValueError(
                f"the exact-bf16 path needs E8M0 activations of the weights' block size, "
                f"not {a.name} with {w.name}"
            )
        n, k = q.codes.shape[0], q.shape[-1]
        chunk = scheme.macro_block if (w.mbs or a.mbs) else k
        chunks = ceil_div(k, chunk)
        operand = torch.zeros(n, chunks * chunk, dtype=torch.bfloat16, device=q.codes.device)
        empty = cpu_kernels.empty_mbs(q.codes.device)
        for n0 in range(0, n, ROW_TILE):  # decoded in row tiles: no whole fp32 copy at once
            n1 = min(n, n0 + ROW_TILE)
            operand[n0:n1, :k] = torch.ops.vllm_mxplus.cpu_dequant_weight(
                q.codes[n0:n1], q.scales[n0:n1], empty, k, w.block_size, scheme.macro_block
            )
        fw = None
        if w.mbs:
            fw = _mbs_factors(q._field("mbs"), chunks)
        return cls(operand, fw, n, k, w, a, scheme.macro_block)

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

    def weight_rows(self, n0: int, n1: int) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Rows n0..n1 as the GEMM's operand: (vw * 2^(ew-127) fp32 [rows, chunks*chunk],
        zero-padded; Fw [rows, chunks] or None)."""
        return self.operand[n0:n1].float(), None if self.fw is None else self.fw[n0:n1]


def act_operand(
    x2d: torch.Tensor, activation: FormatSpec, macro_block: int, chunk: int, chunks: int
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Rows x [M, K] as the GEMM's operand: (va * 2^(ea-127) fp32 [M, chunks*chunk], zero
    padded, NaN in a block whose scale code is 255; Fa [M, chunks] or None). The codes, scale
    codes and MBS bytes are `cpu_act_quant`'s, bit-exact with formats.quantize."""
    codes, e, mbs = cpu_kernels.act_quant(x2d, activation, macro_block)
    m, k = codes.shape
    block = activation.block_size
    nb = e.shape[1]
    a = torch.zeros(m, nb * block, dtype=torch.float32, device=x2d.device)
    a[:, :k] = codes
    a = (a.view(m, nb, block) * _HALF_SCALE.to(a.device)[e.long()][..., None]).view(m, -1)
    kp = chunks * chunk
    a = a[:, :kp] if a.shape[1] >= kp else torch.nn.functional.pad(a, (0, kp - a.shape[1]))
    f = _mbs_factors(mbs, chunks) if activation.mbs else None
    return a, f


def linear(
    x: torch.Tensor,
    w: ExactBf16Weight,
    bias: torch.Tensor | None,
    out_dtype: torch.dtype,
    amx: bool = True,
) -> torch.Tensor:
    """Q_act(x) @ W_hat^T (+ bias) by the exact-bf16 path; amx: oneDNN's bf16 math mode on
    (False: the same fp32 GEMM without it, for hosts without native bf16 and for tests)."""
    lead = x.shape[:-1]
    x2d = x.reshape(-1, w.k)
    m = x2d.shape[0]
    out = torch.empty(m, w.n, dtype=torch.float32, device=x.device)
    if m == 0:
        return out.to(out_dtype).reshape(*lead, w.n)
    a, fa = act_operand(x2d, w.activation, w.macro_block, w.chunk, w.chunks)
    with bf16_math() if amx else _nothing():
        for n0 in range(0, w.n, ROW_TILE):
            n1 = min(w.n, n0 + ROW_TILE)
            wt, fw = w.weight_rows(n0, n1)
            if w.chunked:
                out[:, n0:n1] = _chunked(a, fa, wt, fw, w.chunk, w.chunks)
            else:
                out[:, n0:n1] = a @ wt.t()
    if bias is not None:
        out += bias.to(torch.float32)
    return out.to(out_dtype).reshape(*lead, w.n)


@contextmanager
def _nothing() -> Iterator[None]:
    yield


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
    x_hat: torch.Tensor, w_hat: torch.Tensor, bias: torch.Tensor | None, chunk: int, chunks: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """(y64, bound) of the module docstring for spec values x_hat [M, K], w_hat [N, K]."""
    xd, wd = x_hat.double(), w_hat.double()
    y = xd @ wd.T
    scale = xd.abs().nan_to_num() @ wd.abs().nan_to_num().T
    if bias is not None:
        y = y + bias.double()
        scale = scale + bias.double().abs()
    k = x_hat.shape[-1]
    l1 = xd.abs().nan_to_num().sum(-1, keepdim=True) + wd.abs().nan_to_num().sum(-1)[None, :]
    return y, (min(chunk, k) + chunks + 5) * U * scale + 2.0**-124 * (l1 + k)


def self_test(scheme: Scheme, amx: bool = True) -> tuple[bool, str]:
    """The path on a small problem (M = MIN_M + 3, K with a partial chunk) against
    `vllm_mxplus.formats` within the bound; cached per (scheme, amx). (True, "") or (False,
    the first output out of bound)."""
    key = (scheme.name, scheme.macro_block, amx)
    if key in _VERDICT:
        return _VERDICT[key]
    g = torch.Generator().manual_seed(0)
    n, k, m = 40, 2 * scheme.macro_block + 48, MIN_M + 3
    wq = quantize(
        torch.randn(n, k, generator=g) * 0.05, scheme.weight_format, macro_block=scheme.macro_block
    )
    x = torch.randn(m, k, generator=g).to(torch.bfloat16)
    bias = torch.randn(n, generator=g)
    w = ExactBf16Weight.from_quantized(wq, scheme)
    y = linear(x, w, bias, torch.float32, amx)
    x_hat = fake_quantize(x, scheme.activation_format, macro_block=scheme.macro_block)
    y64, b = bound(x_hat, wq.dequantize(), bias, w.chunk, w.chunks)
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
