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


def visited_rows(rows: int, row_tile: int, groups: int, expected_rows: int | None) -> int:
    """The rows a grouped kernel computes on when its groups fill `expected_rows` of its `rows` (None: all of them).

    The kernels visit only the row tiles that hold a group's rows (megablox's and the Triton kernels' grids stop at
    the groups' last tile; rows past the groups' sum are never touched), and a tile across a boundary between two
    groups once per group: cdiv(expected_rows, row_tile) + groups - 1 tiles at most, capped at the buffer. This is
    the work a kernel declares (what a roofline counts), so a receive buffer's spare capacity costs nothing."""
    if expected_rows is None:
        return rows
    return min(rows, (-(-expected_rows // row_tile) + groups - 1) * row_tile)
