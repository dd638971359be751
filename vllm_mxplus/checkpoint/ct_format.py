"""`mxplus quantize --format compressed-tensors`: the compressed-tensors layout (docs/checkpoints.md).

compressed-tensors 0.17 (llm-compressor's format, read by vLLM's in-tree `compressed-tensors`
method and by transformers) stores, per quantized Linear NAME [N, K]:
  NAME.weight_packed        uint8 [N, K/2]   E2M1 codes, element 2i in the low nibble (ours)
  NAME.weight_scale         float8_e4m3fn [N, K/16] (nvfp4) | uint8 E8M0 [N, K/32] (mxfp4)
  NAME.weight_global_scale  float32 [1]      nvfp4: the DIVISOR G = 1 / g of our scale g
  NAME.input_global_scale   float32 [1]      nvfp4: the static activation divisor
and dequantizes w = value * (scale / G) (`compressed_tensors.quantization.lifecycle`), E8M0
as 2^(code - 127). Only nvfp4 and mxfp4-ocp have a compressed-tensors format; the paper's
formats (MX+, 16-OAS, MBS) keep the plugin's own layout.

Two choices make the written values equal the plugin's dequantized weights bit for bit:
* the nvfp4 weight scale g is a power of two, g = 2^ceil(log2(amax / (6 * 448))), so 1/g is
  exact and every product value * s * g is exact in fp32 and bf16 (g = amax / 2688, the
  plugin's own rule, has no exact reciprocal);
* amax is over vLLM's fused siblings together (q/k/v, gate/up), because vLLM keeps one global
  scale per fused layer (the max of the siblings'), as llm-compressor also writes them.
The calibrated methods (--method rtn-aware | gptq) choose nvfp4 block scales under that same g
(nvfp4_ct_globals, given to the calibration as its fixed global scale), so every --method and
--smooth is written exactly.
"""

from __future__ import annotations

from typing import Any

import torch

from vllm_mxplus.checkpoint.layout import SUFFIX_GLOBAL, SUFFIX_PACKED, SUFFIX_SCALE
from vllm_mxplus.checkpoint.rules import FUSED_GROUPS
from vllm_mxplus.checkpoint.safetensors_io import read_tensor
from vllm_mxplus.checkpoint.shard_writer import Item
from vllm_mxplus.errors import UsageError
from vllm_mxplus.formats import QuantizedTensor, get_format
from vllm_mxplus.formats.e2m1 import pack_fp4
from vllm_mxplus.formats.nvfp4 import global_from_amax, quantize_nvfp4_given

FORMAT_MXPLUS = "mxplus"
FORMAT_CT = "compressed-tensors"
FORMATS = (FORMAT_MXPLUS, FORMAT_CT)
CT_QUANT_METHOD = "compressed-tensors"
SUFFIX_INPUT_GLOBAL = "input_global_scale"
# scheme -> (compressed-tensors preset, storage format, group size)
CT_SCHEMES = {
    "nvfp4": ("NVFP4", "nvfp4-pack-quantized", 16),
    "mxfp4-ocp": ("MXFP4", "mxfp4-pack-quantized", 32),
}
CT_TARGETS = ["Linear"]


def check_ct_request(scheme: str) -> None:
    """Raise UsageError unless `scheme` can be written as compressed-tensors (every --method
    and --smooth can: nvfp4's calibrated methods choose their block scales under the global
    scale this layout stores, nvfp4_ct_globals)."""
    if scheme not in CT_SCHEMES:
        raise UsageError(
            f"--format {FORMAT_CT}: scheme {scheme!r} has no compressed-tensors format (only "
            f"{', '.join(CT_SCHEMES)}); write it with --format {FORMAT_MXPLUS}, whose "
            f"quant_method {scheme!r} only vllm-mxplus loads"
        )


