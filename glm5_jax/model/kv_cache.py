"""The decoding cache as the decoder layer reads and writes it: only what MLA + DSA need to attend to earlier
tokens (`glm5_jax.generation.cache` allocates it).

Per layer and token it holds the 576-wide absorbed-form row [c ; k_rope] (`MLA.project`'s `rows`),
and per "full" indexer layer the indexer key k_I [J] (IndexShare "shared" layers run no indexer and store
nothing). Slot t of a row holds the token at absolute position t: prompts are right-padded, every row keeps
its own length, and a row's slots past its length are either garbage from padding or stale drafted tokens;
no query ever sees them (key t is visible to a query at position p iff t <= p), and the next write to that
position replaces them. Rolling back rejected speculative tokens is therefore just not advancing the length.
Under a `context` split the slots are split in contiguous shares (`glm5_jax.distributed.context_cache`), and
each chip writes the new rows whose positions fall in its share.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp

from glm5_jax.distributed.batch_local import context_split
from glm5_jax.distributed.context_cache import write_cache_shares


class KVCache(NamedTuple):
    latent: jax.Array      # [L, B, T, C+R] absorbed-form rows of every layer
    index_keys: jax.Array  # [Lf, B, T, J] lightning-indexer keys of every "full" indexer layer


class LayerCache(NamedTuple):
    """What one decoder layer needs to run over new tokens against the cache."""

    kv: KVCache
    layer: jax.Array | int       # this layer's row of kv.latent
    index_slot: jax.Array | int  # the row of kv.index_keys its indexer writes (or a shared layer's source)
    positions: jax.Array         # [B, S] absolute positions of the new tokens = the slots they write


def write_rows(cache: jax.Array, layer: jax.Array | int, rows: jax.Array, positions: jax.Array,
               mesh=None) -> jax.Array:
    """cache[layer, b, positions[b, s]] = rows[b, s] for a [L, B, T, X] cache; positions past T are dropped.
    Under a `context` split each chip writes the rows its share of the slots owns."""
    if context_split(mesh) == 1:
        return _write(cache, layer, rows, positions)

    def write_share(first_slot, share, layer, rows, positions):
        slots = positions - first_slot
        owned = (slots >= 0) & (slots < share.shape[2])
        return _write(share, layer, rows, jnp.where(owned, slots, share.shape[2]))  # not owned: out of range

    return write_cache_shares(write_share, mesh, cache, layer, rows, positions)


def _write(cache: jax.Array, layer: jax.Array | int, rows: jax.Array, slots: jax.Array) -> jax.Array:
    batch_index = jnp.arange(rows.shape[0])[:, None]
    return cache.at[layer, batch_index, slots].set(rows.astype(cache.dtype), mode="drop")
