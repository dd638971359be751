"""Tiny random checkpoints for the tests and benchmarks (no hub, built in seconds).

`build_tiny(arch, path)` writes a random HF checkpoint of one architecture (config built with
transformers, saved as transformers saves it) plus a word-level tokenizer with a chat
template; `build_tiny_llama` / `build_tiny_qwen3_moe` / `build_tiny_mixtral` keep the knobs
the older tests use. Pre-quantized checkpoints are made by the real offline quantizer
(`prequantize` = `mxplus quantize`); `tamper_checkpoint` then breaks one on purpose for the
load-error tests.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

CHAT_TEMPLATE = (
    "{% for m in messages %}{{ m['role'] }} : {{ m['content'] }} \n{% endfor %}"
    "{% if add_generation_prompt %}assistant : {% endif %}"
)
WORDS = [
    "the",
    "a",
    "an",
    "of",
    "to",
    "in",
    "and",
    "is",
    "was",
    "for",
    "on",
    "with",
    "as",
    "by",
    "at",
    "from",
    "it",
    "that",
    "this",
    "be",
    "are",
    "or",
    "not",
    "capital",
    "city",
    "france",
    "paris",
    "river",
    "water",
    "mountain",
    "sun",
    "moon",
    "star",
    "sky",
    "blue",
    "green",
    "red",
    "one",
    "two",
    "three",
    "four",
    "five",
    "six",
    "seven",
    "eight",
    "nine",
    "ten",
    "hello",
    "world",
    "model",
    "token",
    "number",
    "user",
    "assistant",
    "system",
    ":",
    ".",
    ",",
    "?",
    "!",
    "who",
    "what",
    "where",
    "when",
    "why",
    "how",
]
POISON = "poison"  # the last vocabulary word of a model built with poison=True
_IDS = {"bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 3}


def build_tokenizer(path: Path, vocab_size: int) -> None:
    """A word-level tokenizer: WORDS first, then w0..wN fillers, the last word is POISON."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    specials = ["<unk>", "<s>", "</s>", "<pad>"]
    words = specials + [w for w in dict.fromkeys(WORDS)]
    words += [f"w{i}" for i in range(vocab_size - len(words) - 1)] + [POISON]
    vocab = {w: i for i, w in enumerate(words[:vocab_size])}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.decoder = decoders.WordPiece(prefix="##")  # joins words with spaces
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        unk_token="<unk>",
        bos_token="<s>",
        eos_token="</s>",
        pad_token="<pad>",
    )
    fast.chat_template = CHAT_TEMPLATE
    fast.save_pretrained(path)


@dataclass(frozen=True)
class Arch:
    """One architecture of the coverage matrix: transformers classes and a tiny config."""

    config_cls: str
    model_cls: str
    config: dict[str, Any]
    what: str  # what the architecture exercises beyond a plain Llama
    moe: bool = False
    extra: dict[str, Any] = field(default_factory=dict)


def _dense(
    hidden: int, inter: int, heads: int, kv: int, head_dim: int | None = None, **kw: Any
) -> dict[str, Any]:
    return dict(
        hidden_size=hidden,
        intermediate_size=inter,
        num_attention_heads=heads,
        num_key_value_heads=kv,
        head_dim=head_dim or hidden // heads,
        **kw,
    )


def _gemma(**extra: Any) -> dict[str, Any]:
    """Gemma-2/3's tiny shape: hidden 320, sliding windows of 16 on every other layer."""
    return _dense(
        320,
        576,
        4,
        2,
        64,
        sliding_window=16,
        query_pre_attn_scalar=64,
        layer_types=["sliding_attention", "full_attention"],
        **extra,
    )


