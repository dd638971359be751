"""The number formats of docs/numerics.md in pure torch: the specification every backend meets.

Device-agnostic (CPU or CUDA tensors), no Python loops over blocks; imports neither vLLM
nor Triton.
"""

from vllm_mxplus.formats.mbs import mbs_dynamic_bruteforce, mbs_static
from vllm_mxplus.formats.mbs_search import mbs_dynamic
from vllm_mxplus.formats.params import GroupParams, choose_params, encode
from vllm_mxplus.formats.qsnr import qsnr
from vllm_mxplus.formats.qtensor import (
    QuantizedTensor,
    fake_quantize,
    logical_amax,
    quantize,
    quantize_nvfp4_logical,
    to_quantized_tensor,
)
from vllm_mxplus.formats.schemes import (
    FORMATS,
    MACRO_BLOCK,
    SCHEMES,
    FormatSpec,
    Scheme,
    as_format,
    check_format_macro_block,
    check_macro_block,
    get_format,
    get_scheme,
)

__all__ = [
    "FORMATS",
    "GroupParams",
    "MACRO_BLOCK",
    "SCHEMES",
    "FormatSpec",
    "QuantizedTensor",
    "Scheme",
    "as_format",
    "check_format_macro_block",
    "check_macro_block",
    "choose_params",
    "encode",
    "fake_quantize",
    "get_format",
    "get_scheme",
    "logical_amax",
    "mbs_dynamic",
    "mbs_dynamic_bruteforce",
    "mbs_static",
    "qsnr",
    "quantize",
    "quantize_nvfp4_logical",
    "to_quantized_tensor",
]
