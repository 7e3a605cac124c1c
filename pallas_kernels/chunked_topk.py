"""The lightning indexer's top-k in jnp over blocks of queries (the model's path when it runs no kernel): the
reference's scores (`reference.indexer_scores_reference`, at the backend's default matmul precision) and its
top-k rule (`reference.topk_with_scores`), with at most one [B, chunk, T] score block alive at a time.

I[s, t] = sum_i w[s, i] * ReLU(q_I[s, i] . k_I[t] * J^-0.5), in fp32, with invisible keys set to a large
negative value *before* top-k, so a query never ranks a future key or one from another packed segment.

Tie-break rule: `jax.lax.top_k` returns, among equal scores, the lowest key index first. ReLU makes many
scores exactly 0, so which of several tied keys fills the last slot follows that rule (torch.topk on CPU
breaks such ties differently; parity tests use tie-free cases).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax

from pallas_kernels._common import NEG_INF, pad_axis
from pallas_kernels.query_chunks import Band, causal_bands, map_query_chunks, num_query_chunks
from pallas_kernels.reference import indexer_scores_reference, topk_with_scores


def index_scores(q: jax.Array, k: jax.Array, weights: jax.Array, q_segment_ids: jax.Array,
                 k_segment_ids: jax.Array, q_offset: int | jax.Array = 0) -> jax.Array:
    """Masked fp32 index scores [B, S, T] (invisible keys get NEG_INF), at the backend's default precision."""
    return indexer_scores_reference(q, k, weights, q_segment_ids=q_segment_ids, k_segment_ids=k_segment_ids,
                                    q_offset=q_offset, precision=None)


def running_topk(q: jax.Array, k: jax.Array, weights: jax.Array, q_segment_ids: jax.Array,
                 k_segment_ids: jax.Array, topk: int, q_offset: int | jax.Array,
                 key_block: int) -> tuple[jax.Array, jax.Array]:
    """`topk_with_scores` of all T keys, scoring `key_block` keys at a time: each block's scores are merged into
    a running (scores, indices) top-k, so only a [B, S, key_block] score block exists at a time.

    Equal to one top-k over every key, ties included: the running entries come first in each merge and hold
    lower key indices than the block's, so `lax.top_k` (lowest position first among equal scores) still takes
    the lowest key index. Slots still on their initial NEG_INF entries, or on invisible keys, become -1 (their
    scores stay NEG_INF)."""
    b, s = q.shape[:2]
    t = k.shape[1]
    n_blocks = -(-t // key_block)
    keys = pad_axis(k, 1, n_blocks * key_block)  # padding keys sit past every query: invisible
    segments = pad_axis(k_segment_ids, 1, n_blocks * key_block)
    width = min(topk, t)

    def merge(running, block):
        values, indices = running
        start = block * key_block
        scores = index_scores(q, lax.dynamic_slice_in_dim(keys, start, key_block, axis=1), weights, q_segment_ids,
                              lax.dynamic_slice_in_dim(segments, start, key_block, axis=1), q_offset - start)
        block_indices = jnp.broadcast_to(start + jnp.arange(key_block, dtype=jnp.int32), scores.shape)
        values, order = lax.top_k(jnp.concatenate([values, scores], axis=-1), width)
        indices = jnp.take_along_axis(jnp.concatenate([indices, block_indices], axis=-1), order, axis=-1)
        return (values, indices), None

    init = (jnp.full((b, s, width), NEG_INF, jnp.float32), jnp.full((b, s, width), -1, jnp.int32))
    (values, indices), _ = lax.scan(merge, init, jnp.arange(n_blocks))
    return jnp.where(values > NEG_INF / 2, indices, -1), values


def _chunk_topk(q, k, weights, q_segment_ids, k_segment_ids, topk, q_offset, key_block):
    if 0 < key_block < k.shape[1]:
        return running_topk(q, k, weights, q_segment_ids, k_segment_ids, topk, q_offset, key_block)
    return topk_with_scores(index_scores(q, k, weights, q_segment_ids, k_segment_ids, q_offset), topk)


def select_topk(q: jax.Array, k: jax.Array, weights: jax.Array, q_segment_ids: jax.Array,
                k_segment_ids: jax.Array, topk: int, q_offset: int | jax.Array = 0,
                query_chunk: int = 0, key_block: int = 0) -> jax.Array:
    """Top-k key indices per query [B, S, N]: the indices of `select_topk_with_scores`."""
    return select_topk_with_scores(q, k, weights, q_segment_ids, k_segment_ids, topk, q_offset, query_chunk,
                                   key_block)[0]


def select_topk_with_scores(q: jax.Array, k: jax.Array, weights: jax.Array, q_segment_ids: jax.Array,
                            k_segment_ids: jax.Array, topk: int, q_offset: int | jax.Array = 0,
                            query_chunk: int = 0, key_block: int = 0) -> tuple[jax.Array, jax.Array]:
    """(Top-k key indices per query [B, S, N], their fp32 scores; unused slots -1 and NEG_INF). With `query_chunk` > 0 only a [B, chunk, T] score block
    exists at a time (chunks run sequentially under `lax.map`); with a static q_offset each band of blocks scores
    only the keys it can see (`causal_bands`), ~(1 + 1/bands) / 2 of a causal self-selection's [S, T] work. With
    `key_block` > 0 keys are scored in blocks too, merged into a running top-k (`running_topk`)."""
    n_chunks = num_query_chunks(q.shape[1], query_chunk)
    if n_chunks == 1:
        return _chunk_topk(q, k, weights, q_segment_ids, k_segment_ids, topk, q_offset, key_block)
    chunk_len = q.shape[1] // n_chunks
    width = min(topk, k.shape[1])

    def band_topk(band: Band):
        keys, key_segments = k[:, :band.num_keys], k_segment_ids[:, :band.num_keys]
        rows = slice(band.first_query, band.first_query + band.num_queries)

        def chunk(q_c, w_c, seg_c, rows_c):  # rows_c: the block's query indices, so rows_c[0, 0] is its offset
            picked, values = _chunk_topk(q_c, keys, w_c, seg_c, key_segments, topk, q_offset + rows_c[0, 0],
                                         key_block)
            pad = [(0, 0), (0, 0), (0, width - picked.shape[-1])]
            return jnp.pad(picked, pad, constant_values=-1), jnp.pad(values, pad, constant_values=NEG_INF)

        first = band.first_query + jnp.arange(band.num_queries)[None]
        return map_query_chunks(chunk, band.num_queries // chunk_len, q[:, rows], weights[:, rows],
                                q_segment_ids[:, rows], first)

    picked = [band_topk(band) for band in causal_bands(q.shape[1], k.shape[1], q_offset, n_chunks)]
    return tuple(jnp.concatenate(parts, axis=1) for parts in zip(*picked))
