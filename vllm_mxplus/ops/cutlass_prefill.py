"""CUTLASS prefill GEMM for MXFP4-MBS (DESIGN.md §3): binding, re-encoding, backend.

Two kernels, both computing y = Q(x) W_hat^T (+ bias) in bf16 with MBS applied per 128-K chunk
(paper §4.3.2): acc = sum_c sigma_a[i,c] sigma_b[j,c] (A_c B_c^T)[i,j], sigma = 1/F.

- sm_90a (H100/H200, no FP4 tensor cores): every 16-block is re-encoded as FP8 E4M3 relative to
  a per-(row, chunk) reference exponent `ref`; one fp32 scale 2^(ref-127)·sigma per (row, chunk)
  feeds CUTLASS's blockwise-scaled FP8 GEMM (scale granularity 1 x 128 on both operands).
- sm_100a (B200): native block-scaled FP4 MMA, UE8M0 scales at block 16, MBS in the epilogue of
  one partial GEMM per chunk (kernels/sm100_fp4_mbs.cu says what remains for speed).

Lossless FP8 re-encoding. An element is value(code)·2^(s-127)/F with value = 2^p·{1, 1.5},
p in {-1..2}. With d = s - ref its FP8 code must hold value·2^d. E4M3 (fn) holds 2^q for
q in [-9, 8] (2^-9 is its smallest subnormal) and 1.5·2^q for q in [-8, 8] (448 = 1.75·2^8
is the max). Taking ref = (largest block exponent of the chunk) - 6 puts the top block at
d = 6 (6·2^6 = 384 <= 448; d = 7 would give 768). Every E2M1 value is then exact for
d in [-8, 6] (0.5·2^-8 = 2^-9 and 1.5·2^-8 = 3·2^-9 are subnormals), so a chunk whose nonzero
block exponents span <= 14 binades is always lossless. The exact per-element condition is
weaker (value 4 survives down to d = -11); `encode_fp8_chunks` tests every element by an FP8
round trip and marks the chunk `exact` only if all survive and the folded scale is a normal
fp32 (ref >= 2). Rows with an inexact chunk (also NaN blocks, scale 255) are computed by the
reference formula instead (`prefill_gemm`), so results never silently lose elements.

Activations on sm_90a: `CutlassPrefillBackend.apply` (via `prefill_gemm_from_x`) builds the
activation layout in one Triton kernel straight from x (`triton_act_fp8.act_quant_fp8_chunks`,
bit-identical to the Triton act-quant followed by `encode_fp8_chunks`); `encode_fp8_chunks`
stays the definition, the weight encoder (once, at load) and the path of `prefill_gemm`, which
starts from already-quantized activations.
"""

from __future__ import annotations

import importlib.machinery
import importlib.util
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import torch
import torch.nn.functional as F

from vllm_mxplus.formats import (
    MACRO_BLOCK,
    QuantizedTensor,
    fake_quantize,
    get_format,
    get_scheme,
)
from vllm_mxplus.formats.e2m1 import e2m1_decode, unpack_fp4
from vllm_mxplus.formats.e8m0 import pow2_f32
from vllm_mxplus.formats.mx import dequantize_mbs, mbs_factor
from vllm_mxplus.ops.backend import LinearBackend, LinearSpec

CHUNK = MACRO_BLOCK  # 128: the K extent of one scale / one partial GEMM
BLOCK = 16
BLOCK_PER_CHUNK = CHUNK // BLOCK
TOP_SHIFT = 6  # 6 * 2^6 = 384 <= F8E4M3_MAX; 6 * 2^7 = 768 is not
F8E4M3_MAX = 448.0  # 1.75 * 2^8
MIN_EXACT_REF = 2  # 2^(ref-127) * sigma stays a normal fp32 (sigma in (0.5, 1])
E8M0_NAN = 255
PREFILL_MIN_M = int(os.environ.get("VLLM_MXPLUS_PREFILL_MIN_M", "17"))  # decode: M <= 16
EXT_ENV = "VLLM_MXPLUS_CUTLASS_EXT"  # path of the built mxplus_cutlass*.so
LIB = "vllm_mxplus"


