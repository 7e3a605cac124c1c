"""The lightning indexer's operations, each choosing the jnp path or the Pallas kernels in one place:
`indexer_topk` (the keys each query attends to; `indexer_topk_with_scores` with their scores), `indexer_scores`
(the dense warm-up's KL needs them all) and `cache_topk` (new tokens against a decoding cache). The first two
run on each device's own rows: GSPMD would gather the global batch for `top_k`, and cannot partition a Mosaic
kernel at all. Both paths run under
`context_local`: each chip's queries against the keys gathered over `context` (key indices global, the chip's
first query position the kernels' `q_offset`). `cache_topk` is jnp only; under a `context` split of the cache
each chip ranks its own slots and the candidates merge into the one-chip selection."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from glm5_jax.config import ModelConfig
from glm5_jax.config.mesh import CONTEXT_AXIS
from glm5_jax.distributed.context_cache import against_cache
from glm5_jax.distributed.context_local import context_local
from glm5_jax.distributed.context_order import declared_offset
from glm5_jax.ops.platform import uses_kernels
from pallas_kernels import NEG_INF
from pallas_kernels import indexer_scores as indexer_scores_kernel
from pallas_kernels import indexer_topk as indexer_topk_kernel
from pallas_kernels.chunked_topk import index_scores, select_topk_with_scores
from pallas_kernels.query_chunks import map_query_chunks, num_query_chunks
from pallas_kernels.reference import topk_with_scores


def indexer_topk(q: jax.Array, keys: jax.Array, weights: jax.Array, segment_ids: jax.Array, *,
                 config: ModelConfig, mesh=None) -> jax.Array:
    """Causal self-selection within packed segments: int32 [B, S, N] key indices (-1 = unused slot) for indexer
    queries q [B, S, I, J], keys [B, S, J] and fp32 head weights [B, S, I]."""
    return indexer_topk_with_scores(q, keys, weights, segment_ids, config=config, mesh=mesh)[0]


def indexer_topk_with_scores(q: jax.Array, keys: jax.Array, weights: jax.Array, segment_ids: jax.Array, *,
                             config: ModelConfig, mesh=None) -> tuple[jax.Array, jax.Array]:
    """`indexer_topk`'s indices and the fp32 index scores [B, S, N] the selection ranked them by (NEG_INF on
    unused slots), both paths: the sparse KL's forward reads its scores here instead of gathering the keys
    again. The scores are a constant (no gradient): `glm5_jax.model.indexer_kl` differentiates its own."""
    if uses_kernels(config):
        def select(q_offset, q, weights, q_segment_ids, keys, k_segment_ids):
            return indexer_topk_kernel(q, keys, weights, topk=config.index_topk, q_segment_ids=q_segment_ids,
                                       k_segment_ids=k_segment_ids, q_offset=q_offset,
                                       cost_q_offset=declared_offset(q_offset, keys.shape[1], q.shape[1]),
                                       **config.pallas_options)
    else:
        def select(q_offset, q, weights, q_segment_ids, keys, k_segment_ids):
            return select_topk_with_scores(q, keys, weights, q_segment_ids, k_segment_ids, config.index_topk,
                                           q_offset=q_offset, query_chunk=config.index_query_chunk,
                                           key_block=config.index_key_block)
    indices, scores = context_local(select, mesh, (q, weights, segment_ids), (keys, segment_ids), local_rows=True)
    return indices, jax.lax.stop_gradient(jnp.where(indices >= 0, scores, NEG_INF))


def indexer_scores(q: jax.Array, keys: jax.Array, weights: jax.Array, segment_ids: jax.Array, *,
                   config: ModelConfig, mesh=None) -> jax.Array:
    """Masked fp32 index scores [B, S, T] of causal self-attention within packed segments (NEG_INF where
    invisible); differentiable in q, keys and weights."""
    if uses_kernels(config):
        def scores(q_offset, q, weights, q_segment_ids, keys, k_segment_ids):
            return indexer_scores_kernel(q, keys, weights, q_segment_ids=q_segment_ids,
                                         k_segment_ids=k_segment_ids, q_offset=q_offset,
                                         cost_q_offset=declared_offset(q_offset, keys.shape[1], q.shape[1]),
                                         **config.pallas_options)
    else:
        def scores(q_offset, q, weights, q_segment_ids, keys, k_segment_ids):
            return index_scores(q, keys, weights, q_segment_ids, k_segment_ids, q_offset)
    return context_local(scores, mesh, (q, weights, segment_ids), (keys, segment_ids),
                         local_rows=uses_kernels(config))


def cache_topk(q: jax.Array, weights: jax.Array, positions: jax.Array, keys: jax.Array, *, config: ModelConfig,
               mesh=None) -> jax.Array:
    """The top-k cached keys [B, S, N] (N = min(index_topk, T); -1 = unused slot) of new indexer queries
    q [B, S, I, J] with head weights [B, S, I] at absolute `positions` [B, S], among the slots of the cache
    keys [B, T, J] up to each query's position. With `index_query_chunk` a long prefill holds one
    [B, chunk, T] score block at a time. Under a `context` split of the slots, new tokens split like the
    cache rank the gathered keys; whole new tokens (decode) are ranked by each chip over its own slots, and
    the chips' candidates (their own top-k, global indices) merge into the same selection as one chip's."""
    topk = config.index_topk

    def whole(keys, q, weights, positions):
        return map_query_chunks(lambda q_c, w_c, pos_c: _slot_scores_topk(q_c, w_c, pos_c, keys, 0, topk)[0],
                                num_query_chunks(q.shape[1], config.index_query_chunk), q, weights, positions)

    def share(first_slot, keys, q, weights, positions):
        picked, values = _slot_scores_topk(q, weights, positions, keys, first_slot, topk)
        picked = jnp.where(picked >= 0, picked + first_slot, -1)
        # The chips' candidates in slot order: among equal scores `top_k` takes the lowest slot, as one chip does.
        values = jax.lax.all_gather(values, CONTEXT_AXIS, axis=2, tiled=True)
        picked = jax.lax.all_gather(picked, CONTEXT_AXIS, axis=2, tiled=True)
        total_slots = keys.shape[1] * jax.lax.axis_size(CONTEXT_AXIS)
        best, order = jax.lax.top_k(values, min(topk, total_slots))
        return jnp.where(best > NEG_INF / 2, jnp.take_along_axis(picked, order, axis=-1), -1).astype(jnp.int32)

    return against_cache(whole, share, mesh, (keys,), (q, weights, positions))


def _slot_scores_topk(q, weights, positions, keys, first_slot, topk):
    """(top-k slot indices [B, S, min(topk, T)] of keys [B, T, J] holding slots first_slot.., -1 where
    invisible; their scores): slot t is visible to the query at position p iff t <= p."""
    b, s = positions.shape
    num_slots = keys.shape[1]
    # Causality comes from the per-row positions: the scores' own mask (one offset for all rows) sees every key.
    one_segment_q, one_segment_k = jnp.ones((b, s), jnp.int32), jnp.ones((b, num_slots), jnp.int32)
    scores = index_scores(q, keys, weights, one_segment_q, one_segment_k, q_offset=num_slots)
    visible = first_slot + jnp.arange(num_slots)[None, None, :] <= positions[:, :, None]
    return topk_with_scores(jnp.where(visible, scores, NEG_INF), topk)
