"""`mxplus quantize --format compressed-tensors`: read back by the compressed-tensors library.

The written checkpoint is decompressed by compressed-tensors 0.17 itself (its config model and
its registered NVFP4 / MXFP4 compressors, and transformers' loader) and compared bit for bit
with the plugin's own dequantization (`vllm_mxplus.formats`) of the same codes and scales.
NVFP4 with the calibrated methods: their block scales are chosen under the stored power-of-two,
fused-layer global scale, and they do no worse than RTN under it on their own objectives.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from ckpt_helpers import cli_args, make_llama, source_tensors

from vllm_mxplus.calibration.gptq import gptq, rtn_aware
from vllm_mxplus.checkpoint import quantize_checkpoint
from vllm_mxplus.checkpoint.cli_quantize import EXIT_USAGE
from vllm_mxplus.checkpoint.ct_format import pow2_global_scale, quantize_nvfp4_ct
from vllm_mxplus.errors import UsageError
from vllm_mxplus.formats import QuantizedTensor, get_format, quantize
from vllm_mxplus.formats.constants import E2M1_MAX, F8E4M3_MAX
from vllm_mxplus.formats.nvfp4 import quantize_nvfp4_given

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
            spec=get_format(scheme),
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


def _ct(src: Path, dst: Path, scheme: str, method: str, smooth: float | None) -> Path:
    quantize_checkpoint(
        src,
        dst,
        scheme,
        out_format="compressed-tensors",
        method=method,
        smooth=smooth,
        nsamples=4,
        seqlen=16,
        progress=False,
    )
    return dst


def _check_shared_pow2_globals(
    mods: dict[str, dict[str, torch.Tensor]], original: dict[str, torch.Tensor] | None
) -> None:
    """NVFP4 global scales: one per fused layer (q/k/v, gate/up), a power of two; with
    `original` (the weights quantized), the smallest that keeps every block scale <= 448."""
    for layer in range(2):
        for group in FUSED:
            parent = "self_attn" if "q_proj" in group else "mlp"
            names = [f"model.layers.{layer}.{parent}.{m}" for m in group]
            gs = {float(mods[n]["weight_global_scale"]) for n in names}
            assert len(gs) == 1, names  # vLLM keeps one per fused layer
            (big_g,) = gs
            m, _ = torch.frexp(torch.tensor(big_g))
            assert float(m) == 0.5  # a power of two: 1/G is exact
            if original is not None:
                amax = max(float(original[f"{n}.weight"].float().abs().max()) for n in names)
                g = 1.0 / big_g
                assert g / 2 < amax / (E2M1_MAX * F8E4M3_MAX) <= g  # the smallest that fits
            ins = {float(mods[n]["input_global_scale"]) for n in names}
            assert len(ins) == 1 and 0 < next(iter(ins)) < float("inf")


@pytest.mark.parametrize(
    ("scheme", "method", "smooth"),
    [
        ("nvfp4", "rtn", 0.5),
        ("nvfp4", "rtn-aware", None),
        ("nvfp4", "gptq", None),
        ("nvfp4", "gptq", 0.5),
        ("mxfp4-ocp", "gptq", None),
        ("mxfp4-ocp", "rtn-aware", 0.5),
    ],
)
def test_calibrated_and_smoothed_checkpoints_decompress_bit_for_bit(
    scheme: str, method: str, smooth: float | None, src: Path, tmp_path: Path, random_tokens: None
) -> None:
    dst = _ct(src, tmp_path / "out", scheme, method, smooth)
    _check_library_decompression(dst, scheme, None)
    mods = _modules(source_tensors(dst))
    original = source_tensors(src)
    if scheme == "nvfp4":
        # the weights quantized are the source's unless smoothed; smoothed: the global scales
        # of RTN on the same smoothed model (whose bf16 weights the checkpoint does not hold)
        _check_shared_pow2_globals(mods, original if smooth is None else None)
        if smooth is not None and method != "rtn":
            rtn = _modules(source_tensors(_ct(src, tmp_path / "rtn", scheme, "rtn", smooth)))
            for module, stored in mods.items():
                g_rtn = rtn[module]["weight_global_scale"]
                assert torch.equal(stored["weight_global_scale"], g_rtn), module
    if method == "rtn":
        return
    # the calibrated weights, not RTN's (nvfp4: RTN under the very global scale stored)
    changed = 0
    for module, stored in mods.items():
        w = original[f"{module}.weight"]
        if scheme == "nvfp4":
            g = (1.0 / stored["weight_global_scale"]).reshape(())
            rtn_codes = quantize_nvfp4_ct(w.float(), g).codes
        else:
            rtn_codes = quantize(w, scheme).codes
        changed += int(not torch.equal(stored["weight_packed"], rtn_codes))
    assert changed >= len(mods) // 2, f"{method}: {len(mods) - changed} weights equal RTN's"


def test_nvfp4_global_scale_is_a_shared_power_of_two(written: dict[str, Path], src: Path) -> None:
    _check_shared_pow2_globals(_modules(source_tensors(written["nvfp4"])), source_tensors(src))


def _weight(n: int, k: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(n, k, generator=g) * 0.05).to(torch.bfloat16).float()


def _correlated_inputs(k: int, tokens: int, seed: int) -> torch.Tensor:
    """Uneven channel energies and correlated channels, like a layer's activations."""
    g = torch.Generator().manual_seed(seed)
    mix = torch.randn(k, k, generator=g) * 0.3 + torch.eye(k)
    scale = torch.rand(k, generator=g) * 3 + 0.1
    return (torch.randn(tokens, k, generator=g) @ mix) * scale


