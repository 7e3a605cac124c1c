"""One pre-norm decoder layer: h = x + MLA_DSA(norm(x)); y = h + FFN(norm(h)), FFN dense SwiGLU or MoE. It serves
training (the whole sequence), prefill and decode (new tokens against a cache) alike."""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
from flax import nnx
from jax.ad_checkpoint import checkpoint_name

from glm5_jax.config import ModelConfig
from glm5_jax.distributed.batch_local import batch_local
from glm5_jax.model import attention, indexer
from glm5_jax.model.indexer_kl import attend_with_indexer_kl
from glm5_jax.model.kv_cache import KVCache, LayerCache, visible_slots, write_rows
from glm5_jax.model.layers import Scale, SwiGLU, rms_norm, swiglu
from glm5_jax.model.moe import MoE, moe_block
from glm5_jax.model.query_chunks import map_query_chunks, num_query_chunks
from glm5_jax.model.sparse_latent import sparse_latent_attention
from glm5_jax.model.variables import ParamModule
from pallas_kernels import NEG_INF, indexer_topk, sparse_mla_attention


class LayerContext(NamedTuple):
    """Per-sequence inputs every layer shares."""

    cos: jax.Array           # [B, S, R/2] rotary angles of the queries (= keys in training)
    sin: jax.Array
    segment_ids: jax.Array   # [B, S] int32, 0 = padding
    token_mask: jax.Array    # [B, S] bool, real tokens


class DecoderLayer(ParamModule):
    """One decoder layer's weights: norms, MLA, and a dense SwiGLU (`moe=False`) or the MoE; the MTP layer
    also owns its indexer (`with_indexer=True`), the main stacks share a separate stack of indexers."""

    def __init__(self, config: ModelConfig, rngs: nnx.Rngs, dtype, *, moe: bool, with_indexer: bool = False):
        d, std = config.hidden_size, config.initializer_range
        self.input_norm = Scale(d, dtype)
        self.post_attn_norm = Scale(d, dtype)
        self.attn = attention.MLA(config, rngs, dtype)
        if moe:
            self.moe = MoE(config, rngs, dtype)
        else:
            self.mlp = SwiGLU(d, config.intermediate_size, rngs, std, dtype)
        if with_indexer:
            self.indexer = indexer.Indexer(config, rngs, dtype)

    def __call__(self, indexer_params, x: jax.Array, ctx: LayerContext, prev_topk: jax.Array | None,
                 config: ModelConfig, **options) -> LayerOutput:
        return decoder_layer(self, indexer_params, x, ctx, prev_topk, config, **options)


def compute_topk(indexer_params: dict, h: jax.Array, q_resid: jax.Array, ctx: LayerContext,
                 config: ModelConfig, mesh=None) -> jax.Array:
    """Run the lightning indexer of one layer; returns int32 [B, S, N] (-1 = unused slot). Scores and top-k
    run on each device's own rows (`batch_local`): GSPMD would gather the global batch for `top_k`."""
    q, weights = indexer.indexer_queries(indexer_params, q_resid, h, ctx.cos, ctx.sin, config)
    k = indexer.indexer_keys(indexer_params, h, ctx.cos, ctx.sin, config)
    if config.attention_backend == "pallas":
        def select(q, k, weights, segment_ids):
            return indexer_topk(q, k, weights, topk=config.index_topk, q_segment_ids=segment_ids,
                                k_segment_ids=segment_ids, **config.pallas_options)[0]
    else:
        def select(q, k, weights, segment_ids):
            return indexer.select_topk(q, k, weights, segment_ids, segment_ids, config.index_topk,
                                       query_chunk=config.index_query_chunk)
    return batch_local(select, mesh, (q, k, weights, ctx.segment_ids))


def _topk_over_cache(q: jax.Array, weights: jax.Array, positions: jax.Array, keys: jax.Array,
                     topk: int) -> jax.Array:
    """Top-k cached keys [B, S, N] for indexer queries at `positions` [B, S] (keys [B, T, J])."""
    b, s = positions.shape
    max_len = keys.shape[1]
    # Causality comes from the per-row positions; the indexer's own mask (one offset for all rows) is off.
    one_segment_q, one_segment_k = jnp.ones((b, s), jnp.int32), jnp.ones((b, max_len), jnp.int32)
    scores = indexer.index_scores(q, keys, weights, one_segment_q, one_segment_k, q_offset=max_len)
    scores = jnp.where(visible_slots(positions, max_len), scores, NEG_INF)
    return indexer.topk_from_scores(scores, topk)


def cached_topk(indexer_params, h: jax.Array, q_resid: jax.Array, ctx: LayerContext, cache: LayerCache,
                config: ModelConfig) -> tuple[jax.Array, jax.Array]:
    """Write this layer's indexer keys into the cache, score the new queries against every cached key up to
    their position, keep the top-k. Returns (top-k [B, S, N], the new index-key cache). With
    `index_query_chunk` a long prefill holds one [B, chunk, T] score block at a time."""
    q, weights = indexer.indexer_queries(indexer_params, q_resid, h, ctx.cos, ctx.sin, config)
    keys = indexer.indexer_keys(indexer_params, h, ctx.cos, ctx.sin, config)
    index_keys = write_rows(cache.kv.index_keys, cache.index_slot, keys, cache.positions)
    cached_keys = index_keys[cache.index_slot]
    topk = map_query_chunks(lambda q_c, w_c, pos_c: _topk_over_cache(q_c, w_c, pos_c, cached_keys, config.index_topk),
                            num_query_chunks(q.shape[1], config.index_query_chunk), q, weights, cache.positions)
    return topk, index_keys


