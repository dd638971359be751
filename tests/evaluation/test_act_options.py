"""The gptq study's activation options (vllm_mxplus.evaluation.act_options) against `formats`."""

from __future__ import annotations

import pytest
import torch

from vllm_mxplus.evaluation import act_options
from vllm_mxplus.formats import fake_quantize
from vllm_mxplus.formats.mbs import mbs_sse, mbs_static
from vllm_mxplus.formats.mbs_search import mbs_dynamic


def _acts(rows: int = 6, k: int = 576) -> torch.Tensor:
    g = torch.Generator().manual_seed(3)
    x = torch.randn(rows, k, generator=g) * torch.rand(k, generator=g) * 4
    x[:, 7] *= 40  # an outlier channel, as LLM activations have
    return x


@pytest.mark.parametrize("act", ["mbsd0", "mb128"])
def test_no_search_is_mbs_s_bit_for_bit(act: str) -> None:
    x = _acts()
    q = act_options.activation_quantizer(act)
    assert torch.equal(q(x), fake_quantize(x, "mxfp4-mbs-s"))


def test_all_256_candidates_reach_the_exhaustive_sse() -> None:
    x = _acts()
    xp = torch.nn.functional.pad(x, (0, 640 - 576))
    grid = act_options.mbs_grid(xp, 128, 256)
    exact = mbs_dynamic(xp, 128)
    assert torch.equal(mbs_sse(xp, grid, 128), mbs_sse(xp, exact, 128))


@pytest.mark.parametrize("pick", ["near", "grid"])
def test_a_search_never_loses_to_the_static_byte_and_more_candidates_never_lose(pick: str) -> None:
    xp = torch.nn.functional.pad(_acts(), (0, 640 - 576))
    m0 = mbs_static(xp, 128)
    prev = mbs_sse(xp, m0, 128)
    for n in (1, 2, 4, 8) if pick == "near" else (2, 4, 8, 16):
        m = (
            act_options.mbs_near_static(xp, 128, n)
            if pick == "near"
            else act_options.mbs_grid(xp, 128, n)
        )
        sse = mbs_sse(xp, m, 128)
        assert (sse <= prev).all()
        prev = sse  # each set contains the previous one (grid: K/2's bytes are among K's)
    assert (prev < mbs_sse(xp, m0, 128)).any()


def test_smaller_macro_blocks_match_formats() -> None:
    x = _acts()
    for n in (32, 64):
        got = act_options.activation_quantizer(f"mb{n}")(x)
        assert torch.equal(got, fake_quantize(x, "mxfp4-mbs-s", macro_block=n))


@pytest.mark.parametrize(("k", "b"), [(576, 128), (576, 16), (1536, 128), (37, 16)])
def test_block_rotation_is_orthonormal_and_keeps_the_product(k: int, b: int) -> None:
    r = act_options.block_rotation(k, b).double()
    assert torch.allclose(r @ r.T, torch.eye(k, dtype=torch.float64), atol=1e-6)
    x, w = torch.randn(3, k, dtype=torch.float64), torch.randn(5, k, dtype=torch.float64)
    assert torch.allclose((x @ r) @ (w @ r).T, x @ w.T, atol=1e-5)


@pytest.mark.parametrize("bad", ["mbsg3", "mb20", "wmb8", "had12", "rot"])
def test_bad_options_are_refused_by_name(bad: str) -> None:
    with pytest.raises(SystemExit, match=f"@{bad}"):
        act_options.parse(bad)


def test_mbs_options_refuse_other_activation_formats() -> None:
    with pytest.raises(SystemExit, match="nvfp4"):
        act_options.check_scheme("mbsd", "nvfp4")
    act_options.check_scheme("had16", "nvfp4")


def test_weight_macro_option_sets_both_sides() -> None:
    assert act_options.weight_macro_block("wmb32") == 32
    assert act_options.weight_macro_block("mb32") is None
    x = _acts()
    got = act_options.activation_quantizer("wmb32")(x)
    assert torch.equal(got, fake_quantize(x, "mxfp4-mbs-s", macro_block=32))


@pytest.mark.parametrize("act", ["mb24", "mb0", "wmb8"])
def test_invalid_macro_block_option_names_itself(act: str) -> None:
    """A macro block option follows the formats' one rule (a positive multiple of the block
    size) and the error names the option."""
    with pytest.raises(
        SystemExit, match=rf"@{act}: the macro block .*positive multiple of the block size 16"
    ):
        act_options.parse(act)


@pytest.mark.parametrize(("act", "n"), [("mb32", 32), ("wmb48", 48)])
def test_valid_macro_block_option(act: str, n: int) -> None:
    assert act_options.parse(act) == (act.rstrip("0123456789"), n)
