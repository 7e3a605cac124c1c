"""Running a per-query computation over blocks of queries, one block at a time (`lax.map`), so that tensors
that grow with (queries x keys) or (queries x selected rows) exist for one block only. The indexer's top-k, DSA's
sparse attention, its KL target and the cached prefill all split queries by `index_query_chunk` this way."""

from __future__ import annotations

import dataclasses

import jax
from einops import rearrange

# Causal key bands: the query chunks are grouped into up to this many bands, each ranking only the keys its last
# query can see (static slices), which skips most of the masked half of a causal selection's [S, T] scores.
MAX_CAUSAL_BANDS = 8


def num_query_chunks(num_queries: int, query_chunk: int) -> int:
    """How many blocks `query_chunk` splits the queries into: 1 (no blocks) for 0, for a chunk that covers every
    query, and for one that does not divide them (experiment configs refuse that case up front)."""
    if query_chunk <= 0 or query_chunk >= num_queries or num_queries % query_chunk:
        return 1
    return num_queries // query_chunk


def split_queries(a: jax.Array, n: int) -> jax.Array:
    """[B, S, ...] -> [n, B, S / n, ...]"""
    return rearrange(a, "B (n c) ... -> n B c ...", n=n)


def merge_queries(a: jax.Array) -> jax.Array:
    """[n, B, c, ...] -> [B, n c, ...]"""
    return rearrange(a, "n B c ... -> B (n c) ...")


def map_query_chunks(fn, n: int, *per_query: jax.Array):
    """fn(*blocks) over n query blocks of [B, S, ...] arrays, the results re-joined along S; n == 1 calls fn once."""
    if n == 1:
        return fn(*per_query)
    blocks = jax.lax.map(lambda args: fn(*args), tuple(split_queries(a, n) for a in per_query))
    return jax.tree.map(merge_queries, blocks)


@dataclasses.dataclass(frozen=True)
class Band:
    """Queries first_query .. first_query + num_queries - 1, which see no key past num_keys - 1."""

    first_query: int
    num_queries: int
    num_keys: int


def causal_bands(num_queries: int, num_keys: int, q_offset, n_chunks: int) -> list[Band]:
    """The `n_chunks` query chunks grouped into whole-chunk bands (the largest divisor of n_chunks up to
    MAX_CAUSAL_BANDS of them). With a static `q_offset` (query s at position q_offset + s) a band's keys end at its
    last query's position: ~(1 + 1/bands) / 2 of the [S, T] scores of a causal self-selection. A traced offset,
    one chunk, or bands that would all see every key give one band over every key."""
    every_key = [Band(0, num_queries, num_keys)]
    if not isinstance(q_offset, int) or n_chunks == 1:
        return every_key
    count = max(b for b in range(1, min(n_chunks, MAX_CAUSAL_BANDS) + 1) if n_chunks % b == 0)
    length = num_queries // count
    bands = [Band(i * length, length, min(num_keys, q_offset + (i + 1) * length)) for i in range(count)]
    return every_key if bands[0].num_keys == num_keys else bands
