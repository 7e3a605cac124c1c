"""The DSA dense warm-up's attention probabilities and indexer-KL target in jnp, written once: the model runs
it without kernels (`glm5_jax.model.attention`, expanded form: the target comes with the output's own
probabilities) and `reference.dense_attention_target_reference` runs it as the dense target kernel's
reference (absorbed form)."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from pallas_kernels._common import NEG_INF


def visible_softmax(logits: jax.Array, allowed: jax.Array) -> jax.Array:
    """Softmax of scaled fp32 `logits` [..., T] over the `allowed` keys (broadcast against them); a query with
    no allowed key (a padding row) gets zeros, not a uniform average."""
    probs = jax.nn.softmax(jnp.where(allowed, logits, NEG_INF), axis=-1)
    return jnp.where(allowed.any(-1, keepdims=True), probs, 0.0)


def head_mean_target(probs: jax.Array) -> jax.Array:
    """The KL target [B, S, T] fp32 from attention probabilities [B, H, S, T]: their mean over heads (each
    head's row sums to 1 over the visible keys, so this is the L1-normalised head sum)."""
    return probs.astype(jnp.float32).mean(axis=1)
