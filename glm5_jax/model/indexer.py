"""The DSA lightning indexer: one per "full" layer ("shared" layers reuse the previous top-k). It builds its
queries and keys (`Indexer.__call__`) and selects the top-k keys of each query over the whole sequence
(`topk`) or over a decoding cache (`topk_over_cache`); the scores and the selection themselves are the ops
layer's (`glm5_jax.ops.indexer_select`; the jnp path and its tie-breaking in `pallas_kernels.chunked_topk`)."""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
from flax import nnx

from glm5_jax.config import ModelConfig
from glm5_jax.model.context import LayerContext
from glm5_jax.model.kv_cache import LayerCache, write_rows
from glm5_jax.model.layers import Linear, Scale, apply_rope_half_split, apply_rope_interleaved
from glm5_jax.ops.indexer_select import cache_topk, indexer_topk_with_scores

INDEXER_NORM_EPS = 1e-6


class IndexerInputs(NamedTuple):
    queries: jax.Array   # [B, S, I, J] roped
    weights: jax.Array   # [B, S, I] fp32 head weights, already scaled by I^-0.5
    keys: jax.Array      # [B, T, J] roped, LayerNorm-ed; one key head shared by all indexer heads


def _rope_prefix(x: jax.Array, cos: jax.Array, sin: jax.Array, rotary_dim: int, interleaved: bool) -> jax.Array:
    rope = apply_rope_interleaved if interleaved else apply_rope_half_split
    return jnp.concatenate([rope(x[..., :rotary_dim], cos, sin), x[..., rotary_dim:]], axis=-1)


class Indexer(nnx.Module):
    """The lightning indexer: queries from the attention's query latent, one key head from the hidden state."""

    def __init__(self, config: ModelConfig, rngs: nnx.Rngs, dtype):
        self.config = config  # static: part of the graph definition, not of the state
        std = config.initializer_range
        q, d, i, j = config.q_lora_rank, config.hidden_size, config.index_n_heads, config.index_head_dim
        self.wq_b = Linear((q, i, j), ("q_lora", "index_heads", "index_head_dim"), rngs, std, dtype)
        self.wk = Linear((d, j), ("embed", "index_head_dim"), rngs, std, dtype)
        self.k_norm = Scale(j, dtype, bias=True)
        self.weights_proj = Linear((d, i), ("embed", "index_heads"), rngs, std, dtype)

    def __call__(self, x: jax.Array, q_resid: jax.Array, cos: jax.Array, sin: jax.Array) -> IndexerInputs:
        """Queries, head weights and keys for the input-normed hidden state x [B, S, D] and the attention's
        query latent q_resid [B, S, Q]."""
        config = self.config
        rotary, interleaved = config.qk_rope_head_dim, config.indexer_rope_interleaved
        q = jnp.einsum("BSQ,QIJ->BSIJ", q_resid, self.wq_b.weight(q_resid.dtype))
        q = _rope_prefix(q, cos, sin, rotary, interleaved)
        weights = jnp.einsum("BSD,DI->BSI", x.astype(jnp.float32), self.weights_proj.weight(jnp.float32))
        k = jnp.einsum("BTD,DJ->BTJ", x, self.wk.weight(x.dtype))
        k = self.k_norm.layer_norm(k, INDEXER_NORM_EPS)
        return IndexerInputs(q, weights * config.index_n_heads**-0.5, _rope_prefix(k, cos, sin, rotary, interleaved))

    def topk(self, x: jax.Array, q_resid: jax.Array, ctx: LayerContext, mesh=None) -> tuple[jax.Array, jax.Array]:
        """The top-k keys of each query among the visible ones of the sequence: int32 [B, S, N] (-1 = unused),
        and their fp32 index scores [B, S, N] (NEG_INF on unused slots; a constant, no gradient)."""
        q, weights, keys = self(x, q_resid, ctx.cos, ctx.sin)
        return indexer_topk_with_scores(q, keys, weights, ctx.segment_ids, config=self.config, mesh=mesh)

    def topk_over_cache(self, x: jax.Array, q_resid: jax.Array, ctx: LayerContext, cache: LayerCache,
                        mesh=None) -> tuple[jax.Array, jax.Array]:
        """Write this layer's keys into the cache, score the new queries against every cached key up to their
        position, keep the top-k. Returns (top-k [B, S, N], the new index-key cache). With `index_query_chunk`
        a long prefill holds one [B, chunk, T] score block at a time; under a `context` split of the cache
        the selection is still one chip's (`glm5_jax.ops.indexer_select.cache_topk`)."""
        q, weights, keys = self(x, q_resid, ctx.cos, ctx.sin)
        index_keys = write_rows(cache.kv.index_keys, cache.index_slot, keys, cache.positions, mesh)
        topk = cache_topk(q, weights, cache.positions, index_keys[cache.index_slot], config=self.config, mesh=mesh)
        return topk, index_keys
