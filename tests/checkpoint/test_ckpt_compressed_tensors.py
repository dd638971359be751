"""`mxplus quantize --format compressed-tensors`: read back by the compressed-tensors library.

The written checkpoint is decompressed by compressed-tensors 0.17 itself (its config model and
its registered NVFP4 / MXFP4 compressors, and transformers' loader) and compared bit for bit
with the plugin's own dequantization (`vllm_mxplus.formats`) of the same codes and scales.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from ckpt_helpers import cli_args, make_llama, source_tensors

from vllm_mxplus.checkpoint import quantize_checkpoint
from vllm_mxplus.checkpoint.cli_quantize import EXIT_USAGE
from vllm_mxplus.errors import UsageError
from vllm_mxplus.formats import QuantizedTensor, quantize
from vllm_mxplus.formats.constants import E2M1_MAX, F8E4M3_MAX

pytest.importorskip("compressed_tensors")

from compressed_tensors.compressors import BaseCompressor  # noqa: E402
from compressed_tensors.quantization import QuantizationConfig  # noqa: E402

FUSED = (("q_proj", "k_proj", "v_proj"), ("gate_proj", "up_proj"))


@pytest.fixture(scope="module")
def src(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny llama whose every K (64, 128) is a multiple of 32."""
    return make_llama(tmp_path_factory.mktemp("ct") / "llama", intermediate=128, layers=2)


@pytest.fixture
def written(src: Path, tmp_path: Path, random_tokens: None) -> dict[str, Path]:
    """scheme -> checkpoint dir, quantized with --format compressed-tensors (random tokens)."""
    out: dict[str, Path] = {}
    for scheme in ("nvfp4", "mxfp4-ocp"):
        out[scheme] = tmp_path / scheme
        quantize_checkpoint(
            src,
            out[scheme],
            scheme,
            out_format="compressed-tensors",
            progress=False,
            nsamples=4,
            seqlen=16,
        )
    return out


def _modules(tensors: dict[str, torch.Tensor]) -> dict[str, dict[str, torch.Tensor]]:
    mods: dict[str, dict[str, torch.Tensor]] = {}
    for name, t in tensors.items():
        module, _, suffix = name.rpartition(".")
        if f"{module}.weight_packed" in tensors:
            mods.setdefault(module, {})[suffix] = t
    return mods


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.to(torch.float32).view(torch.int32)


def _check_library_decompression(dst: Path, scheme: str, original: dict | None) -> None:
    """Every quantized module of dst decompressed by compressed-tensors' registered compressor
    equals the plugin's dequantization of its codes and scales, bit for bit; with `original`
    (the source tensors), also close to the source weight."""
    cfg = json.loads((dst / "config.json").read_text())["quantization_config"]
    assert cfg["quant_method"] == "compressed-tensors"
    qc = QuantizationConfig.model_validate(cfg)
    (group,) = qc.config_groups.values()
    fmt = {"nvfp4": "nvfp4-pack-quantized", "mxfp4-ocp": "mxfp4-pack-quantized"}[scheme]
    assert qc.format == fmt and group.format == fmt
    assert "lm_head" in qc.ignore
    compressor = BaseCompressor.get_value_from_registry(fmt)
    mods = _modules(source_tensors(dst))
    assert len(mods) == 2 * 7  # every attention and MLP linear of both layers
    for module, stored in mods.items():
        ct = compressor.decompress(dict(stored), group)["weight"]
        g = None
        if scheme == "nvfp4":
            assert stored["weight_scale"].dtype == torch.float8_e4m3fn
            g = (1.0 / stored["weight_global_scale"]).reshape(())
        else:
            assert stored["weight_scale"].dtype == torch.uint8
        packed = stored["weight_packed"]
        q = QuantizedTensor(
            codes=packed,
            scales=stored["weight_scale"],
            fmt=scheme,
            shape=torch.Size((packed.shape[0], packed.shape[1] * 2)),
            global_scale=g,
        )
        ours = q.dequantize()
        assert ct.dtype == torch.bfloat16
        assert torch.equal(_bits(ct), _bits(ours)), module  # and so ours is exact in bf16
        if original is not None:
            w = original[f"{module}.weight"].float()
            err = (w - ours).square().sum() / w.square().sum()
            assert err < 0.02, (module, float(err))  # ~17 dB or better: the weight, not noise


@pytest.mark.parametrize("scheme", ["nvfp4", "mxfp4-ocp"])
def test_library_decompresses_the_plugin_s_weights_bit_for_bit(
    scheme: str, written: dict[str, Path], src: Path
) -> None:
    _check_library_decompression(written[scheme], scheme, source_tensors(src))


@pytest.mark.parametrize(
    ("scheme", "method", "smooth"),
    [("nvfp4", "rtn", 0.5), ("mxfp4-ocp", "gptq", None), ("mxfp4-ocp", "rtn-aware", 0.5)],
)
def test_calibrated_and_smoothed_checkpoints_decompress_bit_for_bit(
    scheme: str, method: str, smooth: float | None, src: Path, tmp_path: Path, random_tokens: None
) -> None:
    dst = tmp_path / "out"
    calibration = {
        "method": method,
        "smooth": smooth,
        "nsamples": 4,
        "seqlen": 16,
        "progress": False,
    }
    quantize_checkpoint(src, dst, scheme, out_format="compressed-tensors", **calibration)
    _check_library_decompression(dst, scheme, None)
    if method != "rtn":  # the calibrated weights, not RTN's
        mods = _modules(source_tensors(dst))
        w = source_tensors(src)["model.layers.0.mlp.down_proj.weight"]
        assert not torch.equal(
            mods["model.layers.0.mlp.down_proj"]["weight_packed"], quantize(w, scheme).codes
        )


