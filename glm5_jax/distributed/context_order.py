"""The load-balanced causal order of a sequence split over the `context` mesh axis.

Causal attention makes a query's work grow with its position, so chips holding contiguous shares of a sequence
would do unequal work: the last chip's queries see every key, the first chip's only its own. The sequence is
therefore cut into 2 x context chunks and chip c holds chunks c and 2 x context - 1 - c (one early, one late), so
every chip's queries see the same number of keys in total. This is the order the decoder layers run in;
`to_balanced` / `to_natural` move [B, S, ...] arrays (split over the batch axes and `context`) between it and the
natural order with two collective permutes of half a chip's share each, and are each other's inverse (and
transpose, for the backward). Without a context split both are the identity.

Chunk k of the natural order lives on chip k // 2 (slot k % 2) there and on chip k (slot 0) for k < context,
chip 2 x context - 1 - k (slot 1) otherwise, in the balanced order. Sending every chip's slot s in one permute is
a permutation of the chips (the even chunks, and the odd ones, land on distinct chips), and a receiving chip d
finds chunk d in the permute of its own parity.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec

from glm5_jax.config.mesh import CONTEXT_AXIS
from glm5_jax.distributed.batch_local import active_mesh, batch_split_axes, context_split


def balanced_chip(chunk: int, split: int) -> int:
    """The chip holding natural chunk `chunk` (of 2 x split) in the balanced order."""
    return chunk if chunk < split else 2 * split - 1 - chunk


def balanced_chunks(chip: int, split: int) -> tuple[int, int]:
    """The natural chunks chip `chip` holds in the balanced order: (early, late)."""
    return chip, 2 * split - 1 - chip


def _permutes(split: int) -> list[list[tuple[int, int]]]:
    """Per natural slot s: the (source chip, destination chip) pairs that move chunk 2c + s to its chip."""
    return [[(c, balanced_chip(2 * c + s, split)) for c in range(split)] for s in (0, 1)]


def _reorder(x: jax.Array, split: int, axis: int, *, inverse: bool) -> jax.Array:
    """On one chip's share (2L long on `axis`): natural -> balanced (or back), over CONTEXT_AXIS."""
    odd = jax.lax.axis_index(CONTEXT_AXIS) % 2 == 1
    first, second = jnp.split(x, 2, axis=axis)
    if not inverse:
        moved = [jax.lax.ppermute(part, CONTEXT_AXIS, perm) for part, perm in zip((first, second), _permutes(split))]
        early, late = (jnp.where(odd, moved[1], moved[0]), jnp.where(odd, moved[0], moved[1]))
        return jnp.concatenate([early, late], axis=axis)
    # Back along the same routes: what arrived by permute s leaves by its reverse.
    by_route = (jnp.where(odd, second, first), jnp.where(odd, first, second))
    back = [jax.lax.ppermute(part, CONTEXT_AXIS, [(dst, src) for src, dst in perm])
            for part, perm in zip(by_route, _permutes(split))]
    return jnp.concatenate(back, axis=axis)


def _apply(x: jax.Array, mesh, axis: int, inverse: bool) -> jax.Array:
    split = context_split(mesh)
    if split == 1:
        return x
    if x.shape[axis] % (2 * split):
        raise ValueError(f"mesh.context={split} needs the sequence dim ({x.shape[axis]}) in 2 x {split} equal chunks")
    spec = PartitionSpec(*[None] * (axis - 1), batch_split_axes(mesh, x.shape[axis - 1]) or None, CONTEXT_AXIS)
    return jax.shard_map(lambda part: _reorder(part, split, axis, inverse=inverse), mesh=active_mesh(mesh),
                         in_specs=spec, out_specs=spec, check_vma=False)(x)


def to_balanced(x: jax.Array, mesh, axis: int = 1) -> jax.Array:
    """x with its sequence dim (`axis` >= 1; the dim before it is the batch) in the balanced order."""
    return _apply(x, mesh, axis, inverse=False)


def to_natural(x: jax.Array, mesh, axis: int = 1) -> jax.Array:
    """The inverse of `to_balanced`."""
    return _apply(x, mesh, axis, inverse=True)


def gathered_to_natural(x: jax.Array, split: int) -> jax.Array:
    """Keys all-gathered (tiled, axis 1) over `context` from the balanced order -> the natural order: the gather
    holds chip by chip (chunk c, chunk 2 x split - 1 - c); a reshape and a reversal put the chunks in order."""
    if split == 1:
        return x
    b, s = x.shape[:2]
    chunks = x.reshape(b, split, 2, s // (2 * split), *x.shape[2:])
    natural = jnp.concatenate([chunks[:, :, 0], chunks[:, ::-1, 1]], axis=1)
    return natural.reshape(x.shape)


def declared_offset(q_offset, num_keys: int, chunk_len: int) -> int | None:
    """The static query offset a kernel's declared cost assumes for a call from `context_local`: None without a
    split (q_offset is a Python int, which the kernel counts itself); under one, the mean offset of a chip's two
    chunks, (T - L) / 2, at which a chip's two calls together declare the causal key tiles it visits (the same
    total on every chip, up to block rounding) instead of every tile twice."""
    return None if isinstance(q_offset, int) else (num_keys - chunk_len) // 2


def causal_cost_offset(q_offset, num_keys: int, chunk_len: int) -> int:
    """The static position of a `context_local` call's first query for a kernel whose declared cost counts only
    what a causal self-selection can fill (the sparse MLA kernels): q_offset itself when it is a Python int,
    under a split `declared_offset`'s mean of a chip's two chunks."""
    return q_offset if isinstance(q_offset, int) else declared_offset(q_offset, num_keys, chunk_len)
