"""Activation-side options the study measures before any of them goes into the plugin.

A row `SCHEME:METHOD@ACT` (eval/gptq/gptq_study.py) replaces the scheme's activation quantizer:

  own      the scheme's own activations and the checkpoint's weights: the control, run by
           the same code as the other options (W4A4 perplexity moves by ~1 % with any change
           of rounding order, so rows compare best against a control of the same code)
  mbsd     runtime MBS-D on the activations: each macro block's byte is the exact argmin of
           its SSE over all 256 bytes (formats.mbs_search.mbs_dynamic), per token
  mbsdR    runtime MBS-D over 2R + 1 candidates only, the bytes m0 - R .. m0 + R around the
           MBS-S byte m0 (clamped to 0..255), ties to the candidate nearest m0
  mbsgK    runtime MBS-D over K candidates spread evenly over the 256 bytes and anchored at
           the MBS-S byte: m0 + j * 256 / K (mod 256), j = 0 .. K - 1 (K a power of two), ties
           to the smaller j (the paper's MBS-D searched 16 candidates)
  mbN      MBS-S activations with macro blocks of N elements (N a multiple of 16: 32, 64)
  wmbN     mbN, and the weights' MBS bytes per N elements too: the checkpoint is written
           with `mxplus quantize --macro-block N` (any method, with or without smoothing)
  hadB     block Hadamard rotation along K, blocks of B (a power of two): W' = W R offline,
           x' = x R online, R block-diagonal orthonormal (a K tail shorter than B gets the
           largest power-of-two blocks that fit); the rotated weights are quantized RTN

mbsd*, mbN and wmbN apply to the schemes whose activations are MBS-S (mxfp4-mbs-s, mxfp4-mbs-h);
hadB to every scheme. Every candidate byte quantizes exactly as docs/numerics.md's Macro Block
Scaling says (`formats.choose_params(..., mbs=m)` then `formats.encode`), so each option is a valid MX encoding of the row.
"""

from __future__ import annotations

import functools
import re
from collections.abc import Callable

import torch
import torch.nn.functional as F

from vllm_mxplus.formats import (
    MACRO_BLOCK,
    check_format_macro_block,
    choose_params,
    encode,
    get_format,
    to_quantized_tensor,
)
from vllm_mxplus.formats.constants import ceil_div
from vllm_mxplus.formats.mbs import mbs_sse, mbs_static
from vllm_mxplus.formats.mbs_search import mbs_dynamic

MBS_ACT = "mxfp4-mbs-s"
_PATTERN = re.compile(r"^(own)()$|^(mbsd)(\d*)$|^(mbsg)(\d+)$|^(w?mb)(\d+)$|^(had)(\d+)$")


def parse(act: str) -> tuple[str, int | None]:
    """("mbsd", R or None) / ("mbsg", K) / ("mb" | "wmb", N) / ("had", B); SystemExit
    naming the option if it is not one of those."""
    m = _PATTERN.match(act)
    if m is None:
        raise SystemExit(
            f"@{act}: unknown activation option (own, mbsd, mbsdR, mbsgK, mbN, wmbN, hadB)"
        )
    kind = next(g for g in m.groups()[0::2] if g)
    num = next((g for g in m.groups()[1::2] if g), None)
    n = int(num) if num else None
    if kind == "mbsg" and (n is None or not 2 <= n <= 256 or n & (n - 1)):
        raise SystemExit(f"@{act}: the candidate count must be a power of two in 2..256")
    if kind in ("mb", "wmb"):
        try:
            check_format_macro_block(get_format(MBS_ACT), n or 0, f"@{act}: the macro block")
        except ValueError as e:
            raise SystemExit(str(e)) from None
    if kind == "had" and (n is None or n < 2 or n & (n - 1)):
        raise SystemExit(f"@{act}: the Hadamard block must be a power of two >= 2")
    return kind, n


def rotation_block(act: str | None) -> int | None:
    """B for a hadB option, else None."""
    if not act:
        return None
    kind, n = parse(act)
    return n if kind == "had" else None


def weight_macro_block(act: str | None) -> int | None:
    """N for a wmbN option (the weights re-quantized with macro blocks of N), else None."""
    if not act:
        return None
    kind, n = parse(act)
    return n if kind == "wmb" else None


