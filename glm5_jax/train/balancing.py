"""Aux-loss-free load balancing: the router correction bias moves toward balance after every step,
outside the optimizer: b_i += u * sign(mean(c) - c_i), with c the global token count per expert."""

from __future__ import annotations

import jax.numpy as jnp


def bias_update(bias, counts, rate: float):
    counts = counts.astype(jnp.float32)
    return bias + rate * jnp.sign(counts.mean(-1, keepdims=True) - counts)


def update_correction_biases(params: dict, counts: dict, rate: float) -> dict:
    """counts: {"main": [L_moe, E] or None, "mtp": [E] (optional)}; returns params with new biases."""
    if rate == 0:
        return params
    params = dict(params)
    if counts.get("main") is not None and "moe_layers" in params:
        layers = dict(params["moe_layers"])
        moe = dict(layers["moe"])
        moe["e_score_correction_bias"] = bias_update(moe["e_score_correction_bias"], counts["main"], rate)
        layers["moe"] = moe
        params["moe_layers"] = layers
    if counts.get("mtp") is not None and "mtp" in params:
        mtp = dict(params["mtp"])
        layer = dict(mtp["layer"])
        moe = dict(layer["moe"])
        moe["e_score_correction_bias"] = bias_update(moe["e_score_correction_bias"], counts["mtp"], rate)
        layer["moe"] = moe
        mtp["layer"] = layer
        params["mtp"] = mtp
    return params
