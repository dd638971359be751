"""A float64 DeepSeek-V2 (MLA) reference in vLLM's formulation, quantized where the plugin is.

Why not transformers: vLLM 0.32 and transformers 5 already differ on DeepSeek-V2 without any
quantization (docs/models.md), so the transformers fake-quant reference (hf_reference.py)
cannot judge the plugin on MLA. This module computes the model from its checkpoint alone,
in float64, the way vLLM computes it:

  q      = Q(x) @ q_proj^T                         (or q_a_proj -> q_a_layernorm -> q_b_proj)
  c | kr = Q(x) @ kv_a_proj_with_mqa^T              latent [kv_lora_rank] | shared rope key
  c      = kv_a_layernorm(c)
  k_nope | v = c @ W_hat(kv_b_proj)^T              weight-only: the input c is not quantized
  q_pe, kr rotated GPT-J style (pairs 2i, 2i+1: vLLM's is_neox_style=False)
  o      = softmax(q . [k_nope | kr] * qk_head_dim^-0.5, causal) v
  out    = Q(o) @ o_proj^T

vLLM's prefill computes exactly this; its decode absorbs W_hat into the query and the output
(q_nope @ W_UK, then @ W_UV), which is the same product reassociated, because nothing is
quantized between c and W_hat (integration/mla.py). So one causal forward over the whole
sequence gives the reference's logits for prefill and for every decode step.

Q is the scheme's activation fake-quant and W_hat the scheme's dequantized weight, both from
`vllm_mxplus.formats` (the specification) on fp32 tensors (the dtype the tests serve in):
  * W4A4: q_proj / q_a_proj / q_b_proj, kv_a_proj_with_mqa, o_proj, the dense MLP and the
    shared experts (gate, up: Q(x); down: Q(silu(gate) * up));
  * routed experts: each expert's gate, up and down weight apart, activations per token
    before each expert GEMM (the top-k of a softmax router);
  * weight only: kv_b_proj;
  * unquantized: embeddings, lm_head, the router, norms (vllm_mxplus.quant_rules).
Every other operation is float64, so this reference and vLLM differ by vLLM's fp32 rounding
alone, plus the rare activation that this rounding moves across a 4-bit boundary.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

from vllm_mxplus.formats import MACRO_BLOCK, Scheme, fake_quantize, get_scheme
from vllm_mxplus.integration.mla import WEIGHT_READ_BY_ATTENTION
from vllm_mxplus.quant_rules import stays_unquantized

F64 = torch.float64
QUANT_DTYPE = torch.float32  # activations and weights are quantized from fp32 values (vLLM's)


@dataclass(frozen=True)
class MlaConfig:
    """The fields of a DeepseekV2 config.json this reference reads."""

    layers: int
    hidden: int
    heads: int
    q_lora_rank: int | None
    kv_lora_rank: int
    qk_nope: int
    qk_rope: int
    v_head: int
    eps: float
    rope_theta: float
    first_dense: int
    moe_freq: int
    n_experts: int | None
    top_k: int
    norm_topk: bool
    routed_scale: float

    @classmethod
    def read(cls, model_dir: str | Path) -> MlaConfig:
        c = json.loads((Path(model_dir) / "config.json").read_text())
        rope = c.get("rope_parameters") or c.get("rope_scaling") or {}
        rope_type = rope.get("rope_type", rope.get("type", "default"))
        unsupported = {
            "rope_type": (rope_type, "default"),
            "hidden_act": (c.get("hidden_act", "silu"), "silu"),
            "scoring_func": (c.get("scoring_func", "softmax"), "softmax"),
            "topk_method": (c.get("topk_method", "greedy"), "greedy"),
            "attention_bias": (c.get("attention_bias", False), False),
            "mlp_bias": (c.get("mlp_bias", False), False),
        }
        for key, (got, want) in unsupported.items():
            if got != want:
                raise NotImplementedError(
                    f"{model_dir}/config.json: {key}={got!r}; the MLA reference implements "
                    f"{key}={want!r} only (tests/integration/mla_reference.py)"
                )
        return cls(
            layers=c["num_hidden_layers"],
            hidden=c["hidden_size"],
            heads=c["num_attention_heads"],
            q_lora_rank=c.get("q_lora_rank"),
            kv_lora_rank=c["kv_lora_rank"],
            qk_nope=c["qk_nope_head_dim"],
            qk_rope=c["qk_rope_head_dim"],
            v_head=c["v_head_dim"],
            eps=c["rms_norm_eps"],
            rope_theta=rope.get("rope_theta", c.get("rope_theta", 10000.0)),
            first_dense=c.get("first_k_dense_replace", 0),
            moe_freq=c.get("moe_layer_freq", 1),
            n_experts=c.get("n_routed_experts"),
            top_k=c.get("num_experts_per_tok", 0),
            norm_topk=c.get("norm_topk_prob", False),
            routed_scale=c.get("routed_scaling_factor", 1.0),
        )

    def is_moe(self, layer: int) -> bool:
        return bool(self.n_experts) and layer >= self.first_dense and layer % self.moe_freq == 0


def load_tensors(model_dir: str | Path) -> dict[str, torch.Tensor]:
    """Every tensor of the checkpoint's safetensors files, as stored (bf16 for the tiny ones)."""
    from safetensors.torch import load_file

    files = sorted(Path(model_dir).glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"{model_dir}: no *.safetensors files (a DeepSeek-V2 checkpoint)")
    out: dict[str, torch.Tensor] = {}
    for f in files:
        out.update(load_file(f))
    return out


