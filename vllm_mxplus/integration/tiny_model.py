"""Tiny random Llama checkpoints for tests and benchmarks (no hub, built in seconds).

`build_tiny_llama` writes a bf16 (or other dtype) HF checkpoint with a word-level tokenizer
and a chat template; `write_prequantized` turns any HF Llama-style safetensors checkpoint
into the DESIGN.md §2 layout with `formats.quantize` (a self-contained stand-in for the
offline quantizer, so the integration tests do not depend on it).
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Iterable, Optional

import torch

from vllm_mxplus.checkpoint.layout import (
    ALWAYS_UNQUANTIZED,
    SUFFIX_BM_INDEX,
    SUFFIX_GLOBAL,
    SUFFIX_MBS,
    SUFFIX_PACKED,
    SUFFIX_SCALE,
    make_quantization_config,
)
from vllm_mxplus.formats import get_scheme, quantize

CHAT_TEMPLATE = (
    "{% for m in messages %}{{ m['role'] }} : {{ m['content'] }} \n{% endfor %}"
    "{% if add_generation_prompt %}assistant : {% endif %}"
)
WORDS = (
    "the a an of to in and is was for on with as by at from it that this be are or not "
    "capital city france paris river water mountain sun moon star sky blue green red "
    "one two three four five six seven eight nine ten hello world model token number "
    "user assistant system : . , ? ! who what where when why how"
).split()


POISON = "poison"  # the last vocabulary word of a model built with poison=True


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
        tokenizer_object=tok, unk_token="<unk>", bos_token="<s>", eos_token="</s>",
        pad_token="<pad>")
    fast.chat_template = CHAT_TEMPLATE
    fast.save_pretrained(path)


def build_tiny_llama(
    path: str | Path,
    *,
    hidden: int = 256,
    intermediate: int = 512,
    layers: int = 2,
    heads: int = 4,
    kv_heads: int = 2,
    vocab: int = 512,
    dtype: torch.dtype = torch.bfloat16,
    init_std: float = 0.05,
    seed: int = 0,
    poison: bool = False,
) -> Path:
    """Write a random LlamaForCausalLM checkpoint (safetensors + tokenizer) to path.

    poison: the last token's embedding row is +inf, so a prompt holding the word POISON
    drives NaN activations through every layer (RMSNorm: inf * rsqrt(inf) = NaN); its lm_head
    row is zero, so greedy decoding never picks it by itself (other logits are mostly > 0).
    """
    from transformers import LlamaConfig, LlamaForCausalLM

    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    cfg = LlamaConfig(
        vocab_size=vocab, hidden_size=hidden, intermediate_size=intermediate,
        num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=kv_heads,
        max_position_embeddings=512, tie_word_embeddings=False, initializer_range=init_std,
        bos_token_id=1, eos_token_id=2, pad_token_id=3, torch_dtype=dtype,
    )
    torch.manual_seed(seed)
    model = LlamaForCausalLM(cfg).to(dtype)
    # Random norms make the residual stream less uniform (closer to a trained model).
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(1.0 + 0.2 * torch.randn_like(p))
        if poison:
            model.model.embed_tokens.weight[-1] = float("inf")
            model.lm_head.weight[-1] = 0.0
    model.save_pretrained(path, safe_serialization=True)
    build_tokenizer(path, vocab)
    return path


def _save_random_moe(model, path: Path, vocab: int, dtype: torch.dtype, router_std: float) -> Path:
    """Random norms (as build_tiny_llama) and a decisive router; save model + tokenizer."""
    model = model.to(dtype)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(1.0 + 0.2 * torch.randn_like(p))
            elif name.endswith(("mlp.gate.weight", "block_sparse_moe.gate.weight")):
                # wide router logits: top-k choices are not decided by rounding noise
                p.copy_(router_std * torch.randn_like(p))
    path.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(path, safe_serialization=True)  # per-expert 2-D tensors on disk
    build_tokenizer(path, vocab)
    return path


def build_tiny_qwen3_moe(
    path: str | Path,
    *,
    hidden: int = 128,
    moe_intermediate: int = 128,
    layers: int = 2,
    heads: int = 4,
    kv_heads: int = 2,
    experts: int = 8,
    top_k: int = 2,
    vocab: int = 256,
    dtype: torch.dtype = torch.bfloat16,
    init_std: float = 0.05,
    router_std: float = 0.5,
    seed: int = 0,
) -> Path:
    """Write a random Qwen3MoeForCausalLM checkpoint (every layer MoE, no shared expert).

    Saved as transformers writes it: `mlp.experts.{e}.{gate,up,down}_proj.weight` per expert
    and the router `mlp.gate.weight`.
    """
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    cfg = Qwen3MoeConfig(
        vocab_size=vocab, hidden_size=hidden, intermediate_size=2 * moe_intermediate,
        moe_intermediate_size=moe_intermediate, num_hidden_layers=layers,
        num_attention_heads=heads, num_key_value_heads=kv_heads, head_dim=hidden // heads,
        num_experts=experts, num_experts_per_tok=top_k, norm_topk_prob=True,
        decoder_sparse_step=1, mlp_only_layers=[], max_position_embeddings=512,
        tie_word_embeddings=False, initializer_range=init_std, bos_token_id=1,
        eos_token_id=2, pad_token_id=3, torch_dtype=dtype,
    )
    torch.manual_seed(seed)
    return _save_random_moe(Qwen3MoeForCausalLM(cfg), Path(path), vocab, dtype, router_std)


def build_tiny_mixtral(
    path: str | Path,
    *,
    hidden: int = 128,
    intermediate: int = 128,
    layers: int = 2,
    heads: int = 4,
    kv_heads: int = 2,
    experts: int = 4,
    top_k: int = 2,
    vocab: int = 256,
    dtype: torch.dtype = torch.bfloat16,
    init_std: float = 0.05,
    router_std: float = 0.5,
    seed: int = 0,
) -> Path:
    """Write a random MixtralForCausalLM checkpoint (`block_sparse_moe.experts.{e}.w1/w2/w3`
    on disk, as transformers saves it; router `block_sparse_moe.gate`)."""
    from transformers import MixtralConfig, MixtralForCausalLM

    cfg = MixtralConfig(
        vocab_size=vocab, hidden_size=hidden, intermediate_size=intermediate,
        num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=kv_heads,
        num_local_experts=experts, num_experts_per_tok=top_k, max_position_embeddings=512,
        tie_word_embeddings=False, initializer_range=init_std, bos_token_id=1,
        eos_token_id=2, pad_token_id=3, torch_dtype=dtype, sliding_window=None,
    )
    torch.manual_seed(seed)
    return _save_random_moe(MixtralForCausalLM(cfg), Path(path), vocab, dtype, router_std)


def is_quantized_linear(name: str, skip: Iterable[str] = ()) -> bool:
    """HF weight names of the linears the schemes quantize (paper §5.1)."""
    if not name.endswith(".weight") or "norm" in name:
        return False
    module = name[: -len(".weight")]
    parts = module.split(".")
    skipped = tuple(ALWAYS_UNQUANTIZED) + tuple(skip)
    return "proj" in parts[-1] and not any(
        s in parts or module == s or module.endswith("." + s) for s in skipped)


def _version() -> str:
    from vllm_mxplus import __version__

    return __version__


def write_prequantized(
    src: str | Path,
    dst: str | Path,
    scheme: str,
    *,
    skip: Iterable[str] = (),
    tamper: Optional[dict] = None,
) -> Path:
    """Quantize src's linear weights into the checkpoint layout at dst (one safetensors file).

    tamper: {"drop": [tensor names]} or {"reshape": {tensor name: new shape}} writes a broken
    checkpoint on purpose (tests of the load-time errors).
    """
    from safetensors.torch import load_file, save_file

    src, dst = Path(src), Path(dst)
    dst.mkdir(parents=True, exist_ok=True)
    fmt = get_scheme(scheme).weight_format
    tensors: dict[str, torch.Tensor] = {}
    for f in sorted(src.glob("*.safetensors")):
        for name, t in load_file(f).items():
            if not is_quantized_linear(name, skip):
                tensors[name] = t
                continue
            q = quantize(t, fmt)
            base = name[: -len(".weight")]
            tensors[f"{base}.{SUFFIX_PACKED}"] = q.codes
            tensors[f"{base}.{SUFFIX_SCALE}"] = q.scales
            if q.mbs is not None:
                tensors[f"{base}.{SUFFIX_MBS}"] = q.mbs
            if q.global_scale is not None:
                tensors[f"{base}.{SUFFIX_GLOBAL}"] = q.global_scale.reshape(1).float()
            if q.block_max_index is not None:
                tensors[f"{base}.{SUFFIX_BM_INDEX}"] = q.block_max_index
    for name in (tamper or {}).get("drop", []):
        del tensors[name]
    for name, shape in (tamper or {}).get("reshape", {}).items():
        tensors[name] = torch.zeros(shape, dtype=tensors[name].dtype)
    save_file({k: v.contiguous() for k, v in tensors.items()}, dst / "model.safetensors")
    for f in src.iterdir():
        if f.suffix != ".safetensors" and f.name != "model.safetensors.index.json" and f.is_file():
            shutil.copy(f, dst / f.name)
    cfg = json.loads((src / "config.json").read_text())
    qcfg = make_quantization_config(scheme, ["lm_head", *skip])
    # vLLM 0.32 reads quantization_config["producer"].get("name") (ModelOpt detection) and
    # crashes on a plain string: the producer must be a dict.
    qcfg["producer"] = {"name": "vllm-mxplus", "version": _version()}
    cfg["quantization_config"] = qcfg
    (dst / "config.json").write_text(json.dumps(cfg, indent=2))
    return dst