def _attend_cached(layer, proj: dict, topk: jax.Array, cache: LayerCache, config: ModelConfig) -> tuple:
    """Write the new latent rows, then attend (absorbed form) over the selected cached rows; the dense
    training reference decodes in the absorbed form too (the two forms are equal)."""
    latent = write_rows(cache.kv.latent, cache.layer, proj["cache"], cache.positions)
    q = attention.absorbed_queries(layer["attn"], proj, config)
    rows = latent[cache.layer]
    if config.attention_backend == "pallas":
        latent_out, _ = sparse_mla_attention(q, rows, topk, scale=config.softmax_scale,
                                             kv_lora_rank=config.kv_lora_rank, **config.pallas_options)
    else:
        latent_out = sparse_latent_attention(q, rows, topk, config.softmax_scale, config.kv_lora_rank,
                                             config.index_query_chunk)[0]
    heads = attention.latent_to_heads(layer["attn"], latent_out, config)
    return attention.output_projection(layer["attn"], heads), latent


class LayerOutput(NamedTuple):
    hidden: jax.Array            # [B, S, D]
    topk: jax.Array              # [B, S, N] the key selection used
    aux: dict                    # expert counts / balance terms / expert ids (MoE), indexer KL terms
    cache: LayerCache | None     # with the new tokens' rows written (when run against a cache)


def decoder_layer(layer, indexer_params, x: jax.Array, ctx: LayerContext, prev_topk: jax.Array | None,
                  config: ModelConfig, *, run_indexer: jax.Array | bool = True,
                  expert_choices: jax.Array | None = None, topk_override: jax.Array | None = None,
                  indexer_mode: str | None = None, mesh=None, cache: LayerCache | None = None) -> LayerOutput:
    """One pre-norm decoder layer: h = x + MLA_DSA(norm(x)); y = h + FFN(norm(h)). The same layer serves
    training (the whole sequence), prefill and decode (new tokens against `cache`).

    `run_indexer` False (a traced bool is fine) reuses `prev_topk` (IndexShare "shared" layers);
    `topk_override` replays recorded indexer selections. `indexer_mode` ("dense_warmup" | "sparse") also
    returns the indexer KL terms (see `glm5_jax.model.indexer_kl`). With `cache`, the new tokens' latent
    rows (and indexer keys) are written first, the indexer ranks every cached key up to each query's
    position and attention reads the selected cached rows."""
    eps = config.rms_norm_eps
    h = rms_norm(x, layer["input_norm"]["scale"], eps)
    proj = attention.project(layer["attn"], h, ctx.cos, ctx.sin, config)
    kl_aux = {}
    if cache is not None:
        if topk_override is not None or indexer_mode is not None:
            raise ValueError("decoder_layer: a cache serves generation only; topk_override and indexer_mode "
                             "(routing replay, DSA training) need the whole sequence (cache=None)")

        def own_topk(index_keys):
            return cached_topk(indexer_params, h, proj["q_resid"], ctx,
                               cache._replace(kv=cache.kv._replace(index_keys=index_keys)), config)

        if run_indexer is True:
            topk, index_keys = own_topk(cache.kv.index_keys)
        else:
            topk, index_keys = jax.lax.cond(run_indexer, own_topk, lambda keys: (prev_topk, keys),
                                            cache.kv.index_keys)
        attn_out, latent = _attend_cached(layer, proj, topk, cache, config)
        cache = cache._replace(kv=KVCache(latent, index_keys))
    else:
        if topk_override is not None:
            topk = topk_override.astype(jnp.int32)
        elif run_indexer is True:
            topk = compute_topk(indexer_params, h, proj["q_resid"], ctx, config, mesh)
        else:
            topk = jax.lax.cond(run_indexer,
                                lambda: compute_topk(indexer_params, h, proj["q_resid"], ctx, config, mesh),
                                lambda: prev_topk)
        topk = checkpoint_name(topk, "dsa_topk")  # remat policies keep it (config.ALWAYS_SAVED)
        if indexer_mode is None:
            attn_out = attention.attend(layer["attn"], proj, topk, ctx.segment_ids, ctx.segment_ids, config)
        else:
            attn_out, kl_aux = attend_with_indexer_kl(layer["attn"], indexer_params, h, proj, topk,
                                                      ctx.segment_ids, ctx.token_mask, ctx.cos, ctx.sin, config,
                                                      indexer_mode)
    x = x + attn_out
    h = rms_norm(x, layer["post_attn_norm"]["scale"], eps)
    if "moe" in layer:
        ffn, aux = moe_block(layer["moe"], h, ctx.token_mask, config, expert_choices, mesh)
    else:
        mlp = layer["mlp"]
        ffn = swiglu(h, mlp["gate_proj"]["kernel"], mlp["up_proj"]["kernel"], mlp["down_proj"]["kernel"])
        aux = {}
    return LayerOutput(x + ffn, topk, {**aux, **kl_aux}, cache)
