"""Quantized sources for `mxplus quantize`: compressed-tensors NVFP4 / MXFP4 checkpoints
written by the compressed-tensors library's own compressors, and gpt-oss MXFP4 expert stacks
in transformers' layout, dequantized exactly and requantized."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
import torch
from ckpt_helpers import complete_tensors, gpt_oss_config, make_custom, make_llama, source_tensors

from vllm_mxplus.checkpoint import load, load_unquantized, quantize_checkpoint
from vllm_mxplus.checkpoint.quantized_source import (
    GPT_OSS_BLOCKS,
    GPT_OSS_SCALES,
    QuantizedSource,
    dequantize_gpt_oss,
    materialize,
)
from vllm_mxplus.formats import quantize

pytest.importorskip("compressed_tensors")

from compressed_tensors.compressors import BaseCompressor  # noqa: E402
from compressed_tensors.quantization import (  # noqa: E402
    QuantizationConfig,
    QuantizationStatus,
    preset_name_to_scheme,
)
from compressed_tensors.quantization.lifecycle.forward import dequantize  # noqa: E402
from compressed_tensors.quantization.utils.helpers import (  # noqa: E402
    calculate_qparams,
    generate_gparam,
)

FMT = {"NVFP4": "nvfp4-pack-quantized", "MXFP4": "mxfp4-pack-quantized"}
LINEARS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def _ct_source(llama: Path, dst: Path, preset: str, scale_shift: int = 0, shards: int = 1) -> Path:
    """The llama's linears compressed by compressed-tensors' own compressor for `preset`
    (NVFP4: its global scale 2688 / amax; MXFP4: its E8M0 scales times 2^scale_shift), in
    `shards` files (tensors dealt round-robin: a weight's parts land in different files)."""
    scheme = preset_name_to_scheme(preset, ["Linear"])
    args = scheme.weights
    compressor = BaseCompressor.get_value_from_registry(FMT[preset])
    tensors = source_tensors(llama)
    out: dict[str, torch.Tensor] = {}
    for name, t in tensors.items():
        module = name.removesuffix(".weight")
        if not module.endswith(LINEARS):
            out[name] = t
            continue
        w = t.float()
        groups = w.reshape(w.shape[0], -1, args.group_size)
        gs = generate_gparam(w.min(), w.max()) if preset == "NVFP4" else None
        scale, _ = calculate_qparams(groups.amin(-1), groups.amax(-1), args, global_scale=gs)
        state = {"weight": w, "weight_scale": scale * 2.0**scale_shift}
        if gs is not None:
            state["weight_global_scale"] = gs
        for k, v in compressor.compress(state, scheme).items():
            out[f"{module}.{k}"] = v.contiguous()
    qc = QuantizationConfig(
        config_groups={"group_0": scheme},
        format=FMT[preset],
        quantization_status=QuantizationStatus.COMPRESSED,
        ignore=["lm_head"],
    ).model_dump(mode="json")
    qc["quant_method"] = "compressed-tensors"
    config = json.loads((llama / "config.json").read_text())
    config["quantization_config"] = qc
    return make_custom(dst, out, config, shards=shards)


@pytest.fixture(scope="module")
def llama(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_llama(tmp_path_factory.mktemp("qs") / "llama", intermediate=128)


def _library_weights(src: Path, preset: str) -> dict[str, torch.Tensor]:
    """The library's dequantization in fp32: value * (scale / G)."""
    tensors = source_tensors(src)
    out = {}
    for name, packed in tensors.items():
        if not name.endswith(".weight_packed"):
            continue
        module = name.removesuffix(".weight_packed")
        from compressed_tensors.compressors.nvfp4.helpers import unpack_fp4_from_uint8

        codes = unpack_fp4_from_uint8(packed, packed.shape[0], packed.shape[1] * 2, torch.float32)
        scale = tensors[f"{module}.weight_scale"]
        if preset == "MXFP4":
            scale = 2.0 ** (scale.to(torch.int32) - 127).to(torch.float32)
        out[module] = dequantize(
            codes,
            scale.to(torch.float32),
            dtype=torch.float32,
            global_scale=tensors.get(f"{module}.weight_global_scale"),
        )
    return out


@pytest.mark.parametrize("shards", [1, 3])
def test_mxfp4_source_to_mxfp4_ocp_keeps_the_codes(
    llama: Path, tmp_path: Path, shards: int
) -> None:
    # scales twice the library's: every block's codes stay <= 3, which requantizing would change
    src = _ct_source(llama, tmp_path / "ct-mxfp4", "MXFP4", scale_shift=1, shards=shards)
    dst = tmp_path / "out"
    quantize_checkpoint(src, dst, "mxfp4-ocp", progress=False)
    stored = source_tensors(src)
    got = load(dst)
    reference = _library_weights(src, "MXFP4")
    assert len(got) == len(reference) == 7
    rerounded = 0
    for module, q in got.items():
        assert torch.equal(q.codes, stored[f"{module}.weight_packed"]), module
        assert torch.equal(q.scales, stored[f"{module}.weight_scale"]), module
        assert torch.equal(q.dequantize(), reference[module]), module
        rerounded += not torch.equal(quantize(reference[module], "mxfp4-ocp").codes, q.codes)
    assert rerounded == 7  # requantizing would not have kept them


@pytest.mark.parametrize("preset", ["MXFP4", "NVFP4"])
@pytest.mark.parametrize("scheme", ["mxfp4-mbs", "nvfp4", "mxplus"])
def test_source_is_dequantized_exactly_then_requantized(
    preset: str, scheme: str, llama: Path, tmp_path: Path
) -> None:
    from vllm_mxplus.formats import get_scheme

    src = _ct_source(llama, tmp_path / f"ct-{preset}", preset)
    dst = tmp_path / "out"
    quantize_checkpoint(src, dst, scheme, progress=False)
    assert (
        json.loads((dst / "config.json").read_text())["quantization_config"]["quant_method"]
        == scheme
    )
    fmt = get_scheme(scheme).weight_format
    reference = _library_weights(src, preset)
    got = load(dst)
    assert sorted(got) == sorted(reference)
    for module, q in got.items():
        want = quantize(reference[module], fmt)
        assert torch.equal(q.codes, want.codes), module
        assert torch.equal(q.scales.view(torch.uint8), want.scales.view(torch.uint8)), module
    kept = load_unquantized(dst)
    assert torch.equal(kept["lm_head.weight"], source_tensors(llama)["lm_head.weight"])


def test_materialized_nvfp4_weights_are_the_library_s_fp32(llama: Path, tmp_path: Path) -> None:
    src = _ct_source(llama, tmp_path / "ct-nvfp4", "NVFP4")
    out = tmp_path / "deq"
    out.mkdir()
    materialize(src, out, QuantizedSource("nvfp4-pack-quantized"))
    got = source_tensors(out)
    assert "quantization_config" not in json.loads((out / "config.json").read_text())
    for module, w in _library_weights(src, "NVFP4").items():
        assert got[f"{module}.weight"].dtype == torch.float32
        assert torch.equal(got[f"{module}.weight"].view(torch.int32), w.view(torch.int32))
        assert f"{module}.weight_global_scale" not in got


def _gpt_oss(path: Path) -> tuple[Path, dict[str, torch.Tensor]]:
    """A one-layer gpt-oss-layout checkpoint: 2 experts, hidden 64, intermediate 32."""
    g = torch.Generator().manual_seed(0)
    e, h, i = 2, 64, 32
    t = {
        "model.layers.0.self_attn.q_proj.weight": torch.randn(64, h, generator=g).bfloat16(),
        "model.layers.0.mlp.router.weight": torch.randn(e, h, generator=g).bfloat16(),
        "model.layers.0.mlp.experts.gate_up_proj_bias": torch.randn(e, 2 * i).bfloat16(),
        "model.layers.0.mlp.experts.down_proj_bias": torch.randn(e, h).bfloat16(),
    }
    for proj, n, k in (("gate_up_proj", 2 * i, h), ("down_proj", h, i)):
        base = f"model.layers.0.mlp.experts.{proj}"
        t[f"{base}_blocks"] = torch.randint(0, 256, (e, n, k // 32, 16), generator=g).to(
            torch.uint8
        )
        t[f"{base}_scales"] = torch.randint(118, 131, (e, n, k // 32), generator=g).to(torch.uint8)
    qcfg = {"quant_method": "mxfp4", "modules_to_not_convert": ["model.layers.*.self_attn"]}
    cfg = {
        **gpt_oss_config(hidden=h, intermediate=i, experts=e, heads=4),
        "quantization_config": qcfg,
    }
    make_custom(path, complete_tensors(cfg, t, (GPT_OSS_BLOCKS, GPT_OSS_SCALES)), cfg)
    return path, t


def test_gpt_oss_experts_dequantize_as_transformers_does(tmp_path: Path) -> None:
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    src, t = _gpt_oss(tmp_path / "gpt-oss")
    out = tmp_path / "deq"
    out.mkdir()
    materialize(src, out, QuantizedSource("mxfp4"))
    got = source_tensors(out)
    for proj in ("gate_up_proj", "down_proj"):
        base = f"model.layers.0.mlp.experts.{proj}"
        want = convert_moe_packed_tensors(t[f"{base}_blocks"], t[f"{base}_scales"])
        assert got[base].dtype == want.dtype == torch.bfloat16
        assert got[base].shape == want.shape  # [E, K, N], gpt-oss's bf16 layout
        assert torch.equal(got[base].view(torch.int16), want.view(torch.int16)), proj
        assert f"{base}_blocks" not in got and f"{base}_scales" not in got
    assert torch.equal(
        got["model.layers.0.mlp.router.weight"], t["model.layers.0.mlp.router.weight"]
    )


def test_gpt_oss_source_quantizes(tmp_path: Path) -> None:
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    src, t = _gpt_oss(tmp_path / "gpt-oss")
    dst = tmp_path / "out"
    report = quantize_checkpoint(src, dst, "mxfp4-ocp", progress=False)
    assert report.src == str(src.absolute())
    assert (
        json.loads((dst / "config.json").read_text())["quantization_config"]["quant_method"]
        == "mxfp4-ocp"
    )
    q = load(dst)["model.layers.0.self_attn.q_proj"]
    assert torch.equal(
        q.codes, quantize(t["model.layers.0.self_attn.q_proj.weight"], "mxfp4-ocp").codes
    )
    kept = load_unquantized(dst)
    quantized = load(dst)
    for base in ("model.layers.0.mlp.experts.gate_up_proj", "model.layers.0.mlp.experts.down_proj"):
        # the expert stacks keep their MXFP4 codes and scales: [E, N, K], as the quantizer
        # stores gpt-oss's [E, K, N] experts (checkpoint/rules.py)
        blocks, scales = t[f"{base}_blocks"], t[f"{base}_scales"]
        q = quantized[base]
        assert torch.equal(q.codes, blocks.reshape(*blocks.shape[:2], -1))
        assert torch.equal(q.scales, scales)
        want = convert_moe_packed_tensors(blocks, scales)  # transformers' bf16 [E, K, N]
        assert torch.equal(q.dequantize().transpose(1, 2).to(torch.bfloat16), want)
    assert not any(n.endswith(("_blocks", "_scales")) for n in kept)
    assert not list(dst.parent.glob(".out.mxplus-src-*"))  # the dequantized copy is removed


def test_gpt_oss_source_reads_e8m0_as_the_spec_does() -> None:
    """A gpt-oss block [E, N, G, 16] with E8M0 scales dequantizes as formats' mxfp4-ocp does
    (code 255 is NaN, not 2^128), so requantizing and passing the codes through agree."""
    g = torch.Generator().manual_seed(0)
    q = quantize(torch.randn(8, 64, generator=g), "mxfp4-ocp")
    scales = q.scales.clone()
    scales[3, 1] = 255
    blocks = q.codes.reshape(1, 8, 2, 16)
    got = dequantize_gpt_oss(blocks, scales[None])[0].T.float()  # [N, K]
    want = dataclasses.replace(q, scales=scales).dequantize()  # the same tensor, code 255
    assert torch.equal(got.isnan(), want.isnan())
    assert got[3, 32:].isnan().all() and not got[3, :32].isnan().any()
    assert torch.equal(got.nan_to_num(), want.bfloat16().float().nan_to_num())