def check_ct_shape(name: str, shape: tuple[int, ...], scheme: str) -> None:
    """compressed-tensors packs whole groups of 2-D Linear weights: K % group == 0."""
    group = CT_SCHEMES[scheme][2]
    if len(shape) != 2 or shape[-1] % group:
        raise UsageError(
            f"tensor {name!r} {list(shape)}: --format {FORMAT_CT} stores 2-D Linear weights "
            f"whose input dim is a multiple of {group}; keep it in high precision with "
            f"--ignore, or use --format {FORMAT_MXPLUS}"
        )


def ct_stored_layout(scheme: str, shape: tuple[int, ...]) -> dict[str, tuple[str, tuple]]:
    """suffix -> (safetensors dtype, shape) of every stored tensor of a weight [N, K]."""
    n, k = shape
    group = CT_SCHEMES[scheme][2]
    if scheme == "nvfp4":
        return {
            SUFFIX_PACKED: ("U8", (n, k // 2)),
            SUFFIX_SCALE: ("F8_E4M3", (n, k // group)),
            SUFFIX_GLOBAL: ("F32", (1,)),
            SUFFIX_INPUT_GLOBAL: ("F32", (1,)),
        }
    return {SUFFIX_PACKED: ("U8", (n, k // 2)), SUFFIX_SCALE: ("U8", (n, k // group))}


def fused_group_key(module: str) -> str:
    """The vLLM layer a module is loaded into: `a.b.qkv` for a.b.{q,k,v}_proj, else itself."""
    parent, _, leaf = module.rpartition(".")
    for group in FUSED_GROUPS:
        if leaf in group:
            return f"{parent}.{'+'.join(group)}"
    return module


def pow2_global_scale(amax: torch.Tensor) -> torch.Tensor:
    """g = 2^ceil(log2(amax / (6 * 448))) in fp32, shape []: the smallest power of two with
    every block scale amax_b / 6 / g <= 448. amax = 0 (an all-zero weight) gives g = 1."""
    t = global_from_amax(amax.reshape(())).reshape(1)
    if not bool(t > 0):
        return torch.ones((), dtype=torch.float32)
    m, e = torch.frexp(t)  # t = m * 2^e, m in [0.5, 1)
    exp = e - (m == 0.5).to(e.dtype)  # t a power of two: g = t itself
    return torch.ldexp(torch.ones(1), exp).reshape(())


def quantize_nvfp4_ct(w: torch.Tensor, g: torch.Tensor) -> QuantizedTensor:
    """NVFP4 of a weight [N, K] under the given (power-of-two) global scale g: the spec's
    block scales and codes (formats.nvfp4.quantize_nvfp4_given)."""
    codes, scales = quantize_nvfp4_given(w, g)
    return QuantizedTensor(
        codes=pack_fp4(codes),
        scales=scales,
        spec=get_format("nvfp4"),
        shape=torch.Size(w.shape),
        global_scale=g.reshape(()),
    )


def input_global_scale(amax: torch.Tensor | float) -> torch.Tensor:
    """compressed-tensors' static activation divisor for an input amax: 6 * 448 / amax
    (`compressed_tensors.quantization.utils.generate_gparam`, what llm-compressor writes)."""
    from compressed_tensors.quantization.utils.helpers import generate_gparam

    a = torch.as_tensor(amax, dtype=torch.float32).reshape(1)
    return generate_gparam(-a, a).reshape(1)


def ct_encode(q: QuantizedTensor, input_amax: torch.Tensor | None = None) -> dict[str, Any]:
    """suffix -> CPU tensor of the compressed-tensors layout for a QuantizedTensor [N, K]."""
    out = {SUFFIX_PACKED: q.codes, SUFFIX_SCALE: q.scales}
    if q.global_scale is not None:
        g = q.global_scale.reshape(1).to(torch.float32)
        out[SUFFIX_GLOBAL] = 1.0 / g  # exact: g is a power of two (pow2_global_scale)
        if input_amax is None:
            raise ValueError("nvfp4 for compressed-tensors needs the input amax")
        out[SUFFIX_INPUT_GLOBAL] = input_global_scale(input_amax)
    return {s: t.to("cpu").contiguous() for s, t in out.items()}


def make_ct_quantization_config(scheme: str, unquantized_modules: list[str]) -> dict[str, Any]:
    """config.json's quantization_config, built by the compressed-tensors library itself
    (as `ModelCompressor.update_config` writes it)."""
    import compressed_tensors
    from compressed_tensors.base import (
        COMPRESSION_VERSION_NAME,
        QUANTIZATION_METHOD_NAME,
        SPARSITY_CONFIG_NAME,
        TRANSFORM_CONFIG_NAME,
    )
    from compressed_tensors.quantization import (
        QuantizationConfig,
        QuantizationStatus,
        preset_name_to_scheme,
    )

    preset, fmt, _ = CT_SCHEMES[scheme]
    group = preset_name_to_scheme(preset, CT_TARGETS)
    group.format = fmt
    qc = QuantizationConfig(
        config_groups={"group_0": group},
        format=fmt,
        quantization_status=QuantizationStatus.COMPRESSED,
        ignore=sorted(set(unquantized_modules)),
    )
    return {
        COMPRESSION_VERSION_NAME: compressed_tensors.__version__,
        QUANTIZATION_METHOD_NAME: CT_QUANT_METHOD,
        SPARSITY_CONFIG_NAME: {},
        TRANSFORM_CONFIG_NAME: {},
        **qc.model_dump(mode="json", exclude={"quant_method"}),
    }


def nvfp4_ct_globals(
    items: list[Item], rewritten: dict[str, torch.Tensor]
) -> dict[str, torch.Tensor]:
    """module -> the NVFP4 global scale g this layout stores for it: the power of two
    (pow2_global_scale) of the max finite |w| over its vLLM layer (the fused siblings together,
    see the module docstring). The one rule for g: the rtn pass (nvfp4_ct_weights) quantizes
    under it and the calibrated methods choose their block scales under it. Reads each
    quantized weight once (`rewritten`: the smoothed ones), keeping memory at one weight."""
    amax: dict[str, torch.Tensor] = {}
    modules = []
    for it in _quantized(items):
        w = _weight(it, rewritten)
        a = torch.where(torch.isfinite(w), w.abs(), torch.zeros_like(w)).amax()
        module = str(it.decision.module)
        key = fused_group_key(module)
        amax[key] = torch.maximum(amax[key], a) if key in amax else a
        modules.append(module)
    return {m: pow2_global_scale(amax[fused_group_key(m)]) for m in modules}


def nvfp4_ct_weights(
    items: list[Item],
    rewritten: dict[str, torch.Tensor],
    calibrated: dict[str, QuantizedTensor] | None = None,
) -> dict[str, QuantizedTensor]:
    """NVFP4 for compressed-tensors by module: `calibrated` ones (rtn-aware / gptq, chosen
    under nvfp4_ct_globals) as they are, the others the spec's block scales and codes under
    that global scale. Reads every quantized weight twice (global scales, then quantize) to
    keep memory at one weight."""
    calibrated = calibrated or {}
    globals_ = nvfp4_ct_globals(items, rewritten)
    out = {}
    for it in _quantized(items):
        module = str(it.decision.module)
        g = globals_[module]
        q = calibrated.get(module)
        if q is None:
            q = quantize_nvfp4_ct(_weight(it, rewritten), g)
        elif q.global_scale is None or not torch.equal(q.global_scale.reshape(()), g):
            got = None if q.global_scale is None else float(q.global_scale)
            raise RuntimeError(
                f"{module}: calibrated under global scale {got}, not the stored {float(g)} "
                "(a bug; please report it)"
            )
        out[module] = q
    return out


def _quantized(items: list[Item]) -> list[Item]:
    return [i for i in items if i.decision.quantize and i.decision.module is not None]


def _weight(it: Item, rewritten: dict[str, torch.Tensor]) -> torch.Tensor:
    w = rewritten.get(it.info.name)
    return (w if w is not None else read_tensor(it.info)).to(torch.float32)
