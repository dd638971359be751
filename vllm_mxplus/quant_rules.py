"""What stays unquantized: the one rule every path uses (docs/numerics.md, Formats and schemes).

The offline quantizer (`checkpoint/rules.py`), the vLLM config (`integration/config.py`), the
fake-quant reference (`backends/reference/modules.py`) and the QSNR tool (`analysis/sources.py`) all ask
`unquantized_reason(module)`, so a module kept in one is kept in all. Kept in high precision:
  * lm_head and embeddings: a name component in ALWAYS_UNQUANTIZED or containing "embed"
    (paper §5.1);
  * MoE routers: a module whose last component is in ROUTER_NAMES (`mlp.gate`,
    `block_sparse_moe.gate`, `*.router`, `shared_expert_gate`): tiny, accuracy-critical, and
    the paper leaves them in high precision.
Norms and biases are not Linear weights and never reach this question; modules the user lists
(`--ignore`, `modules_to_not_convert`) are matched by each caller's own pattern syntax.

Imports nothing from the package, so every layer can use it without an import cycle.
"""

from __future__ import annotations

ALWAYS_UNQUANTIZED = ("lm_head", "embed_tokens", "wte", "wpe", "embed_positions")
ROUTER_NAMES = ("gate", "router", "shared_expert_gate")


def unquantized_reason(module: str) -> str | None:
    """Why the module (a dotted name, e.g. `model.layers.0.mlp.gate`) always stays in high
    precision, or None when the scheme quantizes it."""
    parts = module.split(".")
    if any(p in ALWAYS_UNQUANTIZED or "embed" in p for p in parts):
        return "embedding / lm_head"
    if parts[-1] in ROUTER_NAMES:
        return "MoE router"
    return None


def stays_unquantized(module: str) -> bool:
    """True when the module always stays in high precision (see unquantized_reason)."""
    return unquantized_reason(module) is not None
