"""`mxplus qsnr` and the metrics behind it."""

import json

import pytest
import torch

from vllm_mxplus.analysis.metrics import flush_to_zero_rate, gemm_qsnr, oas_takeup
from vllm_mxplus.analysis.report import analyse, markdown
from vllm_mxplus.cli import main
from vllm_mxplus.formats import fake_quantize, qsnr


def test_flush_to_zero_rate():
    x = torch.tensor([0.0, 1.0, 2.0, 3.0])
    assert flush_to_zero_rate(x, torch.tensor([0.0, 0.0, 2.0, 0.0])) == pytest.approx(2 / 3)


def test_oas_takeup_counts_blocks_with_significand_in_15_175():
    x = torch.zeros(4, 16)
    x[0, 0] = 1.6  # (1.5, 1.75]: masking 6/a gives a different scale than OAS
    x[1, 0] = 1.75
    x[2, 0] = 1.4
    x[3, 0] = 1.9
    assert oas_takeup(x) == pytest.approx(0.5)


def test_gemm_qsnr_matches_eq2():
    g = torch.Generator().manual_seed(0)
    x, w = torch.randn(8, 64, generator=g), torch.randn(16, 64, generator=g)
    ref = x.double() @ w.double().T
    exp = qsnr(
        ref, fake_quantize(x, "mxfp4-ocp").double() @ fake_quantize(w, "mxfp4-ocp").double().T
    )
    assert gemm_qsnr(x, w, "mxfp4-ocp") == pytest.approx(exp)


def test_analyse_and_ablation_labels():
    g = torch.Generator().manual_seed(1)
    w = torch.randn(32, 256, generator=g)
    inputs = {"l0": torch.randn(8, 256, generator=g)}
    rep = analyse(
        [("l0.weight", w)], inputs, ["mxfp4-ocp", "mxfp4-mbs-s"], [64, 128], progress=False
    )
    fmts = {r["format"] for r in rep.summary()}
    assert fmts == {"mxfp4-ocp", "mxfp4-mbs-s@64", "mxfp4-mbs-s"}
    kinds = {r["kind"] for r in rep.summary()}
    assert kinds == {"weight", "activation", "output"}
    table = markdown(rep)
    assert "| weight | mxfp4-ocp | 1 |" in table and "OAS take-up" in table


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory):
    transformers = pytest.importorskip("transformers")
    d = tmp_path_factory.mktemp("tiny")
    cfg = transformers.LlamaConfig(
        vocab_size=128,
        hidden_size=64,
        intermediate_size=160,
        num_hidden_layers=1,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
    )
    torch.manual_seed(0)
    transformers.LlamaForCausalLM(cfg).save_pretrained(d)
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {f"w{i}": i for i in range(127)} | {"[UNK]": 127}
    tk = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tk.pre_tokenizer = pre_tokenizers.Whitespace()
    PreTrainedTokenizerFast(tokenizer_object=tk, unk_token="[UNK]").save_pretrained(d)
    text = d / "text.txt"
    text.write_text(" ".join(f"w{i % 127}" for i in range(200)))
    return d, text


def test_cli_on_tiny_model(tiny_model, tmp_path, capsys):
    model, text = tiny_model
    out_json, out_png = tmp_path / "r.json", tmp_path / "r.png"
    rc = main(
        [
            "qsnr",
            str(model),
            "--text",
            str(text),
            "--tokens",
            "32",
            "--no-progress",
            "--formats",
            "mxfp4-ocp",
            "mxfp4-16-oas",
            "nvfp4",
            "--json",
            str(out_json),
            "--plot",
            str(out_png),
        ]
    )
    assert rc == 0
    printed = capsys.readouterr().out
    assert "| activation | mxfp4-ocp |" in printed and "| output | nvfp4 |" in printed
    data = json.loads(out_json.read_text())
    kinds = {r["kind"] for r in data["records"]}
    assert kinds == {"weight", "activation", "output"}
    # 1 layer: q, k, v, o, gate, up, down = 7 linears, 3 formats
    assert sum(r["kind"] == "weight" for r in data["records"]) == 7 * 3
    assert out_png.stat().st_size > 1000 and out_png.read_bytes()[:4] == b"\x89PNG"


def test_cli_errors(tmp_path, capsys):
    assert main(["qsnr", str(tmp_path)]) == 2
    assert "no config.json" in capsys.readouterr().err


def test_cli_bad_format_and_macro(capsys):
    assert main(["qsnr", "--formats", "fp5", "--no-progress"]) == 2
    assert "unknown format 'fp5'" in capsys.readouterr().err
    assert main(["qsnr", "--macro-block", "24", "--no-progress"]) == 2
    assert "--macro-block 24" in capsys.readouterr().err


@pytest.fixture(scope="module")
def outlier_model(tiny_model, tmp_path_factory):
    """The tiny model with one hidden channel 40x the others at the attention input."""
    transformers = pytest.importorskip("transformers")
    src, text = tiny_model
    d = tmp_path_factory.mktemp("outlier")
    model = transformers.AutoModelForCausalLM.from_pretrained(str(src))
    with torch.no_grad():
        model.model.layers[0].input_layernorm.weight[3] = 40.0
    model.save_pretrained(d)
    transformers.AutoTokenizer.from_pretrained(str(src)).save_pretrained(d)
    return d, text


def _qsnr_json(model, text, tmp_path, *extra):
    out = tmp_path / f"r{len(extra)}.json"
    argv = ["qsnr", str(model), "--text", str(text), "--tokens", "32", "--no-progress"]
    assert main([*argv, "--formats", "mxfp4-ocp", "--json", str(out), *extra]) == 0
    data = json.loads(out.read_text())
    return data, {(r["kind"], r["tensor"]): r["qsnr"] for r in data["records"]}


def test_smooth_reports_the_effect_per_tensor(outlier_model, tmp_path, capsys):
    model, text = outlier_model
    _, plain = _qsnr_json(model, text, tmp_path)
    data, smooth = _qsnr_json(model, text, tmp_path, "--smooth", "0.5")
    assert data["meta"]["smooth"] == 0.5 and "smoothed (alpha 0.5)" in data["meta"]["title"]
    q_in = ("activation", "model.layers.0.self_attn.q_proj")
    # the outlier channel is divided into the norm: its block no longer dominates
    assert smooth[q_in] > plain[q_in] + 1.0, (plain[q_in], smooth[q_in])
    q_w = ("weight", "model.layers.0.self_attn.q_proj.weight")
    assert smooth[q_w] != plain[q_w]  # the smoothed weight is the one measured
    assert main(["qsnr", str(model), "--smooth", "0.5", "--weights-only"]) == 2
    assert "--smooth needs a MODEL" in capsys.readouterr().err
    assert main(["qsnr", str(model), "--smooth", "2"]) == 2
    assert "--smooth 2.0" in capsys.readouterr().err
