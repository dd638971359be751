"""The Triton decode backend in the dispatch: registered for CUDA, rejected elsewhere with a
reason, and (on CUDA) numerically the reference's numbers."""

import pytest
import torch

from vllm_mxplus.formats import quantize
from vllm_mxplus.ops import LinearSpec, registered_backends, select
from vllm_mxplus.ops.reference import ReferenceBackend
from vllm_mxplus.ops.triton_backend import TritonDecodeBackend


def test_registered_first_for_cuda_only():
    assert registered_backends("cuda")[:2] == [
        "vllm_mxplus.ops.triton_backend:TritonDecodeBackend",
        "vllm_mxplus.ops.cutlass_prefill:CutlassPrefillBackend",
    ]
    assert all("triton" not in str(b) for b in registered_backends("cpu"))


def test_rejections_name_the_reason():
    ok, why = TritonDecodeBackend.is_supported("cpu", None)
    assert not ok and "CUDA" in why
    ok, why = TritonDecodeBackend.can_implement(LinearSpec("nvfp4", 64, 64, torch.bfloat16))
    assert not ok and "nvfp4" in why
    assert TritonDecodeBackend.can_implement(LinearSpec("mxfp4-mbs", 64, 64, torch.bfloat16))[0]
    assert TritonDecodeBackend.supports_m(16) and not TritonDecodeBackend.supports_m(17)


@pytest.mark.parametrize(
    "macro_block,ok", [(128, True), (1024, True), (2048, True), (4096, False), (96, False)]
)
def test_macro_blocks_the_kernels_cannot_tile_are_rejected(macro_block, ok):
    """can_implement rejects what the kernels cannot compile, so the selector falls back."""
    spec = LinearSpec("mxfp4-mbs", 64, 4096, torch.bfloat16, macro_block=macro_block)
    got, why = TritonDecodeBackend.can_implement(spec)
    assert got == ok and (ok or f"macro block {macro_block}" in why)
    # without MBS the macro block does not matter
    plain = LinearSpec("mxfp4-16-oas", 64, 4096, torch.bfloat16, macro_block=macro_block)
    assert TritonDecodeBackend.can_implement(plain)[0]


def test_cpu_selection_has_no_triton():
    chosen = [b.name for b in select(LinearSpec("mxfp4-mbs", 64, 576, torch.bfloat16), "cpu", None)]
    assert chosen in (["cpu-packed"], ["reference"]) and "triton-decode" not in chosen


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("scheme", ["mxfp4-mbs", "mxfp4-mbs-s", "mxfp4-16-oas", "mxfp4-ocp"])
@pytest.mark.parametrize("m", [1, 4, 16])
def test_cuda_decode_matches_reference(scheme, m):
    spec = LinearSpec(scheme, 1536, 576, torch.bfloat16, device_type="cuda")
    chosen = select(spec, "cuda", 10 * torch.cuda.get_device_capability()[0])
    assert chosen[0].name == "triton-decode"
    w = torch.randn(1536, 576, device="cuda", dtype=torch.bfloat16)
    qw = quantize(w, spec.weight_format)
    layer = torch.nn.Module()
    for b in (chosen[0], ReferenceBackend(spec)):
        b.process_weights_after_loading(layer, qw)
    x = torch.randn(m, 576, device="cuda", dtype=torch.bfloat16)
    y = chosen[0].apply(layer, x, None).float()
    ref = ReferenceBackend(spec).apply(layer, x, None).float()
    # both compute exact products of the same quantized operands; fp32 accumulation order and
    # the bf16 output rounding differ: allow 2 bf16 ulps of the output scale
    assert torch.allclose(y, ref, rtol=2**-7, atol=2**-7 * ref.abs().max().item())