def check_scheme(act: str, act_format: str) -> None:
    kind, _ = parse(act)
    if kind in ("mbsd", "mbsg", "mb", "wmb") and act_format != MBS_ACT:
        raise SystemExit(f"@{act} changes MBS-S activations; this scheme's are {act_format}")


def _least_sse(x: torch.Tensor, macro: int, offsets: list[int], wrap: bool) -> torch.Tensor:
    """The byte among m0 and m0 + offset (m0 the MBS-S byte; offsets tried in order) with the
    least SSE; a later candidate wins only by a strictly smaller SSE. A byte leaving 0..255
    wraps mod 256 when `wrap`, else is clamped."""
    m0 = mbs_static(x, macro).to(torch.int16)
    best_m = m0.to(torch.uint8)
    best = mbs_sse(x, best_m, macro)
    for off in offsets:
        m = (m0 + off).remainder(256) if wrap else (m0 + off).clamp(0, 255)
        sse = mbs_sse(x, m.to(torch.uint8), macro)
        better = sse < best
        best = torch.where(better, sse, best)
        best_m = torch.where(better, m.to(torch.uint8), best_m)
    return best_m


def mbs_near_static(x: torch.Tensor, macro: int, radius: int) -> torch.Tensor:
    """mbsdR: bytes m0 - radius .. m0 + radius, tried m0, m0 - 1, m0 + 1, m0 - 2, ...
    (ties to the candidate nearest m0), clamped to 0..255."""
    offsets = [s * d for d in range(1, radius + 1) for s in (-1, 1)]
    return _least_sse(x, macro, offsets, wrap=False)


def mbs_grid(x: torch.Tensor, macro: int, count: int) -> torch.Tensor:
    """mbsgK: bytes m0 + j * 256 / count (mod 256), j = 0 .. count - 1 (ties to smaller j)."""
    return _least_sse(x, macro, [j * (256 // count) for j in range(1, count)], wrap=True)


def _mbs_fake_quant(x: torch.Tensor, macro: int, pick: Callable) -> torch.Tensor:
    """x [..., K] -> fp32 x_hat with the bytes pick(x_padded, macro) (zero padding to macro)."""
    k = x.shape[-1]
    kp = ceil_div(k, macro) * macro
    xp = F.pad(x.to(torch.float32), (0, kp - k)).contiguous()
    spec = get_format(MBS_ACT)
    p = choose_params(spec, xp, macro_block=macro, mbs=pick(xp, macro))
    return to_quantized_tensor(spec, encode(spec, xp, p), p, tuple(xp.shape)).dequantize()[..., :k]


def activation_quantizer(act: str) -> Callable[[torch.Tensor], torch.Tensor] | None:
    """x -> fp32 fake-quantized x for an mbsd* / mbsgK / mbN option; None for hadB (the
    scheme's own)."""
    kind, n = parse(act)
    pick: Callable[..., torch.Tensor]
    if kind == "mbsg":
        assert n is not None  # parse() requires K for mbsgK
        pick = functools.partial(mbs_grid, count=n)
        return functools.partial(_mbs_fake_quant, macro=MACRO_BLOCK, pick=pick)
    if kind == "mbsd":
        pick = mbs_dynamic if n is None else functools.partial(mbs_near_static, radius=n)
        return functools.partial(_mbs_fake_quant, macro=MACRO_BLOCK, pick=pick)
    if kind in ("mb", "wmb"):
        assert n is not None  # parse() requires N for mbN / wmbN
        return functools.partial(_mbs_fake_quant, macro=n, pick=mbs_static)
    return None


def hadamard(b: int) -> torch.Tensor:
    """Orthonormal Sylvester Hadamard matrix of order b (a power of two), fp64."""
    h = torch.ones(1, 1, dtype=torch.float64)
    while h.shape[0] < b:
        h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)], 0)
    return h / h.shape[0] ** 0.5


def block_rotation(k: int, b: int) -> torch.Tensor:
    """Block-diagonal orthonormal R [k, k] (fp32): Hadamard blocks of b, the tail in the
    largest power-of-two blocks that fit (a tail of 1 stays as it is)."""
    r = torch.zeros(k, k, dtype=torch.float64)
    i = 0
    while i < k:
        s = b
        while s > k - i:
            s //= 2
        r[i : i + s, i : i + s] = hadamard(s)
        i += s
    return r.to(torch.float32)
