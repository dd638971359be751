"""Calibrated checkpoints carry encodings RTN never produces (an E8M0 exponent that is not
the scale rule's choice, an MBS byte that is not the MBS-D argmin, an E4M3 block scale off the
spec's code, elements not rounded to nearest under those parameters after GPTQ). The CPU
serving backends must compute the same numbers for them as for RTN encodings: every backend
the CPU dispatch selects (`ops.dispatch.select`: cpu-packed, the C++ integer GEMM) and the
reference backend, against the float64 product of the spec's dequantized values, within the
kernels' stated bounds (csrc/mx_gemm_cpu.cpp and csrc/mx_nvfp4_cpu.cpp; docs/numerics.md,
"Kernel numerics and error bounds"; the same bounds as tests/backends/cpu/test_cpu_kernels.py and
test_cpu_kernels_nvfp4.py, fp32 output).
"""

from __future__ import annotations

import shutil

import pytest
import torch

from vllm_mxplus.backends import LinearSpec, ReferenceBackend, select
from vllm_mxplus.backends.reference.linear import nvfp4_row_global_scale
from vllm_mxplus.checkpoint import load
from vllm_mxplus.formats import MACRO_BLOCK, QuantizedTensor, fake_quantize, get_format, get_scheme
from vllm_mxplus.formats.constants import ceil_div
from vllm_mxplus.formats.e2m1 import pack_fp4

pytestmark = pytest.mark.skipif(shutil.which("c++") is None, reason="no C++ compiler (c++)")

# every scheme with a CPU kernel: the E8M0 pairs and NVFP4
SCHEMES = ["mxfp4-ocp", "mxfp4-16-oas", "mxfp4-mbs-s", "mxfp4-mbs-h", "nvfp4"]


def _backends(spec: LinearSpec) -> list:
    chosen = select(spec, "cpu", None)
    assert chosen[0].name == "cpu-packed", [b.name for b in chosen]  # the kernel, not a fallback
    return [*chosen, ReferenceBackend(spec)]


def _assert_served_exactly(q: QuantizedTensor, scheme: str, x: torch.Tensor) -> None:
    n, k = q.shape
    afmt = get_scheme(scheme).activation_format
    nv = get_format(afmt).has_global_scale
    spec = LinearSpec(get_scheme(scheme, q.macro_block), n=n, k=k, out_dtype=torch.float32)
    xq = fake_quantize(x, afmt, per_row=nv, macro_block=q.macro_block).double()
    w = q.dequantize(torch.float32).double()
    ref, mag = xq @ w.T, xq.abs() @ w.abs().T
    u = 2.0**-24
    if nv:
        n_b = ceil_div(k, 16)
        ga = nvfp4_row_global_scale(x).double().reshape(-1, 1)
        gw = q.global_scale.double().reshape(1, -1)
        bound = (n_b + 6) * u * mag + 2.0**-146 * n_b * ga * gw
    else:
        wf = get_format(q.fmt)
        n_b = ceil_div(k, wf.block_size)
        n_c = ceil_div(k, q.macro_block) if (wf.mbs or get_format(afmt).mbs) else 1
        l1 = xq.abs().sum(-1, keepdim=True) + w.abs().sum(-1)[None, :]
        bound = (n_b + n_c + 5) * u * mag + 2.0**-146 * (l1 + n_b)
    assert torch.isfinite(ref).all()
    for backend in _backends(spec):
        layer = torch.nn.Module()
        backend.process_weights_after_loading(layer, q)
        y = backend.apply(layer, x, None).double()
        err = (y - ref).abs()
        bad = ~(err <= bound)
        assert not bad.any(), (
            f"{backend.name} {scheme}: {int(bad.sum())} of {bad.numel()} outputs out of bound, "
            f"err {float(err.max()):.3g}"
        )


def _arbitrary_encoding(scheme: str, n: int, k: int, seed: int) -> QuantizedTensor:
    """A valid but non-RTN encoding: uniform random codes, block scales and MBS bytes."""
    fmt = get_scheme(scheme).weight_format
    spec = get_format(fmt)
    g = torch.Generator().manual_seed(seed)
    codes = torch.randint(0, 16, (n, k), generator=g, dtype=torch.uint8)
    nb = ceil_div(k, spec.block_size)
    if spec.has_global_scale:
        scales = torch.randint(1, 127, (n, nb), generator=g, dtype=torch.uint8)
        return QuantizedTensor(
            codes=pack_fp4(codes),
            scales=scales.view(torch.float8_e4m3fn),
            spec=get_format(fmt),
            shape=torch.Size((n, k)),
            global_scale=torch.tensor(2.0**-9),
        )
    mbs = None
    if spec.mbs:
        mbs = torch.randint(0, 256, (n, ceil_div(k, MACRO_BLOCK)), generator=g, dtype=torch.uint8)
    return QuantizedTensor(
        codes=pack_fp4(codes),
        scales=torch.randint(118, 127, (n, nb), generator=g, dtype=torch.uint8),
        spec=get_format(fmt),
        shape=torch.Size((n, k)),
        mbs=mbs,
        macro_block=MACRO_BLOCK,
    )


@pytest.mark.parametrize("scheme", SCHEMES)
@pytest.mark.parametrize("m", [1, 7, 40], ids=lambda m: f"M{m}")
def test_arbitrary_encodings_through_every_cpu_backend(scheme: str, m: int) -> None:
    """Any codes / scales / MBS bytes the layout can hold, not only the ones RTN picks."""
    k = 2 * MACRO_BLOCK + 48  # a partial macro block and a partial block at the end
    q = _arbitrary_encoding(scheme, 37, k, seed=m)
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(100 + m))
    _assert_served_exactly(q, scheme, x)


@pytest.mark.parametrize("scheme", SCHEMES)
@pytest.mark.parametrize("method", ["rtn-aware", "gptq"])
def test_calibrated_checkpoint_through_every_cpu_backend(
    calibrated, scheme: str, method: str
) -> None:
    dst, _ = calibrated(scheme, method)
    g = torch.Generator().manual_seed(1)
    for q in load(dst).values():
        _assert_served_exactly(q, scheme, torch.randn(5, q.shape[-1], generator=g))


@pytest.mark.parametrize("scheme", ["mxfp4-mbs-s", "mxfp4-mbs-h"])
@pytest.mark.parametrize("method", ["rtn-aware", "gptq"])
def test_calibrated_macro_block_32_through_every_cpu_backend(
    calibrated, scheme: str, method: str
) -> None:
    """`--macro-block 32` with a calibrated method: MBS bytes per 32 on both sides."""
    dst, _ = calibrated(scheme, method, 32)
    g = torch.Generator().manual_seed(2)
    for q in load(dst).values():
        assert q.macro_block == 32
        _assert_served_exactly(q, scheme, torch.randn(5, q.shape[-1], generator=g))
