"""The decoding cache (allocated here; its layout and the reads and writes are the decoder layer's,
`glm5_jax.model.kv_cache`) and the model run over new tokens against it: prefill (the prompt), decode (one
token per row) and speculative verification (k + 1 tokens per row) are the model's own forward with a cache,
so cached decoding computes what the forward computes on the whole sequence; only where keys come from
changes. Each layer writes its new rows first, the indexer ranks every cached key up to each query's
position (DSA top-k over the cache), and attention reads the selected cached rows in the absorbed form.
With a mesh whose `context` axis is > 1 the cache is split over it on its slot dim
(`glm5_jax.distributed.context_cache`): the prompt runs split over `context` as in training, and each decoded
token is ranked and attended by every chip over its own share of the slots.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp

from glm5_jax.config import ModelConfig
from glm5_jax.distributed.context_cache import lay_out_cache
from glm5_jax.model.kv_cache import KVCache, LayerCache
from glm5_jax.model.context import layer_context
from glm5_jax.model.transformer import forward, merge


def init_cache(num_layers: int, num_index_layers: int, batch: int, max_len: int, config: ModelConfig,
               dtype, mesh=None) -> KVCache:
    return KVCache(
        latent=lay_out_cache(jnp.zeros((num_layers, batch, max_len, config.latent_dim), dtype), mesh),
        index_keys=lay_out_cache(jnp.zeros((num_index_layers, batch, max_len, config.index_head_dim), dtype), mesh),
    )


def model_cache(config: ModelConfig, batch: int, max_len: int, dtype, mesh=None) -> KVCache:
    """Cache of the main model's layers (split over `context` on its slots when `mesh` splits sequences)."""
    num_full = sum(t == "full" for t in config.layer_indexer_types)
    return init_cache(config.num_hidden_layers, num_full, batch, max_len, config, dtype, mesh)


def mtp_cache(config: ModelConfig, batch: int, max_len: int, dtype, mesh=None) -> KVCache:
    """Cache of the MTP module's one layer (it has its own indexer); split like the main model's."""
    return init_cache(1, 1, batch, max_len, config, dtype, mesh)


def num_selected(config: ModelConfig, max_len: int) -> int:
    """Top-k slots per query: min(index_topk, cache length)."""
    return min(config.index_topk, max_len)


class CachedOutput(NamedTuple):
    hidden: jax.Array                 # [B, S, D] final normed hidden state (what the LM head reads)
    cache: KVCache
    topk: jax.Array | None            # [L, B, S, N] indexer selections (collect_routing)
    expert_ids: jax.Array | None      # [L_moe, B, S, A] expert choices (collect_routing)


def run_cached(params, cache: KVCache, tokens: jax.Array, positions: jax.Array, token_mask: jax.Array,
               config: ModelConfig, collect_routing: bool = False, mesh=None) -> CachedOutput:
    """The main model over new tokens [B, S] at absolute `positions` [B, S]; `token_mask` marks real tokens
    (padding and finished rows only feed the MoE counts). `mesh`: the devices the batch, and with `context`
    each sequence and the cache, are split over."""
    out = forward(params, tokens, config=config, positions=positions, segment_ids=token_mask.astype(jnp.int32),
                  cache=cache, return_logits=False, mtp_steps=0, collect_routing=collect_routing, mesh=mesh)
    routing = (out.aux["topk"], out.aux.get("expert_ids")) if collect_routing else (None, None)
    return CachedOutput(out.hidden, out.cache, *routing)


def run_mtp_cached(params, cache: KVCache, tokens: jax.Array, h_prev: jax.Array, positions: jax.Array,
                   token_mask: jax.Array, config: ModelConfig, mesh=None) -> tuple[jax.Array, jax.Array, KVCache]:
    """The MTP module once over new entries (`MTP.step` with its one-layer cache). Returns (raw layer output
    [B, S, D] to feed the next depth, its shared_head_norm [B, S, D] that the LM head reads, cache)."""
    model = merge(params, config)
    ctx = layer_context(positions, token_mask.astype(jnp.int32), config)
    h, normed, out = model.mtp.step(model.embed, tokens, h_prev, ctx, mesh=mesh,
                                    cache=LayerCache(cache, 0, 0, positions))
    return h, normed, out.cache.kv
