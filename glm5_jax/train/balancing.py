"""Aux-loss-free load balancing: the router correction bias moves toward balance after every step,
outside the optimizer: b_i += u * sign(mean(c) - c_i), with c the global token count per expert."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from glm5_jax.config import ModelConfig
from glm5_jax.model.metadata import param_info
from glm5_jax.tree_paths import path_names


def bias_update(bias, counts, rate: float):
    counts = counts.astype(jnp.float32)
    return bias + rate * jnp.sign(counts.mean(-1, keepdims=True) - counts)


def update_correction_biases(params: dict, counts: dict, rate: float, *, config: ModelConfig) -> dict:
    """counts: {"main": [L_moe, E] or None, "mtp": [E] (optional)}; returns params (the weights of
    `GLM5(config)`) with every router correction bias (the `RouterBias` weights: the MoE stack's [L_moe, E],
    the MTP layer's [E]) moved."""
    if rate == 0:
        return params

    def update(path, leaf):
        names = path_names(path)
        if not param_info(names, config, leaf.shape).router_bias:
            return leaf
        section_counts = counts.get("mtp" if names[0] == "mtp" else "main")
        return leaf if section_counts is None else bias_update(leaf, section_counts, rate)

    return jax.tree_util.tree_map_with_path(update, params)
