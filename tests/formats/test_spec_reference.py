"""`vllm_mxplus.formats` against an independent numpy derivation of docs/numerics.md
(tests/spec_reference.py): codes, scales, MBS bytes, block-max indices, global scales and
dequantized values, bit for bit (atol = rtol = 0), special values included."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from spec_reference import pack, ref_quantize

from vllm_mxplus.formats import FORMATS, quantize

ALL = list(FORMATS)


def _data(rows: int, k: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, k, generator=g) * torch.logspace(-4, 4, rows)[:, None]
    x[:, ::37] *= 12  # outliers
    return x.bfloat16().float()  # bf16 values, as a model's weights are


def _specials(k: int) -> torch.Tensor:
    """Rows exercising every rule of docs/numerics.md, "NaN, Inf and edge cases"."""
    x = torch.randn(10, k)
    x[0, 3 % k] = float("nan")
    x[1, (k - 1)] = float("inf")
    x[2] = 0.0
    x[3] = -0.0
    x[4] *= 2.0**-135  # fp32 subnormals: scale exponent below the E8M0 range
    x[5] *= 1e30  # near the top of the range
    x[6, : min(k, 16)] = torch.tensor(
        [1.75, -3.5, 7.0, 0.25, 0.75, 1.25, 2.5, 5.0, -0.0, 6.0, 3.0, 0.5, 1.0, 4.0, 7.5, 5.5]
    )[: min(k, 16)]
    x[7, : min(k, 32)] = 4.5  # ties everywhere: the first element is the MX+ block max
    x[8] = x[8].abs() * 1e-3
    x[8, 0] = -1e-45  # a negative value that rounds to -0
    return x


def assert_bits(actual: np.ndarray, expected: np.ndarray, what: str) -> None:
    a, e = np.asarray(actual), np.asarray(expected)
    assert a.shape == e.shape, f"{what}: shape {a.shape} != {e.shape}"
    if a.dtype.kind == "f":
        same = (a.view(np.int32) == e.astype(np.float32).view(np.int32)) | (
            np.isnan(a) & np.isnan(e)
        )
    else:
        same = a == e
    bad = np.argwhere(~same)
    assert bad.size == 0, (
        f"{what}: {len(bad)} mismatches, first at {tuple(bad[0])}: "
        f"{a[tuple(bad[0])]} != {e[tuple(bad[0])]}"
    )


def check(x: torch.Tensor, fmt: str, per_row: bool = False) -> None:
    q = quantize(x, fmt, per_row=per_row)
    ref = ref_quantize(x.numpy(), fmt, per_row=per_row)
    assert_bits(q.codes.numpy(), pack(ref["codes"]), f"{fmt} codes")
    if fmt == "nvfp4":
        assert_bits(q.scales.float().numpy(), ref["scales"], f"{fmt} scales")
        g = q.global_scale.reshape(-1).expand(x.shape[0]).numpy()
        assert_bits(g, ref["global_scale"], f"{fmt} global scale")
    else:
        assert_bits(q.scales.numpy().astype(np.int64), ref["scales"], f"{fmt} scales")
    if "mbs" in ref:
        assert_bits(q.mbs.numpy().astype(np.int64), ref["mbs"], f"{fmt} mbs")
    if "bm_index" in ref:
        assert_bits(q.block_max_index.numpy().astype(np.int64), ref["bm_index"], f"{fmt} bm")
    assert_bits(q.dequantize().numpy(), ref["x_hat"], f"{fmt} x_hat")


@pytest.mark.parametrize("fmt", ALL)
@pytest.mark.parametrize("k", [1, 17, 100, 576], ids=lambda k: f"K{k}")
def test_random_rows(fmt: str, k: int) -> None:
    check(_data(12, k, seed=k), fmt)


@pytest.mark.parametrize("fmt", ALL)
@pytest.mark.parametrize("k", [16, 40, 300], ids=lambda k: f"K{k}")
def test_special_values(fmt: str, k: int) -> None:
    check(_specials(k), fmt)


@pytest.mark.parametrize("k", [100, 576], ids=lambda k: f"K{k}")
def test_nvfp4_per_row(k: int) -> None:
    check(_data(12, k, seed=3), "nvfp4", per_row=True)
    check(_specials(k), "nvfp4", per_row=True)


def test_mxplus_block_max_is_independently_encoded() -> None:
    """MX+ by hand (docs/numerics.md, MX+): one block of 32, X = 2^0 (absmax 7.2 -> E = 2)."""
    x = torch.zeros(1, 32)
    x[0, 5] = -7.2  # block max: v = 7.2, j = rint(2 * 7.2 - 8) = 6 -> 4 * (1 + 6/8) = 7.0
    x[0, 9] = 7.2  # same |x|, later index: plain E2M1 (saturates at 6)
    x[0, 1] = 2.6  # E2M1: 3.0
    q = quantize(x, "mxplus")
    assert q.scales.tolist() == [[127]] and q.block_max_index.tolist() == [[5]]
    out = q.dequantize()[0]
    assert out[5].item() == -7.0 and out[9].item() == 6.0 and out[1].item() == 3.0
