"""Which keys a query may see: causal by absolute token index, and never across a packed-segment boundary."""

from __future__ import annotations

import jax
import jax.numpy as jnp


def visible_keys(q_segment_ids: jax.Array, k_segment_ids: jax.Array, q_offset: int | jax.Array = 0) -> jax.Array:
    """Boolean [B, S, T]: key t is visible to query s iff t <= q_offset + s and both share a segment.

    Segment id 0 marks padding; padding queries see only padding keys, so no real token ever attends to it.
    """
    s = q_segment_ids.shape[1]
    t = k_segment_ids.shape[1]
    causal = jnp.arange(t)[None, :] <= (jnp.arange(s)[:, None] + q_offset)
    same_segment = q_segment_ids[:, :, None] == k_segment_ids[:, None, :]
    return causal[None] & same_segment


def selected_mask(indices: jax.Array, num_keys: int) -> jax.Array:
    """Boolean [B, S, T] with True at every valid (>= 0) index of `indices` [B, S, N]."""
    safe = jnp.where(indices < 0, num_keys, indices)  # out of range -> dropped by the scatter
    b, s, _ = indices.shape
    mask = jnp.zeros((b, s, num_keys), dtype=bool)
    return mask.at[jnp.arange(b)[:, None, None], jnp.arange(s)[None, :, None], safe].set(True, mode="drop")
