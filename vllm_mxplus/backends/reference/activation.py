"""Fast activation fake-quantization for the reference backend: the same bits as
`formats.fake_quantize`, in fewer torch ops.

`formats.quantize(...).dequantize()` builds codes, packs and unpacks nibbles, which costs
~80 small ops per call: at decode (one token per call, ~200 linears per step on SmolLM2)
that op overhead, not arithmetic, dominates the CPU reference path. Here the E2M1 value
comes straight from the scaled magnitude v: on the grids [0, 2) step 1/2, [2, 4) step 1 and
[4, 6] step 2 the E2M1 codes and the grid indices have the same parity, so
round-half-to-even of v / step is exactly E2M1's ties-to-even-code rule; min(., 6) saturates.
tests/backends/reference/test_reference_activation.py checks bit equality with formats for every format it takes.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from vllm_mxplus.formats import FORMATS, FormatSpec, fake_quantize, get_format
from vllm_mxplus.formats.e2m1 import e2m1_round
from vllm_mxplus.formats.e8m0 import mantissa_threshold
from vllm_mxplus.formats.mbs import mbs_static
from vllm_mxplus.formats.mx import mbs_factor


def takes_fast_path(spec: FormatSpec) -> bool:
    """E8M0 scales, no MX+ block max, MBS static or none (an activation format)."""
    return spec.scale_is_e8m0 and not spec.block_max_mantissa and spec.mbs != "dynamic"


FAST_FORMATS = tuple(name for name, spec in FORMATS.items() if takes_fast_path(spec))


def fast_fake_quantize(
    x: torch.Tensor, fmt: str, macro_block: int, branch: bool | None = None
) -> torch.Tensor:
    """fake_quantize(x, fmt) for the E8M0 formats without MX+ (FAST_FORMATS), fp32.

    Scales come straight from the fp32 bits of the block absmax (normal numbers only: the
    exponent field e gives 2^s = 2^(e - 129 + d)); blocks outside that easy range (NaN/Inf,
    subnormal or huge absmax) take the general formats path, so the result is always the
    specification's. branch (default: x on the CPU) decides how: True looks at the data and
    runs the general path on the whole tensor only when some block needs it; False never
    reads the data on the host (a GPU sync, not capturable in a CUDA graph) and selects the
    general path's values for those blocks (per macro block with MBS) with torch.where.
    """
    spec = get_format(fmt)
    k = x.shape[-1]
    unit = spec.group_size(macro_block)
    xf = x.to(torch.float32)
    if k % unit:
        xf = F.pad(xf, (0, unit - k % unit))
    lead = xf.shape[:-1]
    if spec.mbs:
        f = mbs_factor(mbs_static(xf, macro_block))[..., None]
        y = xf.view(*lead, -1, macro_block) * f
    else:
        y = xf
    yb = y.view(*lead, -1, spec.block_size)
    ay = yb.abs()
    bits = ay.amax(-1, keepdim=True).view(torch.int32)
    e = bits >> 23
    hard = (e > 253) | ((e < 3) & (bits != 0))  # [..., blocks, 1]: outside the easy range
    on_host = xf.device.type == "cpu" if branch is None else branch  # static, not data
    if on_host and bool(hard.any()):  # reading a CPU tensor waits for no device
        return fake_quantize(x, fmt, macro_block=macro_block)
    d = ((bits & 0x7FFFFF) > mantissa_threshold(spec.scale_rule)).to(torch.int32)
    inv = ((256 - e - d) << 23).view(torch.float32)  # 2^-s (zero blocks: any finite value)
    scale = ((e - 2 + d).clamp_min(1) << 23).view(torch.float32)  # 2^s
    out = torch.copysign(e2m1_round(ay * inv), yb) * scale
    if spec.mbs:
        out = out.view(*lead, -1, macro_block) / f
    out = out.reshape(xf.shape)[..., :k]
    if on_host:
        return out
    # On a GPU the branch would be a host sync (and cannot be captured in a CUDA graph):
    # the general path always runs and supplies the blocks outside the easy range.
    rep = unit if spec.mbs else spec.block_size
    hard_el = hard.reshape(*lead, -1)
    if spec.mbs:  # hard per 16-block -> per macro block it belongs to
        hard_el = hard_el.view(*lead, -1, macro_block // spec.block_size).any(-1)
    hard_el = hard_el.repeat_interleave(rep, dim=-1)[..., :k]
    return torch.where(hard_el, fake_quantize(x, fmt, macro_block=macro_block), out)
