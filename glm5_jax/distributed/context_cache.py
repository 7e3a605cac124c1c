"""A decoding cache split over `context` on its slot dim (context-parallel prefill and decode).

Every cache array is [..., B, T, X] with T split in contiguous shares: chip c holds slots [c T / context,
(c + 1) T / context) of every row, so a token's row lands on the chip that owns its position and no chip holds
the whole cache. New tokens meet the cache in one of two ways, chosen by the activations' own layout (the
"seq" logical axis takes `context` when it divides the new tokens):
- many new tokens (prefill, split over `context` like training's activations): each chip all-gathers the
  layer's cache shares for the moment and runs the one-chip computation on its own queries (queries stay
  local; the gathered keys are one layer's, as in training);
- fewer than `context` or an uneven number (decode): the new tokens are whole on every chip, which works on
  its own share (`fn` gets the share's first slot) and merges with the others over `context` itself.
"""

from __future__ import annotations

import jax
from jax.sharding import NamedSharding, PartitionSpec

from glm5_jax.config.mesh import CONTEXT_AXIS
from glm5_jax.distributed.batch_local import active_mesh, batch_split_axes, context_split


def splits_new_tokens(mesh, num_new: int) -> bool:
    """Whether `num_new` new tokens per row are split over `context` (as their activations are)."""
    split = context_split(mesh)
    return split > 1 and num_new % split == 0


def cache_spec(mesh, rows: int, leading: int = 0) -> PartitionSpec:
    """The split of a cache array [leading dims..., B, T, X]: rows over the batch axes, slots over `context`."""
    return PartitionSpec(*([None] * leading), batch_split_axes(mesh, rows) or None, CONTEXT_AXIS)


def lay_out_cache(cache: jax.Array, mesh) -> jax.Array:
    """A new [L, B, T, X] cache pinned to its split (inside jit: where XLA allocates it)."""
    if context_split(mesh) == 1:
        return cache
    split = NamedSharding(active_mesh(mesh), cache_spec(mesh, cache.shape[1], leading=1))
    return jax.lax.with_sharding_constraint(cache, split)


def write_cache_shares(write, mesh, cache: jax.Array, layer, rows: jax.Array, positions: jax.Array) -> jax.Array:
    """`write(first_slot, share, layer, rows, positions)` on each chip's share [L, B, T / context, X] of `cache`,
    with the new rows [B, S, X] and their positions [B, S] whole on every chip; returns the cache, split again."""
    batch = batch_split_axes(mesh, cache.shape[1]) or None
    share_spec = cache_spec(mesh, cache.shape[1], leading=1)

    def per_chip(share, layer, rows, positions):
        return write(jax.lax.axis_index(CONTEXT_AXIS) * share.shape[2], share, layer, rows, positions)

    return jax.shard_map(per_chip, mesh=active_mesh(mesh), out_specs=share_spec, check_vma=False,
                         in_specs=(share_spec, PartitionSpec(), PartitionSpec(batch), PartitionSpec(batch)),
                         )(cache, layer, rows, positions)


def against_cache(whole, share, mesh, cached: tuple, new: tuple):
    """Per-query work of new tokens against one layer's cache arrays `cached` ([B, T, ...] each). `new` are
    per-query arrays [B, S, ...]; the outputs are per query too. `whole(*cached, *new)` is the one-chip
    computation; `share(first_slot, *cached_shares, *new)` the same on one chip's share of the slots with the
    new tokens whole, merged across `context` inside it (see the module doc for which runs)."""
    if context_split(mesh) == 1:
        return whole(*cached, *new)
    batch = batch_split_axes(mesh, cached[0].shape[0]) or None
    share_spec = PartitionSpec(batch, CONTEXT_AXIS)
    n_cached = len(cached)
    if splits_new_tokens(mesh, new[0].shape[1]):
        new_spec = share_spec

        def per_chip(*args):
            gathered = tuple(jax.lax.all_gather(c, CONTEXT_AXIS, axis=1, tiled=True) for c in args[:n_cached])
            return whole(*gathered, *args[n_cached:])
    else:
        new_spec = PartitionSpec(batch)

        def per_chip(*args):
            return share(jax.lax.axis_index(CONTEXT_AXIS) * args[0].shape[1], *args)

    # check_vma off, as in `batch_local`: the collectives are explicit.
    return jax.shard_map(per_chip, mesh=active_mesh(mesh), in_specs=(share_spec,) * n_cached + (new_spec,) * len(new),
                         out_specs=new_spec, check_vma=False)(*cached, *new)
