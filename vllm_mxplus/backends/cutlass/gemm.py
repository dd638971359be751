"""The CUTLASS prefill GEMM as a function API: weights prepared once, y = Q(x) W_hat^T (+ bias).

Two kernels (`ops`), both computing acc = sum_c sigma_a[i,c] sigma_b[j,c]
(A_c B_c^T)[i,j] with sigma = fp32(1/F) per 128-K chunk (paper section 4.3.2;
docs/numerics.md, "Kernel numerics and error bounds"):

- sm_90a (H100/H200, no FP4 tensor cores): operands re-encoded as FP8 per (row, chunk)
  (`fp8_chunks`); activations in one Triton kernel straight from x (`act_fp8`) where
  the format has one, else the Triton act-quant and the torch encoder; the weight per call
  from its packed form into a temporary (`weight_fp8`: no FP8 copy is held).
- sm_100a (B200): native block-scaled FP4 MMA; one launch per 128-K chunk with MBS, one
  launch over the whole K without (`mxfp4-16`, `mxfp4-16-oas`).

The FP8-chunk pipeline (the weight's FP8 form per call, the activations' from `act_fp8`, the
exact fallback) runs its GEMM on one of two engines (`ENGINES`): the CUTLASS sm_90a kernel
where the extension is built, else Triton's (`triton.fp8_chunk_gemm`: the same contract, on
the FP8 tensor cores of sm_90 and sm_100), so it needs no build step. On the Triton engine,
up to PACKED_WEIGHT_MAX_M rows (per GPU) and for K a multiple of 256, the GEMM reads the
packed weight itself and re-encodes each chunk in registers (`fp8_packed_gemm`): no per-call
weight pass, its own fallback rows (`fp8_chunks.packed_fallback_rows`, listed at load).

Every step inside the prefill ops is CUDA-graph safe: fixed shapes, no host sync, nothing
allocated on or copied from the CPU (tests/backends/test_graph_guard_fake_cuda.py runs them
under a fake CUDA device and fails on any of those). The sm_90a exact fallback is part of that,
and no row ever comes out NaN or wrong for want of room: activation rows with an inexact FP8
chunk (a chunk whose block exponents span more than 14 binades, a NaN block, a scale under
2^-125) are listed on the device (`row_list.list_rows`: one launch, no host sync) and the
Triton FP4 GEMM recomputes exactly those rows from the packed operands (`mx_gemm_rows`: the
activations' codes from the fused encoder's same launch, or the Triton act-quant, the packed
weight the decode backend holds;
fp32 accumulation), writing them over the CUTLASS rows; its row tiles past the listed rows
return at once, so the cost follows the number of inexact rows, whatever M. Weight rows with
an inexact chunk are known at load; their output columns come from the same Triton GEMM
over those packed weight rows. A NaN or Inf input block gives NaN outputs in its row, as
the spec says (docs/numerics.md, "NaN, Inf and edge cases").
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from dataclasses import dataclass
from typing import NamedTuple

import torch

from vllm_mxplus.backends.cutlass import act_fp8
from vllm_mxplus.backends.cutlass.fp8_chunks import (
    BLOCK,
    CHUNK,
    Fp8ChunkLayout,
    ceil_to,
    encode_fp8_chunks,
    packed_fallback_rows,
    pad_last,
    pad_rows,
)
from vllm_mxplus.backends.cutlass.fp8_packed_gemm import K_MULTIPLE, fp8_packed_gemm
from vllm_mxplus.backends.cutlass.ops import (
    bias_f32,
    fp4_mbs_gemm,
    fp8_chunk_gemm,
    pack_scales_sm100,
    sigma_chunks,
)
from vllm_mxplus.backends.cutlass.weight_fp8 import weight_fp8_chunks
from vllm_mxplus.backends.library import op_name
from vllm_mxplus.backends.triton import fp8_chunk_gemm as triton_fp8
from vllm_mxplus.backends.triton.launch import target_capability
from vllm_mxplus.backends.triton.mx_gemm import mx_gemm, mx_gemm_rows
from vllm_mxplus.backends.triton.ops import act_quant_op
from vllm_mxplus.formats import QuantizedTensor, get_format

# the GEMM of the FP8-chunk pipeline: the CUTLASS op, or Triton's kernel (no build needed)
ENGINES = ("cutlass", "triton")
# The largest M at which the Triton engine runs `fp8_packed_gemm` (the weight re-encoded per
# chunk inside the GEMM, once per 128-row tile) rather than the weight's FP8 form made per
# call and `fp8_chunk_gemm`, per GPU capability (None: every M). The static estimate for
# Llama-3-8B's linears (`benchmarks/gpu_static_model.py`, docs/benchmarks.md): on sm_90 the
# packed-weight GEMM issues 0.0015 warp-instructions per MAC against 0.0011 plus the
# per-call encode, ahead below ~800 rows; on sm_100 it issues fewer than `fp8_chunk_gemm`
# at any M. A measurement has yet to confirm either.
PACKED_WEIGHT_MAX_M: dict[int, int | None] = {90: 768, 100: None}


def engine_gemm(engine: str) -> Callable[..., torch.Tensor]:
    """The FP8-chunk GEMM of `engine` (looked up per call: tests route "cutlass" to an
    emulation by patching this module's `fp8_chunk_gemm`)."""
    return fp8_chunk_gemm if engine == "cutlass" else triton_fp8.fp8_chunk_gemm


def _prefill_op(name: str, impl: Callable[..., torch.Tensor]) -> Callable[..., torch.Tensor]:
    """`impl` as the opaque custom op vllm_mxplus::<name>, with its fake: [M, n] in
    `out_dtype`, M the rows of the first argument (each prefill op's activation rows)."""
    op = torch.library.custom_op(op_name(name), impl, mutates_args=())
    sig = inspect.signature(impl)

    @op.register_fake
    def _(*args, **kwargs):
        bound = sig.bind(*args, **kwargs).arguments
        rows = next(iter(bound.values()))
        return rows.new_empty((rows.shape[0], bound["n"]), dtype=bound["out_dtype"])

    return op


class Sm90Weight(NamedTuple):
    """The weight arguments of the sm_90a ops, in their order: the packed weight, and its FP8
    form only where it is held (`held_fp8`; else made per call, `weight_fp8`)."""

    codes: torch.Tensor  # the packed weight [N, K/2] (formats' layout): exact rows, columns
    scales: torch.Tensor  # E8M0 [N, K/16]
    mbs: torch.Tensor | None  # [N, K/128] or None
    fallback_idx: torch.Tensor  # weight rows with an inexact chunk (known at load), int64
    packed_fallback_idx: torch.Tensor  # those and the rows `fp8_packed_gemm` leaves, int64
    fp8: torch.Tensor | None = None  # held FP8 form [ceil8(N), Kp] or None
    fp8_scale: torch.Tensor | None = None  # its folded scales [Kp/128, ceil8(N)] or None


@dataclass
class PreparedWeight:
    """A weight [N, K] in the kernel's runtime layout (built once at load)."""

    arch: str
    n: int
    k: int
    use_mbs: bool = True  # False: neither operand has MBS (sm_100a: one full-K launch)
    codes: torch.Tensor | None = None  # sm100a: [Np, Kp/2]
    sf: torch.Tensor | None = None  # sm100a: packed per chunk (or for the whole K)
    mbs: torch.Tensor | None = None  # sm100a: the weight's MBS bytes [N, K/128] or None
    packed: tuple[torch.Tensor, torch.Tensor, torch.Tensor | None] | None = None  # sm90a
    fallback_idx: torch.Tensor | None = None  # sm90a: rows with an inexact chunk
    packed_fallback_idx: torch.Tensor | None = None  # sm90a: `Sm90Weight.packed_fallback_idx`
    engine: str = "cutlass"  # sm90a: the FP8-chunk GEMM's engine (`ENGINES`)
    held_fp8: tuple[torch.Tensor, torch.Tensor] | None = None  # sm90a: (FP8 form, scales)

    def sm90_operands(self) -> Sm90Weight:
        """The sm_90a ops' weight arguments (`Sm90Weight`, in order)."""
        assert self.packed is not None and self.fallback_idx is not None, (
            "sm90_operands of a weight not prepared for sm90a"
        )
        packed_idx = self.packed_fallback_idx
        packed_idx = self.fallback_idx if packed_idx is None else packed_idx
        return Sm90Weight(
            *self.packed, self.fallback_idx, packed_idx, *(self.held_fp8 or (None, None))
        )

    def sigma(self) -> torch.Tensor:
        """sm100a: the weight's fp32(1/F) per (chunk, row), [Kp/128, Np], built per call from
        the MBS bytes (4 bytes per 128 weights not held; empty without MBS)."""
        assert self.codes is not None, "sigma of a weight not prepared for sm100a"
        return _weight_sigma(self.mbs, self.codes, self.k, self.use_mbs)


def _weight_sigma(
    mbs: torch.Tensor | None, codes: torch.Tensor, k: int, use_mbs: bool
) -> torch.Tensor:
    if not use_mbs:
        return torch.empty(0, dtype=torch.float32, device=codes.device)
    return sigma_chunks(mbs, codes.shape[0], k, codes.device)


def prepare_weight(
    qweight: QuantizedTensor,
    arch: str,
    activation_mbs: bool = True,
    engine: str = "cutlass",
    hold_fp8: bool = False,
) -> PreparedWeight:
    """QuantizedTensor [N, K] (E8M0 block 16, optional MBS) -> PreparedWeight for `arch`.
    activation_mbs: whether the activations will carry MBS bytes (sm_100a packs the weight
    scales per 128-K chunk then, else for one full-K launch). engine: the sm90a layout's GEMM
    (`ENGINES`; "triton" runs the FP8-chunk pipeline on any FP8 tensor-core GPU). hold_fp8:
    sm90a keeps the weight's FP8 form from load (1.03 bytes per weight more) instead of
    re-encoding it per call."""
    n, k = qweight.shape
    use_mbs = qweight.mbs is not None or activation_mbs
    if engine not in ENGINES:
        raise ValueError(f"unknown FP8-chunk engine {engine!r} (expected one of {list(ENGINES)})")
    if arch == "sm90a":
        packed = (qweight.codes, qweight.scales, qweight.mbs)  # the same tensors, no copy
        bad, packed_bad = fallback_rows(*packed, k)
        held = weight_fp8_chunks(*packed, k, ceil_to(n, 8)) if hold_fp8 else None
        return PreparedWeight(
            arch, n, k, use_mbs, packed=packed, fallback_idx=bad, packed_fallback_idx=packed_bad,
            engine=engine, held_fp8=held,
        )  # fmt: skip
    if arch == "sm100a":
        npad, kp = ceil_to(n, 8), ceil_to(k, CHUNK)
        codes = pad_rows(qweight.codes, npad)
        scales = pad_rows(qweight.scales, npad)
        return PreparedWeight(
            arch,
            n,
            k,
            use_mbs,
            codes=pad_last(codes, kp // 2).contiguous(),
            sf=pack_scales_sm100(scales, kp, CHUNK if use_mbs else kp),
            mbs=qweight.mbs,  # the same tensor as the Triton decode's: no copy
        )
    raise ValueError(f"unknown arch {arch!r} (expected 'sm90a' or 'sm100a')")


# ----------------------------------------------------------------------------- sm_90a
LOAD_ROWS = 256  # weight rows re-encoded at a time at load (temporaries: see fallback_rows)


def fallback_rows(
    codes: torch.Tensor, scales: torch.Tensor, mbs: torch.Tensor | None, k: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Indices (int64) of the weight rows with a chunk the FP8 form cannot hold exactly (from
    the definition, `encode_fp8_chunks`), and of those plus the rows with a chunk wider than
    `fp8_packed_gemm`'s tables (`packed_fallback_rows`), LOAD_ROWS rows at a time: the extra
    memory at load is one slice's temporaries, not the whole weight's FP8 form (measured on
    CPU: 29 bytes per slice element, 102 MiB at K = 14336). A host sync per slice: at load
    only."""
    bad, packed_bad = [], []
    for r in range(0, codes.shape[0], LOAD_ROWS):
        part = slice(r, r + LOAD_ROWS)
        c, s, m = codes[part], scales[part], None if mbs is None else mbs[part]
        exact = encode_fp8_chunks(c, s, m, k).exact
        bad.append((~exact.all(-1)).nonzero().flatten() + r)
        packed = packed_fallback_rows(c, s, m, k, exact=exact)
        packed_bad.append(packed.nonzero().flatten() + r)
    if not bad:
        none = torch.empty(0, dtype=torch.int64, device=codes.device)
        return none, none
    return torch.cat(bad), torch.cat(packed_bad)


def packed_serves(m: int, k: int, engine: str, capability: int | None) -> bool:
    """Whether the pipeline's GEMM reads the packed weight (`fp8_packed_gemm`) for m rows on
    a GPU of `capability` (None: sm_90's choice): the Triton engine, K a multiple of
    `fp8_packed_gemm.K_MULTIPLE` (256), m up to PACKED_WEIGHT_MAX_M."""
    if engine != "triton" or k % K_MULTIPLE:
        return False
    top = PACKED_WEIGHT_MAX_M.get(capability or 90, PACKED_WEIGHT_MAX_M[90])
    return top is None or m <= top


def _sm90_gemm(
    xl: Fp8ChunkLayout,
    x_packed: tuple[torch.Tensor, torch.Tensor, torch.Tensor | None],
    w: Sm90Weight,
    bias: torch.Tensor | None,
    n: int,
    out_dtype: torch.dtype,
    engine: str,
) -> torch.Tensor:
    """The sm_90a GEMM (on `engine`) on an activation layout, every inexact row and column recomputed
    (module docstring). x_packed: the activations' codes, E8M0 scales and MBS bytes
    (formats' layout, every row).

    One CUTLASS launch over all rows; then the Triton FP4 GEMM over the device-side list of
    activation rows with an inexact chunk (`mx_gemm_rows`: any number of them, no host sync,
    work following their number) and, when the weight has inexact rows (known at load), over
    those output columns."""
    rows = ceil_to(n, 8)
    b32 = bias_f32(bias, rows)
    fallback_idx = w.fallback_idx
    # the rows with an inexact chunk, reduced before the GEMM: the fallback's row list then
    # follows the GEMM directly and starts early (`row_list`, programmatic dependent launch)
    exact_rows = xl.exact_rows
    cap = target_capability(xl.fp8.device)
    if w.fp8 is None and packed_serves(xl.fp8.shape[0], xl.k, engine, cap):
        y = fp8_packed_gemm(xl.fp8, xl.scale, w.codes, w.scales, w.mbs, xl.k, b32, out_dtype)
        fallback_idx = w.packed_fallback_idx
    else:
        if w.fp8 is not None and w.fp8_scale is not None:  # held from load
            w_fp8, w_scale = w.fp8, w.fp8_scale
        else:
            w_fp8, w_scale = weight_fp8_chunks(w.codes, w.scales, w.mbs, xl.k, rows)
        y = engine_gemm(engine)(xl.fp8, xl.scale, w_fp8, w_scale, b32, out_dtype)
        del w_fp8, w_scale  # a temporary goes back to the allocator before the fallbacks
        y = y[:, :n].contiguous() if y.shape[1] != n else y
    codes, scales, mbs = x_packed
    x_ops = (codes, scales, mbs, None)
    w_ops = (w.codes, w.scales, w.mbs, None)
    b = None if b32 is None else b32[:n]
    y = mx_gemm_rows(
        y, exact_rows, x_ops, w_ops, xl.k, b,
        fmt="e8m0", block_size=BLOCK, macro_block=CHUNK, when=False,
    )  # fmt: skip
    if fallback_idx.numel():  # static (known at load): no sync
        idx = fallback_idx
        w_rows = tuple(None if t is None else t[idx] for t in w_ops)
        b_rows = None if b32 is None else b32[idx]
        y[:, idx] = mx_gemm(
            x_ops, w_rows, xl.k, b_rows, y.dtype, fmt="e8m0", block_size=BLOCK, macro_block=CHUNK
        )
    return y


def prefill_sm90_impl(
    x_codes: torch.Tensor,
    x_scales: torch.Tensor,
    x_mbs: torch.Tensor | None,
    k: int,
    w_codes: torch.Tensor,
    w_scales: torch.Tensor,
    w_mbs: torch.Tensor | None,
    fallback_idx: torch.Tensor,
    packed_fallback_idx: torch.Tensor,
    w_fp8: torch.Tensor | None,
    w_fp8_scale: torch.Tensor | None,
    bias: torch.Tensor | None,
    n: int,
    out_dtype: torch.dtype,
    engine: str = "cutlass",
) -> torch.Tensor:
    """From quantized activations: re-encode them in torch (`encode_fp8_chunks`), GEMM."""
    return _sm90_gemm(
        encode_fp8_chunks(x_codes, x_scales, x_mbs, k),
        (x_codes, x_scales, x_mbs),
        Sm90Weight(w_codes, w_scales, w_mbs, fallback_idx, packed_fallback_idx, w_fp8, w_fp8_scale),
        bias,
        n,
        out_dtype,
        engine,
    )


_prefill_sm90 = _prefill_op("cutlass_prefill_sm90", prefill_sm90_impl)


def prefill_sm90_fused_impl(
    x: torch.Tensor,
    fmt: str,
    x_fp8: torch.Tensor,
    x_scale: torch.Tensor,
    x_ref: torch.Tensor,
    x_mbs: torch.Tensor,
    x_exact: torch.Tensor,
    x_codes: torch.Tensor,
    x_scales: torch.Tensor,
    w_codes: torch.Tensor,
    w_scales: torch.Tensor,
    w_mbs: torch.Tensor | None,
    fallback_idx: torch.Tensor,
    packed_fallback_idx: torch.Tensor,
    w_fp8: torch.Tensor | None,
    w_fp8_scale: torch.Tensor | None,
    bias: torch.Tensor | None,
    n: int,
    out_dtype: torch.dtype,
    engine: str = "cutlass",
) -> torch.Tensor:
    """From activation rows x [M, K] and the one launch of the fused encoder
    (`act_fp8.act_fp8_and_packed_op`): their FP8 layout and formats' packed codes and E8M0
    scales of the same quantization (bit for bit `formats.quantize(x, fmt)`; the MBS bytes are
    the layout's), which the exact fallback reads for the rows and columns the FP8 form cannot
    hold."""

    xl = Fp8ChunkLayout(
        fp8=x_fp8, scale=x_scale, ref=x_ref, mbs=x_mbs, exact=x_exact, k=x.shape[-1]
    )
    packed = (x_codes, x_scales, x_mbs if get_format(fmt).mbs else None)
    w = Sm90Weight(w_codes, w_scales, w_mbs, fallback_idx, packed_fallback_idx, w_fp8, w_fp8_scale)
    return _sm90_gemm(xl, packed, w, bias, n, out_dtype, engine)


_prefill_sm90_fused = _prefill_op("cutlass_prefill_sm90_fused", prefill_sm90_fused_impl)


# ----------------------------------------------------------------------------- sm_100a
def prefill_sm100_impl(
    x_codes: torch.Tensor,
    x_scales: torch.Tensor,
    x_mbs: torch.Tensor | None,
    k: int,
    w_codes: torch.Tensor,
    w_sf: torch.Tensor,
    w_mbs: torch.Tensor | None,
    bias: torch.Tensor | None,
    n: int,
    use_mbs: bool,
    out_dtype: torch.dtype,
) -> torch.Tensor:
    kp = ceil_to(k, CHUNK)
    m = x_codes.shape[0]
    w_sigma = _weight_sigma(w_mbs, w_codes, k, use_mbs)
    sig = sigma_chunks(x_mbs, m, k, x_codes.device) if use_mbs else w_sigma
    y = fp4_mbs_gemm(
        pad_last(x_codes, kp // 2).contiguous(),
        pack_scales_sm100(x_scales, kp, CHUNK if use_mbs else kp),
        w_codes,
        w_sf,
        sig,
        w_sigma,
        bias_f32(bias, w_codes.shape[0]),
        use_mbs,
        out_dtype,
    )
    return y[:, :n].contiguous() if y.shape[1] != n else y


_prefill_sm100 = _prefill_op("cutlass_prefill_sm100", prefill_sm100_impl)


# ----------------------------------------------------------------------------- API
def prefill_gemm(
    x_codes: torch.Tensor,
    x_scales: torch.Tensor,
    x_mbs: torch.Tensor | None,
    k: int,
    w: PreparedWeight,
    bias: torch.Tensor | None,
    out_dtype: torch.dtype = torch.bfloat16,
) -> torch.Tensor:
    """y [M, N] = x_hat W_hat^T (+ bias) in out_dtype from quantized activations (codes /
    E8M0 scales / MBS bytes, [M, ...]) and a prepared weight. One opaque custom op per arch,
    so torch.compile never traces into the fallback."""
    if x_mbs is not None and not w.use_mbs:
        raise ValueError(
            "prefill_gemm: activations carry MBS bytes but the weight was prepared "
            "without MBS (prepare_weight(..., activation_mbs=True))"
        )
    if w.arch == "sm90a":
        return torch.ops.vllm_mxplus.cutlass_prefill_sm90(
            x_codes, x_scales, x_mbs, k, *w.sm90_operands(), bias, w.n, out_dtype, w.engine
        )
    return torch.ops.vllm_mxplus.cutlass_prefill_sm100(
        x_codes, x_scales, x_mbs, k, w.codes, w.sf, w.mbs, bias, w.n, w.use_mbs, out_dtype
    )


def prefill_gemm_from_x(
    x: torch.Tensor,
    fmt: str,
    w: PreparedWeight,
    bias: torch.Tensor | None,
    out_dtype: torch.dtype = torch.bfloat16,
) -> torch.Tensor:
    """y [M, N] = Q(x) W_hat^T (+ bias) from activation rows x [M, K] (bf16/fp16/fp32).

    sm_90a with an activation format of the fused kernel (`act_fp8.supports`): one
    Triton kernel writes the FP8 layout and the packed fields straight from x, then the
    GEMM op. Otherwise: the
    Triton act-quant, then `prefill_gemm`. Same numbers either way."""

    if w.arch == "sm90a" and act_fp8.supports(fmt):
        xl, x_codes, x_scales = act_fp8.act_fp8_and_packed_op(x, fmt, CHUNK)
        return torch.ops.vllm_mxplus.cutlass_prefill_sm90_fused(
            x, fmt, *xl.fields(), x_codes, x_scales, *w.sm90_operands(), bias, w.n, out_dtype,
            w.engine,
        )  # fmt: skip

    codes, scales, mbs, _ = act_quant_op(x, fmt, macro_block=CHUNK)
    return prefill_gemm(
        codes, scales, mbs if get_format(fmt).mbs else None, x.shape[-1], w, bias, out_dtype
    )