def test_nvfp4_global_scale_is_a_shared_power_of_two(written: dict[str, Path], src: Path) -> None:
    mods = _modules(source_tensors(written["nvfp4"]))
    original = source_tensors(src)
    for layer in range(2):
        for group in FUSED:
            parent = "self_attn" if "q_proj" in group else "mlp"
            names = [f"model.layers.{layer}.{parent}.{m}" for m in group]
            gs = {float(mods[n]["weight_global_scale"]) for n in names}
            assert len(gs) == 1, names  # vLLM keeps one per fused layer
            (big_g,) = gs
            m, _ = torch.frexp(torch.tensor(big_g))
            assert float(m) == 0.5  # a power of two: 1/G is exact
            amax = max(float(original[f"{n}.weight"].float().abs().max()) for n in names)
            g = 1.0 / big_g
            assert g / 2 < amax / (E2M1_MAX * F8E4M3_MAX) <= g  # the smallest that fits
            ins = {float(mods[n]["input_global_scale"]) for n in names}
            assert len(ins) == 1 and 0 < next(iter(ins)) < float("inf")


def test_nvfp4_codes_are_the_spec_s_under_that_global_scale(
    written: dict[str, Path], src: Path
) -> None:
    from vllm_mxplus.formats.nvfp4 import quantize_nvfp4_given

    mods = _modules(source_tensors(written["nvfp4"]))
    original = source_tensors(src)
    for module, stored in mods.items():
        g = (1.0 / stored["weight_global_scale"]).reshape(())
        codes, scales = quantize_nvfp4_given(original[f"{module}.weight"], g)
        packed = codes[..., 0::2] | (codes[..., 1::2] << 4)
        assert torch.equal(stored["weight_packed"], packed), module
        assert torch.equal(stored["weight_scale"].view(torch.uint8), scales.view(torch.uint8))


def test_mxfp4_ocp_codes_equal_the_plugin_format(written: dict[str, Path], src: Path) -> None:
    mods = _modules(source_tensors(written["mxfp4-ocp"]))
    original = source_tensors(src)
    for module, stored in mods.items():
        q = quantize(original[f"{module}.weight"], "mxfp4-ocp")
        assert torch.equal(stored["weight_packed"], q.codes), module
        assert torch.equal(stored["weight_scale"], q.scales), module


@pytest.mark.parametrize("scheme", ["nvfp4", "mxfp4-ocp"])
def test_transformers_loads_it_through_compressed_tensors(
    scheme: str, written: dict[str, Path]
) -> None:
    """transformers' compressed-tensors quantizer (run_compressed=False: decompressed at load)
    gives the plugin's weights, so the checkpoint is complete for another tool."""
    from transformers import AutoModelForCausalLM
    from transformers.utils.quantization_config import CompressedTensorsConfig

    dst = written[scheme]
    model = AutoModelForCausalLM.from_pretrained(
        str(dst), quantization_config=CompressedTensorsConfig(run_compressed=False)
    )
    stored = _modules(source_tensors(dst))["model.layers.1.mlp.down_proj"]
    g = stored.get("weight_global_scale")
    q = QuantizedTensor(
        stored["weight_packed"],
        stored["weight_scale"],
        scheme,
        torch.Size((64, 128)),
        global_scale=None if g is None else (1.0 / g).reshape(()),
    )
    got = model.model.layers[1].mlp.down_proj.weight.detach()
    assert torch.equal(_bits(got), _bits(q.dequantize()))


@pytest.mark.parametrize("scheme", ["mxplus", "mxfp4-16-oas", "mxfp4-mbs", "mxfp4-mbs-s"])
def test_paper_formats_are_refused(scheme: str, src: Path, tmp_path: Path, capsys) -> None:  # noqa: ANN001
    args = cli_args(
        str(src),
        str(tmp_path / "o"),
        "--scheme",
        scheme,
        "--format",
        "compressed-tensors",
        "--no-progress",
    )
    assert args.func(args) == EXIT_USAGE
    err = capsys.readouterr().err
    assert f"scheme {scheme!r} has no compressed-tensors format" in err
    assert not (tmp_path / "o").exists()


def test_calibrated_nvfp4_is_refused(src: Path, tmp_path: Path) -> None:
    with pytest.raises(UsageError, match="--method gptq"):
        quantize_checkpoint(
            src, tmp_path / "o", "nvfp4", method="gptq", out_format="compressed-tensors"
        )


def test_k_not_a_whole_group_is_refused(tmp_path: Path) -> None:
    odd = make_llama(tmp_path / "odd", intermediate=100)  # down_proj K = 100
    with pytest.raises(UsageError, match=r"down_proj.*multiple of 32.*--ignore"):
        quantize_checkpoint(
            odd, tmp_path / "o", "mxfp4-ocp", out_format="compressed-tensors", progress=False
        )