def test_calibrated_nvfp4_under_the_ct_global_scale_no_worse_than_rtn() -> None:
    """Under the stored global scale g: GPTQ's layer-output error <= RTN's, rtn-aware's
    input-weighted error <= RTN's (and below it in sum), both keep g, and with H = I GPTQ with
    the spec's parameter rule is RTN under g bit for bit (ct_format.quantize_nvfp4_ct)."""
    n, k = 48, 256
    w = _weight(n, k, seed=5)
    x = _correlated_inputs(k, tokens=1024, seed=1)
    h = x.T @ x
    d = torch.diagonal(h) / len(x)
    g = pow2_global_scale(w.abs().amax())
    rtn = quantize_nvfp4_ct(w, g)
    q_gptq = gptq(w, h, "nvfp4", macro_block=16, global_scale=g)
    q_aware = rtn_aware(w, d, "nvfp4", macro_block=16, global_scale=g)
    for q in (q_gptq, q_aware):
        assert q.global_scale is not None and torch.equal(q.global_scale, g)

    def out_err(q: QuantizedTensor) -> float:
        return float((x @ w.T - x @ q.dequantize().T).square().sum())

    def weighted_err(q: QuantizedTensor) -> torch.Tensor:
        return ((w - q.dequantize()).square() * d).sum(-1, dtype=torch.float64)

    assert out_err(q_gptq) <= out_err(rtn), (out_err(q_gptq), out_err(rtn))
    e_aware, e_rtn = weighted_err(q_aware), weighted_err(rtn)
    assert bool((e_aware <= e_rtn * (1 + 1e-6)).all()), "rtn-aware lost to RTN on a row"
    assert float(e_aware.sum()) < float(e_rtn.sum()), "rtn-aware gained nothing"
    identity = gptq(w, torch.eye(k), "nvfp4", "spec", macro_block=16, global_scale=g)
    assert torch.equal(identity.codes, rtn.codes) and torch.equal(
        identity.scales.view(torch.uint8), rtn.scales.view(torch.uint8)
    )
    # a fused sibling with 4x the amax sets 4g: the given scale is the one used, and while the
    # block scales stay normal E4M3 it costs nothing (each a quarter, the same values)
    q4 = gptq(w, h, "nvfp4", macro_block=16, global_scale=4 * g)
    assert q4.global_scale is not None and float(q4.global_scale) == 4 * float(g)
    assert torch.equal(q4.scales.float() * 4, q_gptq.scales.float())
    assert torch.equal(q4.codes, q_gptq.codes)
    assert torch.equal(q4.dequantize(), q_gptq.dequantize())


def test_nvfp4_codes_are_the_spec_s_under_that_global_scale(
    written: dict[str, Path], src: Path
) -> None:
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
        get_format(scheme),
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


def test_cli_calibrated_nvfp4(src: Path, tmp_path: Path, random_tokens: None, capsys) -> None:  # noqa: ANN001
    """Once refused: --scheme nvfp4 --format compressed-tensors --method rtn-aware."""
    dst = tmp_path / "o"
    argv = ["--scheme", "nvfp4", "--format", "compressed-tensors", "--method", "rtn-aware"]
    args = cli_args(str(src), str(dst), *argv, "--nsamples", "2", "--seqlen", "8", "--no-progress")
    assert args.func(args) == 0, capsys.readouterr().err
    _check_library_decompression(dst, "nvfp4", source_tensors(src))


def test_k_not_a_whole_group_is_refused(tmp_path: Path) -> None:
    odd = make_llama(tmp_path / "odd", intermediate=100)  # down_proj K = 100
    with pytest.raises(UsageError, match=r"down_proj.*multiple of 32.*--ignore"):
        quantize_checkpoint(
            odd, tmp_path / "o", "mxfp4-ocp", out_format="compressed-tensors", progress=False
        )
