"""Parameter counts from shapes alone (`jax.eval_shape`: no weights are allocated)."""

from __future__ import annotations

import math

import jax

from glm5_jax.config import ModelConfig
from glm5_jax.model.transformer import init


def param_shapes(config: ModelConfig) -> dict:
    return jax.eval_shape(lambda: init(config, jax.random.key(0)))


def _size(tree) -> int:
    return sum(math.prod(leaf.shape) for leaf in jax.tree.leaves(tree))


def count_params(config: ModelConfig) -> dict[str, int]:
    """total: every stored tensor (router correction biases and the MTP layer included);
    without_mtp: the main model only; active_per_token: what one token of the main model touches
    (embedding row and LM head counted in full, the shared expert and num_experts_per_tok routed experts)."""
    shapes = param_shapes(config)
    total = _size(shapes)
    mtp = _size(shapes.get("mtp", {}))
    experts = _size(shapes["moe_layers"]["moe"]["experts"]) if "moe_layers" in shapes else 0
    inactive = experts * (config.n_routed_experts - config.num_experts_per_tok) // config.n_routed_experts
    return {
        "total": total,
        "without_mtp": total - mtp,
        "mtp": mtp,
        "routed_experts": experts,
        "active_per_token": total - mtp - inactive,
    }
