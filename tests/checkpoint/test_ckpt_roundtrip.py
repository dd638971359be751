"""quantize -> load -> dequantize equals formats.fake_quantize of the source, bit for bit."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from ckpt_helpers import TOKENIZER_FILES, cli_args, make_custom, make_llama, source_tensors

from vllm_mxplus.checkpoint import load, load_unquantized, open_checkpoint, quantize_checkpoint
from vllm_mxplus.checkpoint.cli_quantize import run
from vllm_mxplus.checkpoint.codec import encode, quantize_weight, stored_layout
from vllm_mxplus.checkpoint.layout import make_quantization_config, weight_suffixes
from vllm_mxplus.formats import FORMATS, MACRO_BLOCK, SCHEMES, fake_quantize, get_format, get_scheme

ALL_SCHEMES = list(SCHEMES)


def assert_bitwise_equal(actual: torch.Tensor, expected: torch.Tensor, what: str) -> None:
    """Equal bits, NaN included; names the first mismatching coordinate."""
    assert actual.shape == expected.shape, f"{what}: shape {actual.shape} != {expected.shape}"
    a = actual.contiguous().view(torch.int32)
    e = expected.contiguous().view(torch.int32)
    bad = (a != e).nonzero()
    assert bad.numel() == 0, (
        f"{what}: {bad.shape[0]} mismatches, first at {tuple(bad[0].tolist())}: "
        f"{actual[tuple(bad[0])].item()} != {expected[tuple(bad[0])].item()}"
    )


def check_round_trip(src: Path, dst: Path, scheme: str) -> None:
    fmt = get_scheme(scheme).weight_format
    source = source_tensors(src)
    quantized = load(dst)
    assert quantized, "nothing was quantized"
    for module, q in quantized.items():
        w = source[f"{module}.weight"] if f"{module}.weight" in source else source[module]
        assert q.fmt == fmt and tuple(q.shape) == tuple(w.shape)
        if fmt == "nvfp4" and w.dim() == 3:  # one global scale per expert (logical weight)
            ref = torch.stack([fake_quantize(e, fmt) for e in w])
        else:
            ref = fake_quantize(w, fmt)
        assert_bitwise_equal(q.dequantize(), ref, f"{scheme} {module}")
    kept = load_unquantized(dst)
    for name, t in kept.items():
        assert t.dtype == source[name].dtype and torch.equal(t, source[name]), name


@pytest.mark.parametrize("scheme", ALL_SCHEMES)
def test_round_trip_llama(llama_dir: Path, tmp_path: Path, scheme: str) -> None:
    dst = tmp_path / "q"
    report = quantize_checkpoint(llama_dir, dst, scheme, progress=False)
    check_round_trip(llama_dir, dst, scheme)
    # 1 layer: q k v o gate up down quantized; embed, lm_head, 2 norms + final norm kept.
    assert (report.n_quantized, report.n_kept) == (7, 5)
    cfg = json.loads((dst / "config.json").read_text())
    assert cfg["quantization_config"] == make_quantization_config(
        scheme, ["lm_head", "model.embed_tokens"]
    )
    assert cfg["hidden_size"] == 64  # the rest of config.json is kept
    for name, text in TOKENIZER_FILES.items():
        assert (dst / name).read_text() == text
    assert (dst / "generation_config.json").is_file()
    assert sorted(p.name for p in dst.glob("*.safetensors")) == ["model.safetensors"]
    fmt = get_scheme(scheme).weight_format
    assert report.weight_format == fmt and report.qsnr_db[fmt] > 10.0
    assert report.bytes_out < report.bytes_in and report.peak_rss > 0


@pytest.mark.parametrize("scheme", ["mxfp4-mbs-s", "mxfp4-mbs", "nvfp4", "mxplus", "mxfp4-ocp"])
def test_round_trip_awkward_k(tmp_path: Path, scheme: str) -> None:
    """K = 576 (4.5 macro blocks), 100, 75 (odd: the packed shape cannot tell 75 from 76),
    16 and 3; rows 1 and 33; specials (0, huge, tiny, NaN, Inf) in the data."""
    torch.manual_seed(1)
    w_odd = torch.randn(33, 75, dtype=torch.bfloat16)
    w_odd[0, :5] = torch.tensor([0.0, 1e30, 1e-30, float("nan"), float("inf")])
    tensors = {
        "layers.0.wide.weight": torch.randn(16, 576, dtype=torch.bfloat16),
        "layers.0.k100.weight": torch.randn(33, 100, dtype=torch.float16),
        "layers.0.odd.weight": w_odd,
        "layers.0.row.weight": torch.randn(1, 16, dtype=torch.float32),
        "layers.0.tiny.weight": torch.randn(4, 3, dtype=torch.bfloat16) * 1e-3,
        "layers.0.zero.weight": torch.zeros(2, 32, dtype=torch.bfloat16),
    }
    src = make_custom(tmp_path / "src", tensors)
    dst = tmp_path / "q"
    quantize_checkpoint(src, dst, scheme, progress=False)
    check_round_trip(src, dst, scheme)
    ck = open_checkpoint(dst)
    assert ck.modules["layers.0.odd"].shape == (33, 75)
    assert ck.original_dtype("layers.0.k100") == torch.float16


def test_tied_embeddings(tmp_path: Path) -> None:
    src = make_llama(tmp_path / "tied", tie=True)
    assert "lm_head.weight" not in source_tensors(src)
    dst = tmp_path / "q"
    quantize_checkpoint(src, dst, "mxfp4-mbs-s", progress=False)
    out = load_unquantized(dst)
    assert "lm_head.weight" not in out and "model.embed_tokens.weight" in out
    cfg = json.loads((dst / "config.json").read_text())
    assert cfg["tie_word_embeddings"] is True
    assert cfg["quantization_config"]["modules_to_not_convert"] == ["lm_head", "model.embed_tokens"]


def test_untied_lm_head_kept_bit_exact(llama_dir: Path, tmp_path: Path) -> None:
    dst = tmp_path / "q"
    quantize_checkpoint(llama_dir, dst, "mxfp4-16-oas", progress=False)
    src = source_tensors(llama_dir)
    out = load_unquantized(dst)
    assert torch.equal(out["lm_head.weight"], src["lm_head.weight"])
    assert out["lm_head.weight"].dtype == torch.bfloat16


def test_ignore_patterns(llama_dir: Path, tmp_path: Path) -> None:
    dst = tmp_path / "q"
    report = quantize_checkpoint(
        llama_dir,
        dst,
        "mxfp4-mbs-s",
        ignore=["down_proj", r"re:layers\.0\.self_attn\.[kv]_proj", "no_such_module*"],
        progress=False,
    )
    q = load(dst)
    kept = load_unquantized(dst)
    for m in (
        "model.layers.0.mlp.down_proj",
        "model.layers.0.self_attn.k_proj",
        "model.layers.0.self_attn.v_proj",
    ):
        assert m not in q and f"{m}.weight" in kept
    assert "model.layers.0.self_attn.q_proj" in q and "model.layers.0.mlp.up_proj" in q
    cfg = json.loads((dst / "config.json").read_text())["quantization_config"]
    assert cfg["modules_to_not_convert"] == [
        "lm_head",
        "model.embed_tokens",
        "model.layers.0.mlp.down_proj",
        "model.layers.0.self_attn.k_proj",
        "model.layers.0.self_attn.v_proj",
    ]
    assert report.unused_ignore == ["no_such_module*"]
    assert "matched nothing: no_such_module*" in report.summary()


def test_cli_summary(llama_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    rc = run(
        cli_args(
            str(llama_dir),
            str(tmp_path / "q"),
            "--scheme",
            "mxfp4-mbs-s",
            "--no-progress",
            "--device",
            "cpu",
        )
    )
    out = capsys.readouterr().out
    assert rc == 0
    assert "7 quantized, 5 kept" in out and "mean weight QSNR mxfp4-mbs-s" in out
    assert "peak RSS" in out and "MiB" in out


def test_split_fused_group_warns(
    llama_dir: Path, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """vLLM fuses q/k/v (and gate/up) into one layer: ignoring only q_proj gets a warning."""
    quantize_checkpoint(llama_dir, tmp_path / "q", "mxfp4-ocp", ignore=["q_proj"], progress=False)
    assert "self_attn.{q_proj,k_proj,v_proj}: some quantized, some kept" in caplog.text


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("scheme", ["mxfp4-mbs", "nvfp4", "mxplus"])
def test_cuda_quantizes_like_cpu(llama_dir: Path, tmp_path: Path, scheme: str) -> None:
    """--device cuda writes the same bytes as the CPU reference (formats/ is device-agnostic)."""
    quantize_checkpoint(llama_dir, tmp_path / "cpu", scheme, device="cpu", progress=False)
    quantize_checkpoint(llama_dir, tmp_path / "gpu", scheme, device="cuda", progress=False)
    assert (tmp_path / "cpu" / "model.safetensors").read_bytes() == (
        tmp_path / "gpu" / "model.safetensors"
    ).read_bytes()


LAYOUT_SHAPES = [(24, 75), (40, 576), (3, 16, 100)]


@pytest.mark.parametrize("shape", LAYOUT_SHAPES, ids=["K75", "K576", "experts-K100"])
@pytest.mark.parametrize("fmt", list(FORMATS))
def test_stored_layout_matches_encoded_tensors(fmt: str, shape: tuple[int, ...]) -> None:
    """The one layout table (layout.stored_tensors) describes exactly what the writer stores,
    with the sizes of docs/numerics.md ("Packing and checkpoint layout") derived by hand here."""
    w = torch.randn(shape)
    q = quantize_weight(w, fmt, macro_block=MACRO_BLOCK)[0]
    stored = encode(q)
    layout = stored_layout(fmt, shape, MACRO_BLOCK)
    assert list(stored) == list(layout) == list(weight_suffixes(fmt))
    st_to_torch = {"U8": torch.uint8, "F8_E4M3": torch.float8_e4m3fn, "F32": torch.float32}
    *lead, k = shape
    block = get_format(fmt).block_size
    by_hand = {
        "weight_packed": (*lead, -(-k // 2)),
        "weight_scale": (*lead, -(-k // block)),
        "weight_mbs": (*lead, -(-k // 128)),
        "weight_bm_index": (*lead, -(-k // 32)),
        "weight_global_scale": (*shape[:-2], 1),
    }
    for suffix, (st_dtype, st_shape) in layout.items():
        assert stored[suffix].dtype == st_to_torch[st_dtype], suffix
        assert tuple(stored[suffix].shape) == st_shape == by_hand[suffix], suffix


def test_producer_version_comes_from_package_metadata() -> None:
    import importlib.metadata

    cfg = make_quantization_config("mxfp4-mbs", [])
    assert cfg["producer"] == {
        "name": "vllm-mxplus",
        "version": importlib.metadata.version("vllm-mxplus"),
    }


def test_vllm_parameters_use_the_layout_table() -> None:
    pytest.importorskip("vllm", reason="vLLM not installed")
    from vllm_mxplus.checkpoint import layout
    from vllm_mxplus.integration import params

    assert params.stored_tensors is layout.stored_tensors  # the parameters read the one table
    for fmt in FORMATS:
        specs = layout.stored_tensors(fmt, MACRO_BLOCK)
        assert [t.suffix for t in specs] == list(weight_suffixes(fmt))
        assert all(
            t.dtype
            == {"U8": torch.uint8, "F8_E4M3": torch.float8_e4m3fn, "F32": torch.float32}[t.st_dtype]
            for t in specs
        )