class MlaReference:
    """The float64 model: `logits(ids)` -> [len(ids), vocab] float64 (one causal forward)."""

    def __init__(
        self,
        model_dir: str | Path,
        scheme: str | Scheme | None,
        macro_block: int = MACRO_BLOCK,
        weight_only: tuple[str, ...] = WEIGHT_READ_BY_ATTENTION,
    ):
        """weight_only: last name components of the linears whose input is not quantized
        (the plugin's rule, integration/mla.py); the tests pass others to model a wrong rule."""
        self.cfg = MlaConfig.read(model_dir)
        self.scheme = None if scheme is None else get_scheme(scheme, macro_block)
        self.weight_only = weight_only
        self.t = load_tensors(model_dir)
        self._w: dict[str, torch.Tensor] = {}

    # -- the plugin's quantization points ------------------------------------------------
    def weight(self, name: str) -> torch.Tensor:
        """The weight the plugin computes with, float64: W_hat for a quantized linear (its
        values are fp32-exact), the checkpoint's value otherwise."""
        if name not in self._w:
            w = self.t[f"{name}.weight"].to(QUANT_DTYPE)
            if self.scheme is not None and not stays_unquantized(name):
                w = fake_quantize(w, self.scheme.weight_format, macro_block=self.scheme.macro_block)
            self._w[name] = w.to(F64)
        return self._w[name]

    def act(self, x: torch.Tensor) -> torch.Tensor:
        """Q(x): the scheme's activation fake-quant of x's fp32 value, per row (token)."""
        if self.scheme is None:
            return x
        s = self.scheme
        q = fake_quantize(
            x.to(QUANT_DTYPE),
            s.activation_format,
            macro_block=s.macro_block,
            per_row=s.activations_per_row,
        )
        return q.to(F64)

    def linear(self, x: torch.Tensor, name: str) -> torch.Tensor:
        """x @ W^T as the plugin computes this linear: W4A4, weight-only (attention reads the
        weight) or unquantized (quant_rules)."""
        weight_only = name.rsplit(".", 1)[-1] in self.weight_only
        xq = x if weight_only or stays_unquantized(name) else self.act(x)
        return xq @ self.weight(name).T

    # -- the model --------------------------------------------------------------------------
    def norm(self, x: torch.Tensor, name: str) -> torch.Tensor:
        w = self.t[f"{name}.weight"].to(F64)
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.cfg.eps) * w

    def rope(self, x: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
        """GPT-J style rotation of x [S, ..., d] (pairs 2i, 2i+1), theta^(-2i/d)."""
        d = x.shape[-1]
        inv = self.cfg.rope_theta ** (-torch.arange(0, d, 2, dtype=F64) / d)
        ang = pos.to(F64)[:, None] * inv[None, :]
        shape = (ang.shape[0],) + (1,) * (x.dim() - 2) + (d // 2,)
        cos, sin = ang.cos().reshape(shape), ang.sin().reshape(shape)
        x1, x2 = x[..., 0::2], x[..., 1::2]
        return torch.stack((x1 * cos - x2 * sin, x2 * cos + x1 * sin), -1).flatten(-2)

    def attention(self, x: torch.Tensor, p: str) -> torch.Tensor:
        c, s = self.cfg, x.shape[0]
        if c.q_lora_rank is None:
            q = self.linear(x, f"{p}.q_proj")
        else:
            q_c = self.norm(self.linear(x, f"{p}.q_a_proj"), f"{p}.q_a_layernorm")
            q = self.linear(q_c, f"{p}.q_b_proj")
        q = q.view(s, c.heads, c.qk_nope + c.qk_rope)
        latent, k_pe = self.linear(x, f"{p}.kv_a_proj_with_mqa").split(
            [c.kv_lora_rank, c.qk_rope], -1
        )
        latent = self.norm(latent, f"{p}.kv_a_layernorm")
        pos = torch.arange(s)
        q = torch.cat([q[..., : c.qk_nope], self.rope(q[..., c.qk_nope :], pos)], -1)
        k_pe = self.rope(k_pe, pos)
        kv = self.linear(latent, f"{p}.kv_b_proj").view(s, c.heads, c.qk_nope + c.v_head)
        k_nope, v = kv.split([c.qk_nope, c.v_head], -1)
        k = torch.cat([k_nope, k_pe[:, None, :].expand(s, c.heads, c.qk_rope)], -1)
        scores = torch.einsum("qhd,khd->hqk", q, k) * (c.qk_nope + c.qk_rope) ** -0.5
        causal = torch.ones(s, s, dtype=torch.bool).triu(1)
        probs = scores.masked_fill(causal, float("-inf")).softmax(-1)
        o = torch.einsum("hqk,khd->qhd", probs, v).reshape(s, c.heads * c.v_head)
        return self.linear(o, f"{p}.o_proj")

    def mlp(self, x: torch.Tensor, p: str) -> torch.Tensor:
        h = F.silu(self.linear(x, f"{p}.gate_proj")) * self.linear(x, f"{p}.up_proj")
        return self.linear(h, f"{p}.down_proj")

    def moe(self, x: torch.Tensor, p: str) -> torch.Tensor:
        c = self.cfg
        scores = (x @ self.weight(f"{p}.gate").T).softmax(-1)  # the router: unquantized
        w, ids = scores.topk(c.top_k, -1)
        if c.norm_topk:
            w = w / w.sum(-1, keepdim=True)
        w = w * c.routed_scale
        out = torch.zeros_like(x)
        for e in torch.unique(ids).tolist():
            # activations are quantized per row (token): an expert's rows together equal
            # each token apart
            tok, slot = torch.nonzero(ids == e, as_tuple=True)
            y = self.mlp(x[tok], f"{p}.experts.{e}")
            out.index_add_(0, tok, y * w[tok, slot, None])
        if f"{p}.shared_experts.gate_proj.weight" in self.t:
            out = out + self.mlp(x, f"{p}.shared_experts")
        return out

    @torch.no_grad()
    def logits(self, ids: list[int]) -> torch.Tensor:
        h = self.t["model.embed_tokens.weight"].to(F64)[torch.tensor(ids)]
        for i in range(self.cfg.layers):
            p = f"model.layers.{i}"
            h = h + self.attention(self.norm(h, f"{p}.input_layernorm"), f"{p}.self_attn")
            x = self.norm(h, f"{p}.post_attention_layernorm")
            h = h + (self.moe(x, f"{p}.mlp") if self.cfg.is_moe(i) else self.mlp(x, f"{p}.mlp"))
        head = "lm_head" if "lm_head.weight" in self.t else "model.embed_tokens"
        return self.norm(h, "model.norm") @ self.weight(head).T


def mla_greedy(
    model_dir: str | Path,
    scheme: str | None,
    prompts: list[list[int]],
    max_tokens: int,
    macro_block: int = MACRO_BLOCK,
    weight_only: tuple[str, ...] = WEIGHT_READ_BY_ATTENTION,
) -> tuple[list[list[int]], list[list[float]]]:
    """Greedy continuation of each prompt (token ids, no BOS added) and the chosen tokens'
    logprobs, by the float64 reference; the same shape of result as hf_reference.hf_greedy."""
    ref = MlaReference(model_dir, scheme, macro_block, weight_only)
    tokens, logprobs = [], []
    for prompt in prompts:
        seq, lps = list(prompt), []
        for _ in range(max_tokens):
            lp = ref.logits(seq)[-1].log_softmax(-1)
            t = int(lp.argmax())
            seq.append(t)
            lps.append(float(lp[t]))
        tokens.append(seq[len(prompt) :])
        logprobs.append(lps)
    return tokens, logprobs