# ----------------------------------------------------------------------------- re-encoding
@dataclass
class Fp8ChunkLayout:
    """One operand [R, K] re-encoded for the sm_90a GEMM (K padded to whole chunks, Kp).

    fp8: float8_e4m3fn [R, Kp]; scale: fp32 [Kp/128, R] = 2^(ref-127) / F folded (kernel);
    ref: int32 [R, nc]; mbs: uint8 [R, nc]; exact: bool [R, nc] (chunk reproduced exactly).
    """

    fp8: torch.Tensor
    scale: torch.Tensor
    ref: torch.Tensor
    mbs: torch.Tensor
    exact: torch.Tensor
    k: int

    @property
    def exact_rows(self) -> torch.Tensor:
        return self.exact.all(dim=-1)


def _ceil_to(a: int, b: int) -> int:
    return -(-a // b) * b


def _pad_last(t: torch.Tensor, n: int, value: int = 0) -> torch.Tensor:
    return F.pad(t, (0, n - t.shape[-1]), value=value) if t.shape[-1] < n else t


def encode_fp8_chunks(
    codes: torch.Tensor, scales: torch.Tensor, mbs: Optional[torch.Tensor], k: int
) -> Fp8ChunkLayout:
    """E2M1 codes [R, ceil(K/2)] + E8M0 scales [R, ceil(K/16)] + MBS bytes [R, ceil(K/128)]
    (None: F = 1) -> the FP8 per-(row, chunk) layout. Pure torch, any device."""
    r = codes.shape[0]
    kp = _ceil_to(k, CHUNK)
    nc, nb = kp // CHUNK, kp // BLOCK
    c = F.pad(unpack_fp4(codes, k), (0, kp - k))  # [R, Kp] codes 0..15
    s = _pad_last(scales, nb).to(torch.int32)  # padded blocks: code 0, all-zero elements
    m = _pad_last(mbs, nc) if mbs is not None else codes.new_zeros((r, nc))
    nonzero_block = ((c & 7) != 0).view(r, nb, BLOCK).any(-1)
    s_live = torch.where(nonzero_block, s, torch.full_like(s, -1)).view(r, nc, BLOCK_PER_CHUNK)
    s_max = s_live.amax(-1)  # -1: an all-zero chunk
    ref = torch.where(s_max >= 0, s_max - TOP_SHIFT, torch.full_like(s_max, 127))
    d = s.view(r, nc, BLOCK_PER_CHUNK) - ref[..., None]  # [R, nc, 8]
    d = d.clamp(-149, 127).repeat_interleave(BLOCK, dim=-1).view(r, kp)
    val = e2m1_decode(c) * pow2_f32(d)  # exact fp32 (|d| is small where it matters)
    fp8 = val.to(torch.float8_e4m3fn)
    # An element survives if FP8 holds it exactly and it did not underflow to 0 in fp32.
    ok = (fp8.to(torch.float32) == val) & ((val != 0) | ((c & 7) == 0))
    survives = ok.view(r, nc, CHUNK).all(-1)
    no_nan = (s.view(r, nc, BLOCK_PER_CHUNK) != E8M0_NAN).all(-1)
    exact = survives & no_nan & (ref >= MIN_EXACT_REF)
    sigma = 1.0 / mbs_factor(m)  # fp32(1/F); the kernel folds it with the power of two
    scale = pow2_f32((ref - 127).clamp(-149, 127)) * sigma
    return Fp8ChunkLayout(fp8=fp8, scale=scale.t().contiguous(), ref=ref, mbs=m.to(torch.uint8),
                          exact=exact, k=k)



def dequantize_fp8_chunks(layout: Fp8ChunkLayout) -> torch.Tensor:
    """(fp8 · 2^(ref-127)) / F per element, fp32 [R, K]: bit-exact to formats' x_hat on every
    `exact` chunk (the power of two is exact; the division is the spec's IEEE division)."""
    r, kp = layout.fp8.shape
    pow2 = pow2_f32(layout.ref - 127).repeat_interleave(CHUNK, dim=-1)
    f = mbs_factor(layout.mbs).repeat_interleave(CHUNK, dim=-1)
    return ((layout.fp8.to(torch.float32) * pow2) / f)[:, : layout.k]


def dequantize_folded(layout: Fp8ChunkLayout) -> torch.Tensor:
    """fp8 · scale, what the kernel multiplies by (fp32(1/F) folded): equal to x_hat within
    one fp32 rounding (used only for documentation tests; the GEMM sums these)."""
    return (layout.fp8.to(torch.float32) * layout.scale.t().repeat_interleave(CHUNK, -1))[
        :, : layout.k]


# ----------------------------------------------------------------------------- extension
_EXT = None
_EXT_ERROR = "not loaded yet"


def _candidate_paths() -> list[Path]:
    paths = [Path(os.environ[EXT_ENV])] if os.environ.get(EXT_ENV) else []
    build = Path(__file__).resolve().parents[2] / "kernels" / "build"
    return paths + sorted(build.glob("mxplus_cutlass*.so"))


def load_extension():
    """The compiled module (kernels/build.py), or None; the reason is kept for is_available."""
    global _EXT, _EXT_ERROR
    if _EXT is not None or _EXT_ERROR != "not loaded yet":
        return _EXT
    _EXT_ERROR = ("no mxplus_cutlass extension found (build it: python kernels/build.py; "
                  f"or set {EXT_ENV})")
    for path in _candidate_paths():
        if not path.is_file():
            continue
        try:
            loader = importlib.machinery.ExtensionFileLoader("mxplus_cutlass", str(path))
            spec = importlib.util.spec_from_loader("mxplus_cutlass", loader)
            mod = importlib.util.module_from_spec(spec)
            loader.exec_module(mod)
            _EXT = mod
            return mod
        except Exception as e:  # a stale or CPU-incompatible build is a reason, not a crash
            _EXT_ERROR = f"loading {path} failed: {type(e).__name__}: {e}"
    return None


def arch_of(device: Optional[torch.device] = None) -> Optional[str]:
    """'sm90a' / 'sm100a' when the device runs one of the kernels, else None."""
    if not torch.cuda.is_available() or torch.version.hip:
        return None
    cap = torch.cuda.get_device_capability(device)
    return {(9, 0): "sm90a", (10, 0): "sm100a"}.get(cap)


def is_available(device: Optional[torch.device] = None) -> tuple[bool, str]:
    """(True, "") when a CUTLASS prefill kernel can run on `device`; else (False, why)."""
    if not torch.cuda.is_available():
        return False, "no CUDA device"
    arch = arch_of(device)
    if arch is None:
        cap = torch.cuda.get_device_capability(device)
        return False, f"capability {cap} has no kernel (needs sm_90a or sm_100a exactly)"
    ext = load_extension()
    if ext is None:
        return False, _EXT_ERROR
    if arch not in ext.compiled_archs():
        return False, f"extension built without {arch} (built: {ext.compiled_archs()})"
    return True, ""


# ----------------------------------------------------------------------------- custom ops
@torch.library.custom_op(f"{LIB}::cutlass_fp8_chunk_gemm", mutates_args=())
def fp8_chunk_gemm(a_fp8: torch.Tensor, a_scale: torch.Tensor, b_fp8: torch.Tensor,
                   b_scale: torch.Tensor, bias: Optional[torch.Tensor]) -> torch.Tensor:
    """sm_90a: bf16 [M, N] = sum_c a_scale[c,:,None] b_scale[c,None,:] (A_c B_c^T) + bias."""
    out = a_fp8.new_empty((a_fp8.shape[0], b_fp8.shape[0]), dtype=torch.bfloat16)
    load_extension().sm90_fp8_chunk_gemm(a_fp8, a_scale, b_fp8, b_scale, bias, out)
    return out


@fp8_chunk_gemm.register_fake
def _(a_fp8, a_scale, b_fp8, b_scale, bias):
    return a_fp8.new_empty((a_fp8.shape[0], b_fp8.shape[0]), dtype=torch.bfloat16)


@torch.library.custom_op(f"{LIB}::cutlass_fp4_mbs_gemm", mutates_args=())
def fp4_mbs_gemm(a_codes: torch.Tensor, a_sf: torch.Tensor, b_codes: torch.Tensor,
                 b_sf: torch.Tensor, sigma_a: torch.Tensor, sigma_b: torch.Tensor,
                 bias: Optional[torch.Tensor], use_mbs: bool) -> torch.Tensor:
    """sm_100a: bf16 [M, N]; a_sf / b_sf packed by pack_scales_sm100 (chunk 128, or K when
    use_mbs is False); sigma_* fp32 [K/128, ceil4(rows)] from sigma_chunks."""
    acc = load_extension().sm100_fp4_mbs_gemm(a_codes, a_sf, b_codes, b_sf, sigma_a, sigma_b,
                                              use_mbs)
    if bias is not None:
        acc = acc + bias.to(torch.float32)
    return acc.to(torch.bfloat16)


@fp4_mbs_gemm.register_fake
def _(a_codes, a_sf, b_codes, b_sf, sigma_a, sigma_b, bias, use_mbs):
    return a_codes.new_empty((a_codes.shape[0], b_codes.shape[0]), dtype=torch.bfloat16)


def sigma_chunks(mbs: Optional[torch.Tensor], rows: int, k: int) -> torch.Tensor:
    """fp32(1/F) per (chunk, row) as [Kp/128, ceil4(rows)] (16-byte aligned chunk rows)."""
    nc = _ceil_to(k, CHUNK) // CHUNK
    m = mbs if mbs is not None else torch.zeros((rows, nc), dtype=torch.uint8)
    m = _pad_rows(_pad_last(m, nc), _ceil_to(rows, 4))
    return (1.0 / mbs_factor(m)).t().contiguous()


def pack_scales_sm100(scales: torch.Tensor, k: int, chunk_k: int = CHUNK) -> torch.Tensor:
    """Row-major E8M0 [R, K/16] -> CUTLASS's interleaved SF layout, chunk by chunk (CUDA)."""
    return load_extension().sm100_pack_scales(_pad_last(scales, k // BLOCK).contiguous(), k,
                                              chunk_k)


# ----------------------------------------------------------------------------- function API
@dataclass
class PreparedWeight:
    """A weight [N, K] in the kernel's runtime layout (built once at load)."""

    arch: str
    n: int
    k: int
    layout: Optional[Fp8ChunkLayout] = None  # sm90a
    codes: Optional[torch.Tensor] = None  # sm100a: [Np, Kp/2]
    sf: Optional[torch.Tensor] = None  # sm100a: packed per chunk
    sigma: Optional[torch.Tensor] = None  # sm100a: [Kp/128, Np] fp32
    fallback_idx: Optional[torch.Tensor] = None  # sm90a: rows with an inexact chunk
    fallback_w: Optional[torch.Tensor] = None  # their exact fp32 W_hat rows


def _pad_rows(t: torch.Tensor, rows: int) -> torch.Tensor:
    return F.pad(t, (0, 0, 0, rows - t.shape[0])) if t.shape[0] < rows else t


def prepare_weight(qweight: QuantizedTensor, arch: str) -> PreparedWeight:
    """QuantizedTensor [N, K] (E8M0 block 16, optional MBS) -> PreparedWeight for `arch`."""
    n, k = qweight.shape
    npad, kp = _ceil_to(n, 8), _ceil_to(k, CHUNK)
    codes = _pad_rows(qweight.codes, npad)
    scales = _pad_rows(qweight.scales, npad)
    mbs = None if qweight.mbs is None else _pad_rows(qweight.mbs, npad)
    if arch == "sm90a":
        lay = encode_fp8_chunks(codes, scales, mbs, k)
        bad = (~lay.exact_rows[:n]).nonzero().flatten()
        w_bad = qweight.dequantize(torch.float32)[bad] if bad.numel() else None
        return PreparedWeight(arch, n, k, layout=lay, fallback_idx=bad, fallback_w=w_bad)
    if arch == "sm100a":
        return PreparedWeight(
            arch, n, k, codes=_pad_last(codes, kp // 2).contiguous(),
            sf=pack_scales_sm100(scales, kp),
            sigma=sigma_chunks(mbs, npad, k).to(codes.device))
    raise ValueError(f"unknown arch {arch!r} (expected 'sm90a' or 'sm100a')")


def prefill_gemm(x_codes: torch.Tensor, x_scales: torch.Tensor, x_mbs: Optional[torch.Tensor],
                 k: int, w: PreparedWeight, bias: Optional[torch.Tensor],
                 out_dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """y [M, N] = x_hat W_hat^T (+ bias) from quantized activations (the Triton act-quant's
    codes / E8M0 scales / MBS bytes, [M, ...]) and a prepared weight. One opaque custom op
    per arch, so torch.compile (fullgraph) never traces the data-dependent fallback."""
    if w.arch == "sm90a":
        y = torch.ops.vllm_mxplus.cutlass_prefill_sm90(
            x_codes, x_scales, x_mbs, k, w.layout.fp8, w.layout.scale, w.layout.ref,
            w.layout.mbs, w.fallback_idx, w.fallback_w, bias, w.n)
    else:
        y = torch.ops.vllm_mxplus.cutlass_prefill_sm100(
            x_codes, x_scales, x_mbs, k, w.codes, w.sf, w.sigma, bias, w.n)
    return y.to(out_dtype)


def _pad_bias(bias: Optional[torch.Tensor], npad: int) -> Optional[torch.Tensor]:
    if bias is None:
        return None
    return F.pad(bias.to(torch.bfloat16), (0, npad - bias.shape[0])).contiguous()


@torch.library.custom_op(f"{LIB}::cutlass_prefill_sm100", mutates_args=())
def _prefill_sm100(x_codes: torch.Tensor, x_scales: torch.Tensor, x_mbs: Optional[torch.Tensor],
                   k: int, w_codes: torch.Tensor, w_sf: torch.Tensor, w_sigma: torch.Tensor,
                   bias: Optional[torch.Tensor], n: int) -> torch.Tensor:
    kp = _ceil_to(k, CHUNK)
    sig = sigma_chunks(x_mbs, x_codes.shape[0], k).to(x_codes.device)
    y = fp4_mbs_gemm(_pad_last(x_codes, kp // 2).contiguous(), pack_scales_sm100(x_scales, kp),
                     w_codes, w_sf, sig, w_sigma, _pad_bias(bias, w_codes.shape[0]), True)
    return y[:, :n].contiguous()


@_prefill_sm100.register_fake
def _(x_codes, x_scales, x_mbs, k, w_codes, w_sf, w_sigma, bias, n):
    return x_codes.new_empty((x_codes.shape[0], n), dtype=torch.bfloat16)


def _sm90_gemm_with_fallback(xl: Fp8ChunkLayout, x_hat_rows, w_fp8: torch.Tensor,
                             w_scale: torch.Tensor, w_ref: torch.Tensor, w_mbs: torch.Tensor,
                             fallback_idx: Optional[torch.Tensor],
                             fallback_w: Optional[torch.Tensor], bias: Optional[torch.Tensor],
                             n: int) -> torch.Tensor:
    """The sm_90a GEMM on an activation layout, then the exact fallbacks: weight rows with an
    inexact chunk (static) and activation rows with one; x_hat_rows(rows) gives the spec's
    fp32 x_hat [len(rows), K] of those activation rows."""
    k = xl.k
    y = fp8_chunk_gemm(xl.fp8, xl.scale, w_fp8, w_scale, _pad_bias(bias, w_fp8.shape[0]))
    y = y[:, :n].contiguous()
    b32 = None if bias is None else bias.to(torch.float32)
    if fallback_idx is not None and fallback_idx.numel():  # weight rows: static, exact
        cols = F.linear(dequantize_fp8_chunks(xl), fallback_w)  # bad x rows are redone below
        if b32 is not None:
            cols = cols + b32[fallback_idx]
        y[:, fallback_idx] = cols.to(y.dtype)
    if y.is_cuda and torch.cuda.is_current_stream_capturing():
        # nonzero() syncs the host, which a CUDA graph cannot capture: out-of-span activation
        # chunks then keep their FP8 rounding (elements >= 2^15 below the chunk max round to
        # the E4M3 subnormal grid). Keep VLLM_MXPLUS_PREFILL_MIN_M above the capture sizes
        # for bit-exact numbers (kernels/README.md, remaining work).
        return y
    bad_rows = (~xl.exact_rows).nonzero().flatten()
    if bad_rows.numel():  # rare: a chunk spanning > 14 binades, a NaN block, a tiny exponent
        x_bad = x_hat_rows(bad_rows)
        w_layout = Fp8ChunkLayout(fp8=w_fp8, scale=w_scale, ref=w_ref, mbs=w_mbs,
                                  exact=w_ref.new_ones(w_ref.shape, dtype=torch.bool), k=k)
        w_hat = dequantize_fp8_chunks(w_layout)[:n]
        if fallback_idx is not None and fallback_idx.numel():
            w_hat[fallback_idx] = fallback_w
        y[bad_rows] = F.linear(x_bad, w_hat, b32).to(y.dtype)
    return y


@torch.library.custom_op(f"{LIB}::cutlass_prefill_sm90", mutates_args=())
def _prefill_sm90(x_codes: torch.Tensor, x_scales: torch.Tensor, x_mbs: Optional[torch.Tensor],
                  k: int, w_fp8: torch.Tensor, w_scale: torch.Tensor, w_ref: torch.Tensor,
                  w_mbs: torch.Tensor, fallback_idx: Optional[torch.Tensor],
                  fallback_w: Optional[torch.Tensor], bias: Optional[torch.Tensor],
                  n: int) -> torch.Tensor:
    """From quantized activations: re-encode them in torch (`encode_fp8_chunks`), GEMM."""
    xl = encode_fp8_chunks(x_codes, x_scales, x_mbs, k)

    def x_hat_rows(rows: torch.Tensor) -> torch.Tensor:
        kp = _ceil_to(k, CHUNK)
        cb = F.pad(unpack_fp4(x_codes[rows], k), (0, kp - k))
        sb = _pad_last(x_scales[rows], kp // BLOCK)
        return dequantize_mbs(cb, sb, xl.mbs[rows], BLOCK)[:, :k]  # the spec's x_hat

    return _sm90_gemm_with_fallback(xl, x_hat_rows, w_fp8, w_scale, w_ref, w_mbs, fallback_idx,
                                    fallback_w, bias, n)


@_prefill_sm90.register_fake
def _(x_codes, x_scales, x_mbs, k, w_fp8, w_scale, w_ref, w_mbs, fallback_idx, fallback_w,
      bias, n):
    return x_codes.new_empty((x_codes.shape[0], n), dtype=torch.bfloat16)


@torch.library.custom_op(f"{LIB}::cutlass_prefill_sm90_fused", mutates_args=())
def _prefill_sm90_fused(x: torch.Tensor, fmt: str, x_fp8: torch.Tensor, x_scale: torch.Tensor,
                        x_ref: torch.Tensor, x_mbs: torch.Tensor, x_exact: torch.Tensor,
                        w_fp8: torch.Tensor, w_scale: torch.Tensor, w_ref: torch.Tensor,
                        w_mbs: torch.Tensor, fallback_idx: Optional[torch.Tensor],
                        fallback_w: Optional[torch.Tensor], bias: Optional[torch.Tensor],
                        n: int) -> torch.Tensor:
    """From activation rows x [M, K] and their fused FP8 layout (`triton_act_fp8`): GEMM;
    rows with an inexact chunk are recomputed from x_hat = fake_quantize(x_rows, fmt)."""
    xl = Fp8ChunkLayout(fp8=x_fp8, scale=x_scale, ref=x_ref, mbs=x_mbs, exact=x_exact,
                        k=x.shape[-1])
    return _sm90_gemm_with_fallback(xl, lambda rows: fake_quantize(x[rows], fmt), w_fp8,
                                    w_scale, w_ref, w_mbs, fallback_idx, fallback_w, bias, n)


@_prefill_sm90_fused.register_fake
def _(x, fmt, x_fp8, x_scale, x_ref, x_mbs, x_exact, w_fp8, w_scale, w_ref, w_mbs,
      fallback_idx, fallback_w, bias, n):
    return x.new_empty((x.shape[0], n), dtype=torch.bfloat16)


def prefill_gemm_from_x(x: torch.Tensor, fmt: str, w: PreparedWeight,
                        bias: Optional[torch.Tensor],
                        out_dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """y [M, N] = Q(x) W_hat^T (+ bias) from activation rows x [M, K] (bf16/fp16/fp32).

    sm_90a with an activation format of the fused kernel (`triton_act_fp8.SUPPORTED_FORMATS`):
    one Triton kernel writes the FP8 layout straight from x (bit-identical to act-quant +
    `encode_fp8_chunks`), then the GEMM op. Otherwise: the Triton act-quant, then
    `prefill_gemm`. Same numbers either way."""
    from vllm_mxplus.ops import triton_act_fp8  # Triton: import on CUDA only

    if w.arch == "sm90a" and triton_act_fp8.supports(fmt):
        xl = triton_act_fp8.act_quant_fp8_chunks_op(x, fmt, CHUNK)
        y = torch.ops.vllm_mxplus.cutlass_prefill_sm90_fused(
            x, fmt, xl.fp8, xl.scale, xl.ref, xl.mbs, xl.exact, w.layout.fp8, w.layout.scale,
            w.layout.ref, w.layout.mbs, w.fallback_idx, w.fallback_w, bias, w.n)
        return y.to(out_dtype)
    from vllm_mxplus.ops.custom_ops import act_quant_op

    codes, scales, mbs, _ = act_quant_op(x, fmt)
    return prefill_gemm(codes, scales, mbs, x.shape[-1], w, bias, out_dtype)


# ----------------------------------------------------------------------------- backend
class CutlassPrefillBackend(LinearBackend):
    """Prefill (M >= VLLM_MXPLUS_PREFILL_MIN_M, default 17) on sm_90a / sm_100a; register it
    after the Triton decode backend (M <= 16), so LinearDispatch.pick sends small M there."""

    name = "cutlass_prefill"
    WEIGHT_ATTR = "mxplus_cutlass_weight"

    @classmethod
    def is_supported(cls, platform: str, capability: Optional[int]) -> tuple[bool, str]:
        if platform != "cuda" or capability not in (90, 100):
            return False, f"needs CUDA capability 90 or 100, got {platform} {capability}"
        return is_available()

    @classmethod
    def can_implement(cls, spec: LinearSpec) -> tuple[bool, str]:
        for role, fmt in (("weight", spec.weight_format), ("activation", spec.activation_format)):
            f = get_format(fmt)
            if f.block_size != BLOCK or f.scale_rule == "e4m3" or f.block_max_mantissa:
                return False, f"{role} format {fmt} is not E8M0 at block 16"
        if spec.macro_block != CHUNK:
            return False, f"macro block {spec.macro_block} != {CHUNK}"
        return True, ""

    covers_all_m = False

    @classmethod
    def supports_m(cls, m: int) -> bool:
        return m >= PREFILL_MIN_M

    def process_weights_after_loading(self, layer, qweight: QuantizedTensor, spec: LinearSpec):
        setattr(layer, self.WEIGHT_ATTR, prepare_weight(qweight, arch_of(qweight.codes.device)))

    def apply(self, layer, x, bias, spec: LinearSpec, act_global_scale=None) -> torch.Tensor:
        lead, k = x.shape[:-1], x.shape[-1]
        y = prefill_gemm_from_x(x.reshape(-1, k), spec.activation_format,
                                getattr(layer, self.WEIGHT_ATTR), bias, spec.out_dtype)
        return y.reshape(*lead, spec.n)


def scheme_supported(scheme: str) -> bool:
    """Whether a scheme's formats are ones this backend runs (for docs and tests)."""
    s = get_scheme(scheme)
    spec = LinearSpec(scheme=scheme, n=1, k=1, out_dtype=torch.bfloat16)
    return s is not None and CutlassPrefillBackend.can_implement(spec)[0]
