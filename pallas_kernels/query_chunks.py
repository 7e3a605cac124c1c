"""Running a per-query computation over blocks of queries, one block at a time (`lax.map`), so that tensors
that grow with (queries x keys) or (queries x selected rows) exist for one block only. The indexer's top-k, DSA's
sparse attention, its KL target and the cached prefill all split queries by `index_query_chunk` this way."""

from __future__ import annotations

import jax
from einops import rearrange


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