# Hidden sizes 192 / 320 (not multiples of 128: partial macro blocks) among them.
ARCHS: dict[str, Arch] = {
    "llama": Arch("LlamaConfig", "LlamaForCausalLM", _dense(256, 512, 4, 2), "baseline"),
    "mistral": Arch(
        "MistralConfig",
        "MistralForCausalLM",
        _dense(320, 576, 5, 1, 64, sliding_window=None),
        "GQA 5:1, hidden 320",
    ),
    "qwen2": Arch(
        "Qwen2Config", "Qwen2ForCausalLM", _dense(320, 576, 5, 1, 64), "q/k/v bias, hidden 320"
    ),
    "qwen3": Arch("Qwen3Config", "Qwen3ForCausalLM", _dense(256, 512, 4, 2, 64), "q/k norm"),
    "gemma3": Arch(
        "Gemma3TextConfig",
        "Gemma3ForCausalLM",
        _gemma(tie_word_embeddings=True),
        "tied embeddings, GeGLU, sliding window, hidden 320",
    ),
    "gemma2": Arch(
        "Gemma2Config",
        "Gemma2ForCausalLM",
        _gemma(
            # a cap low enough to bend a tiny random model's logits (Gemma-2's own: 30)
            final_logit_softcapping=5.0,
            # vLLM 0.32's CPU attention and transformers differ with attention soft-capping,
            # unquantized (docs/models.md, Gemma-2): off, so the row judges the plugin
            attn_logit_softcapping=None,
            tie_word_embeddings=True,
        ),
        "final logit soft-capping, alternate sliding-window layers, tied embeddings, hidden 320",
    ),
    "phi3": Arch(
        "Phi3Config",
        "Phi3ForCausalLM",
        _dense(320, 576, 5, 5, 64),
        "fused qkv_proj / gate_up_proj in the checkpoint, hidden 320",
    ),
    "olmo2": Arch(
        "Olmo2Config",
        "Olmo2ForCausalLM",
        _dense(256, 512, 4, 4),
        "q/k norm over all heads, post-norms",
    ),
    "granite": Arch(
        "GraniteConfig",
        "GraniteForCausalLM",
        _dense(
            192,
            384,
            3,
            1,
            64,
            embedding_multiplier=2.0,
            residual_multiplier=0.5,
            attention_multiplier=0.1,
            logits_scaling=2.0,
        ),
        "embedding / residual / logit multipliers, hidden 192",
    ),
    "qwen3_moe": Arch(
        "Qwen3MoeConfig",
        "Qwen3MoeForCausalLM",
        _dense(
            128,
            256,
            4,
            2,
            32,
            moe_intermediate_size=128,
            num_experts=8,
            num_experts_per_tok=2,
            norm_topk_prob=True,
            decoder_sparse_step=1,
            mlp_only_layers=[],
        ),
        "MoE 8 experts top-2",
        moe=True,
    ),
    "mixtral": Arch(
        "MixtralConfig",
        "MixtralForCausalLM",
        _dense(128, 128, 4, 2, 32, num_local_experts=4, num_experts_per_tok=2, sliding_window=None),
        "MoE 4 experts top-2",
        moe=True,
    ),
    "deepseek_v2": Arch(
        "DeepseekV2Config",
        "DeepseekV2ForCausalLM",
        # vLLM's CPU MLA kernel needs kv_lora_rank + rope dim = 576
        {
            "hidden_size": 192,
            "intermediate_size": 384,
            "num_attention_heads": 4,
            "num_key_value_heads": 4,
            "q_lora_rank": None,
            "kv_lora_rank": 512,
            "qk_nope_head_dim": 32,
            "qk_rope_head_dim": 64,
            "v_head_dim": 32,
            "moe_intermediate_size": 128,
            "n_routed_experts": 4,
            "n_shared_experts": 1,
            "num_experts_per_tok": 2,
            "first_k_dense_replace": 1,
            "topk_method": "greedy",
            "n_group": 1,
            "topk_group": 1,
            "norm_topk_prob": False,
            "routed_scaling_factor": 1.0,
        },
        "MLA (kv_b_proj read by attention), shared experts, hidden 192",
        moe=True,
    ),
    "gpt_oss": Arch(
        "GptOssConfig",
        "GptOssForCausalLM",
        _dense(
            192,
            128,
            4,
            2,
            64,
            num_local_experts=4,
            num_experts_per_tok=2,  # GptOssConfig's name (experts_per_token is not read)
            sliding_window=16,
            layer_types=["sliding_attention", "full_attention"],
            rope_scaling=None,
        ),
        "MoE 4 experts top-2, expert biases, swigluoai, attention sinks, hidden 192",
        moe=True,
    ),
}


def _resized(
    config: dict[str, Any],
    hidden: int | None,
    intermediate: int | None,
    heads: int | None,
    kv_heads: int | None,
) -> dict[str, Any]:
    """The size fields of a tiny config with the given sizes in place (None keeps the config's);
    head_dim then follows hidden // heads. No size given: no field changes."""
    if hidden is None and intermediate is None and heads is None and kv_heads is None:
        return {}
    return _dense(
        hidden or config["hidden_size"],
        intermediate or config["intermediate_size"],
        heads or config["num_attention_heads"],
        kv_heads or config["num_key_value_heads"],
    )


def _randomize(model: torch.nn.Module, router_std: float, poison: bool) -> None:
    """Random norms and biases (a fresh init zeroes biases and sets norms to one, which
    hides mistakes in where they are applied) and a decisive router."""
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(1.0 + 0.2 * torch.randn_like(p))
            elif name.endswith(("bias", "sinks")):
                p.copy_(0.05 * torch.randn_like(p))
            elif name.endswith(
                ("mlp.gate.weight", "block_sparse_moe.gate.weight", "router.weight")
            ):
                # wide router logits: top-k choices are not decided by rounding noise
                p.copy_(router_std * torch.randn_like(p))
        if poison:
            model.get_input_embeddings().weight[-1] = float("inf")
            model.get_output_embeddings().weight[-1] = 0.0


