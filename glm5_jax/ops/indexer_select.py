"""The lightning indexer's operations, each choosing the jnp path or the Pallas kernels in one place:
`indexer_topk` (the keys each query attends to) and `indexer_scores` (the dense warm-up's KL needs them all).
Both run on each device's own rows: GSPMD would gather the global batch for `top_k`, and cannot partition a
Mosaic kernel at all. The jnp path runs under `context_local` (each chip's queries against the keys gathered
over `context`, key indices global); the kernels under `batch_local`, on whole sequences only."""

from __future__ import annotations

import jax

from glm5_jax.config import ModelConfig
from glm5_jax.distributed.batch_local import batch_local
from glm5_jax.distributed.context_local import context_local, require_whole_sequences
from glm5_jax.ops.platform import uses_kernels
from pallas_kernels import indexer_scores as indexer_scores_kernel
from pallas_kernels import indexer_topk as indexer_topk_kernel
from pallas_kernels.chunked_topk import index_scores, select_topk


def indexer_topk(q: jax.Array, keys: jax.Array, weights: jax.Array, segment_ids: jax.Array, *,
                 config: ModelConfig, mesh=None) -> jax.Array:
    """Causal self-selection within packed segments: int32 [B, S, N] key indices (-1 = unused slot) for indexer
    queries q [B, S, I, J], keys [B, S, J] and fp32 head weights [B, S, I]."""
    if uses_kernels(config):
        require_whole_sequences(mesh, "the indexer top-k kernel (attention_backend pallas)")

        def kernel(q, keys, weights, segment_ids):
            return indexer_topk_kernel(q, keys, weights, topk=config.index_topk, q_segment_ids=segment_ids,
                                       k_segment_ids=segment_ids, **config.pallas_options)[0]
        return batch_local(kernel, mesh, (q, keys, weights, segment_ids))

    def select(q_offset, q, weights, q_segment_ids, keys, k_segment_ids):
        return select_topk(q, keys, weights, q_segment_ids, k_segment_ids, config.index_topk, q_offset=q_offset,
                           query_chunk=config.index_query_chunk)
    return context_local(select, mesh, (q, weights, segment_ids), (keys, segment_ids), sorts_rows=True)


def indexer_scores(q: jax.Array, keys: jax.Array, weights: jax.Array, segment_ids: jax.Array, *,
                   config: ModelConfig, mesh=None) -> jax.Array:
    """Masked fp32 index scores [B, S, T] of causal self-attention within packed segments (NEG_INF where
    invisible); differentiable in q, keys and weights."""
    if uses_kernels(config):
        require_whole_sequences(mesh, "the indexer score kernel (attention_backend pallas)")

        def kernel(q, keys, weights, segment_ids):
            return indexer_scores_kernel(q, keys, weights, q_segment_ids=segment_ids, k_segment_ids=segment_ids,
                                         **config.pallas_options)
        return batch_local(kernel, mesh, (q, keys, weights, segment_ids))

    def scores(q_offset, q, weights, q_segment_ids, keys, k_segment_ids):
        return index_scores(q, keys, weights, q_segment_ids, k_segment_ids, q_offset)
    return context_local(scores, mesh, (q, weights, segment_ids), (keys, segment_ids))
