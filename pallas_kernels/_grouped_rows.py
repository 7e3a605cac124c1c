"""Which rows a device's grouped matmul owns: the rows of the groups it holds (rows sorted by group)."""

from __future__ import annotations

import jax
import jax.numpy as jnp


def held_rows_mask(group_sizes: jax.Array, group_offset: jax.Array, held: int, rows: int) -> jax.Array:
    """[rows, 1] 1 for the rows of groups [group_offset, group_offset + held), 0 elsewhere (also past the sum)."""
    bounds = jnp.concatenate([jnp.zeros((1,), jnp.int32), jnp.cumsum(group_sizes, dtype=jnp.int32)])
    start, end = bounds[group_offset], bounds[group_offset + held]
    row = jnp.arange(rows, dtype=jnp.int32)
    return ((row >= start) & (row < end))[:, None]