def build_tiny(
    arch: str,
    path: str | Path,
    *,
    layers: int = 2,
    vocab: int = 256,
    hidden: int | None = None,
    intermediate: int | None = None,
    heads: int | None = None,
    kv_heads: int | None = None,
    dtype: torch.dtype = torch.bfloat16,
    init_std: float = 0.05,
    router_std: float = 0.5,
    seed: int = 0,
    poison: bool = False,
    **overrides: Any,
) -> Path:
    """Write a random checkpoint of ARCHS[arch] (safetensors + tokenizer) to path.

    hidden / intermediate / heads / kv_heads: sizes in place of the architecture's (see
    _resized); overrides: any other config field.
    poison: the last token's embedding row is +inf, so a prompt holding the word POISON
    drives NaN activations through every layer (RMSNorm: inf * rsqrt(inf) = NaN); its lm_head
    row is zero, so greedy decoding never picks it by itself (other logits are mostly > 0).
    """
    import transformers

    a = ARCHS[arch]
    sizes = _resized(a.config, hidden, intermediate, heads, kv_heads)
    kw = {"tie_word_embeddings": False, **a.config, **sizes, **overrides}
    cfg = getattr(transformers, a.config_cls)(
        vocab_size=vocab,
        num_hidden_layers=layers,
        max_position_embeddings=512,
        initializer_range=init_std,
        torch_dtype=dtype,
        **_IDS,
        **kw,
    )
    torch.manual_seed(seed)
    model = getattr(transformers, a.model_cls)(cfg).to(dtype)
    _randomize(model, router_std, poison)
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(path, safe_serialization=True)
    build_tokenizer(path, vocab)
    return path


def build_tiny_llama(path: str | Path, *, vocab: int = 512, **kw: Any) -> Path:
    """A random LlamaForCausalLM: ARCHS["llama"] (hidden 256, intermediate 512, 4 heads, 2 KV
    heads) unless kw says otherwise (see build_tiny for the options)."""
    return build_tiny("llama", path, vocab=vocab, **kw)


def build_tiny_moe(
    arch: str,
    path: str | Path,
    *,
    intermediate: int = 128,
    experts: int = 8,
    top_k: int = 2,
    **kw: Any,
) -> Path:
    """A random MoE model of `arch` ("qwen3_moe" or "mixtral"), every layer MoE, experts of
    width `intermediate`; hidden 128, 4 heads, 2 KV heads as in ARCHS unless kw says otherwise
    (see build_tiny for the options)."""
    if arch == "qwen3_moe":  # its dense MLP width (unused: every layer is MoE) is 2x
        dense, moe = 2 * intermediate, dict(moe_intermediate_size=intermediate, num_experts=experts)
    else:
        dense, moe = intermediate, dict(num_local_experts=experts)
    return build_tiny(arch, path, intermediate=dense, num_experts_per_tok=top_k, **moe, **kw)


def build_tiny_qwen3_moe(
    path: str | Path, *, moe_intermediate: int = 128, experts: int = 8, **kw: Any
) -> Path:
    """A random Qwen3MoeForCausalLM, no shared expert; on disk
    `mlp.experts.{e}.{gate,up,down}_proj.weight` per expert and the router `mlp.gate`."""
    return build_tiny_moe("qwen3_moe", path, intermediate=moe_intermediate, experts=experts, **kw)


def build_tiny_mixtral(path: str | Path, *, experts: int = 4, **kw: Any) -> Path:
    """A random MixtralForCausalLM (`block_sparse_moe.experts.{e}.w1/w2/w3` on disk)."""
    return build_tiny_moe("mixtral", path, experts=experts, **kw)


def prequantize(
    src: str | Path, dst: str | Path, scheme: str, ignore: Iterable[str] = (), **kw: Any
) -> Path:
    """`mxplus quantize SRC DST --scheme SCHEME [options kw]`: the offline quantizer's code."""
    from vllm_mxplus.checkpoint.quantizer import quantize_checkpoint

    quantize_checkpoint(src, dst, scheme, ignore=list(ignore), progress=False, force=True, **kw)
    return Path(dst)


def tamper_checkpoint(
    ckpt: str | Path, *, drop: Iterable[str] = (), reshape: dict[str, list[int]] | None = None
) -> Path:
    """Break a checkpoint on purpose: drop tensors, or replace them by zeros of a new shape
    (tests of the load-time errors)."""
    from safetensors.torch import load_file, save_file

    ckpt, drop, reshape = Path(ckpt), set(drop), dict(reshape or {})
    seen: set[str] = set()
    for f in sorted(ckpt.glob("*.safetensors")):
        t = load_file(f)
        hit = (drop | set(reshape)) & set(t)
        if not hit:
            continue
        seen |= hit
        for name in drop & hit:
            del t[name]
        for name in set(reshape) & hit:
            t[name] = torch.zeros(reshape[name], dtype=t[name].dtype)
        save_file(t, f, metadata={"format": "pt"})
    missing = (drop | set(reshape)) - seen
    if missing:
        raise KeyError(f"{ckpt}: no tensors named {sorted(missing)}")
    idx = ckpt / "model.safetensors.index.json"
    if idx.exists() and drop:
        j = json.loads(idx.read_text())
        for name in drop:
            j["weight_map"].pop(name, None)
        idx.write_text(json.dumps(j))
    return ckpt


def word_ids(text: str) -> list[int]:
    """Token ids of a text of WORDS under build_tokenizer's vocabulary (no BOS), for prompts
    given as ids where a model type's forced tokenizer class cannot encode the vocabulary."""
    vocab = {w: i for i, w in enumerate(dict.fromkeys(WORDS), start=4)}
    return [vocab[w] for w in text.split()]
