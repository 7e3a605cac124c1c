"""The model run over new tokens against the cache: prefill (the prompt), decode (one token per row) and
speculative verification (k + 1 tokens per row) are the same function with different query counts.

It reuses the model's own pieces (`attention.project`, the indexer's queries/keys/scores/top-k, `moe_block`,
`swiglu`, `rms_norm`), so cached decoding computes what `transformer.forward` computes on the whole
sequence; what changes is where keys come from. Each layer writes its new rows into the cache first, then
the indexer scores the new queries against every cached indexer key up to the query's position (DSA top-k
over the cache), and attention runs in the absorbed form over the selected cached latent rows only: the
Pallas kernel when `attention_backend` is "pallas", else the jnp gather (the "dense" training reference
decodes in the absorbed form too; the two forms are equal).
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from pallas_kernels import NEG_INF, sparse_mla_attention
from glm5_jax.config import ModelConfig
from glm5_jax.generation.cache import KVCache, visible_slots, write_rows
from glm5_jax.model import attention, indexer
from glm5_jax.model.layers import rms_norm, rope_angles, swiglu
from glm5_jax.model.moe import moe_block
from glm5_jax.model.transformer import dtype_of, full_indexer_slots


class NewTokens(NamedTuple):
    """Where the tokens fed in one call sit, shared by every layer."""

    positions: jax.Array   # [B, S] int32 absolute positions = cache slots written
    token_mask: jax.Array  # [B, S] bool: real tokens (padding and finished rows only feed MoE counts)
    cos: jax.Array         # [B, S, R/2]
    sin: jax.Array


def new_tokens(positions: jax.Array, token_mask: jax.Array, config: ModelConfig) -> NewTokens:
    cos, sin = rope_angles(positions, config.qk_rope_head_dim, config.rope_theta)
    return NewTokens(positions, token_mask, cos, sin)


def num_selected(config: ModelConfig, max_len: int) -> int:
    """Top-k slots per query: min(index_topk, cache length)."""
    return min(config.index_topk, max_len)


def _topk_over_cache(q: jax.Array, weights: jax.Array, positions: jax.Array, keys: jax.Array,
                     topk: int) -> jax.Array:
    """Top-k cached keys [B, S, N] for indexer queries at `positions` [B, S] (keys [B, T, J])."""
    b, s = positions.shape
    max_len = keys.shape[1]
    # Causality comes from the per-row positions; the model's own mask (one offset for all rows) is off.
    one_segment_q, one_segment_k = jnp.ones((b, s), jnp.int32), jnp.ones((b, max_len), jnp.int32)
    scores = indexer.index_scores(q, keys, weights, one_segment_q, one_segment_k, q_offset=max_len)
    scores = jnp.where(visible_slots(positions, max_len), scores, NEG_INF)
    return indexer.topk_from_scores(scores, topk)


def _cached_topk(indexer_params: dict, h: jax.Array, q_resid: jax.Array, new: NewTokens, index_keys: jax.Array,
                 slot: jax.Array | int, config: ModelConfig) -> tuple[jax.Array, jax.Array]:
    """Write this layer's indexer keys, score the new queries against the whole key cache, keep the top-k.
    With `index_query_chunk` (as in the model's forward) a long prefill holds one [B, chunk, T] score block
    at a time."""
    q, weights = indexer.indexer_queries(indexer_params, q_resid, h, new.cos, new.sin, config)
    keys = indexer.indexer_keys(indexer_params, h, new.cos, new.sin, config)
    index_keys = write_rows(index_keys, slot, keys, new.positions)
    cached_keys = index_keys[slot]
    s, chunk = q.shape[1], config.index_query_chunk
    if chunk <= 0 or chunk >= s or s % chunk:
        return _topk_over_cache(q, weights, new.positions, cached_keys, config.index_topk), index_keys

    def split(a):
        return jnp.moveaxis(a.reshape(a.shape[0], s // chunk, chunk, *a.shape[2:]), 1, 0)

    blocks = jax.lax.map(lambda args: _topk_over_cache(*args, cached_keys, config.index_topk),
                         (split(q), split(weights), split(new.positions)))
    return jnp.moveaxis(blocks, 0, 1).reshape(q.shape[0], s, -1), index_keys


def cached_layer(layer: dict, indexer_params: dict, x: jax.Array, new: NewTokens, cache: KVCache,
                 layer_id: jax.Array | int, index_slot: jax.Array | int, run_indexer: jax.Array | bool,
                 prev_topk: jax.Array, config: ModelConfig) -> tuple[jax.Array, jax.Array, KVCache, dict]:
    """One pre-norm decoder layer over new tokens x [B, S, D] with cache reads and writes.

    `run_indexer` False (traced is fine) reuses `prev_topk` (IndexShare). Returns (hidden, top-k [B, S, N],
    cache, routing) where routing has "expert_ids" [B, S, A] for MoE layers."""
    eps = config.rms_norm_eps
    h = rms_norm(x, layer["input_norm"]["scale"], eps)
    proj = attention.project(layer["attn"], h, new.cos, new.sin, config)
    latent = write_rows(cache.latent, layer_id, proj["cache"], new.positions)

    def own_topk(index_keys):
        return _cached_topk(indexer_params, h, proj["q_resid"], new, index_keys, index_slot, config)

    if run_indexer is True:
        topk, index_keys = own_topk(cache.index_keys)
    else:
        topk, index_keys = jax.lax.cond(run_indexer, own_topk, lambda keys: (prev_topk, keys), cache.index_keys)
    q = attention.absorbed_queries(layer["attn"], proj, config)
    if config.attention_backend == "pallas":
        latent_out, _ = sparse_mla_attention(q, latent[layer_id], topk, scale=config.softmax_scale,
                                             kv_lora_rank=config.kv_lora_rank, **config.pallas_options)
    else:
        latent_out, _ = attention.sparse_latent_attention(q, latent[layer_id], topk, config.softmax_scale,
                                                          config.kv_lora_rank)
    heads = attention.latent_to_heads(layer["attn"], latent_out, config)
    x = x + attention.output_projection(layer["attn"], heads)
    h = rms_norm(x, layer["post_attn_norm"]["scale"], eps)
    routing = {}
    if "moe" in layer:
        ffn, aux = moe_block(layer["moe"], h, new.token_mask, config)
        routing["expert_ids"] = aux["expert_ids"]
    else:
        mlp = layer["mlp"]
        ffn = swiglu(h, mlp["gate_proj"]["kernel"], mlp["up_proj"]["kernel"], mlp["down_proj"]["kernel"])
    return x + ffn, topk, KVCache(latent, index_keys), routing


class CachedOutput(NamedTuple):
    hidden: jax.Array                 # [B, S, D] final normed hidden state (what the LM head reads)
    cache: KVCache
    topk: jax.Array | None            # [L, B, S, N] indexer selections (collect_routing)
    expert_ids: jax.Array | None      # [L_moe, B, S, A] expert choices (collect_routing)


def cached_forward(params: dict, cache: KVCache, tokens: jax.Array, new: NewTokens, config: ModelConfig,
                   collect_routing: bool = False) -> CachedOutput:
    """The main model over new tokens [B, S] at `new.positions`; the dense and MoE stacks are scanned."""
    b, s = tokens.shape
    max_len = cache.latent.shape[2]
    x = params["embed"]["embedding"][tokens].astype(dtype_of(config.compute_dtype))
    topk = jnp.zeros((b, s, num_selected(config, max_len)), jnp.int32)
    slots = full_indexer_slots(config)
    nd = config.num_dense_layers
    stacks = [(name, ids) for name, ids in (("dense_layers", np.arange(nd)),
                                            ("moe_layers", np.arange(nd, config.num_hidden_layers))) if len(ids)]
    topk_by_stack, expert_ids = [], None
    for name, layer_ids in stacks:
        types = [config.layer_indexer_types[i] for i in layer_ids]
        all_full = all(t == "full" for t in types)
        xs = {
            "layer": params[name],
            "indexer": jax.tree.map(lambda a: a[slots[layer_ids]], params["indexers"]),
            "is_full": jnp.asarray([t == "full" for t in types]),
            "layer_id": jnp.asarray(layer_ids, jnp.int32),
            "slot": jnp.asarray(slots[layer_ids], jnp.int32),
        }

        def body(carry, xs_l, all_full=all_full):
            h, prev_topk, cache = carry
            h, new_topk, cache, routing = cached_layer(
                xs_l["layer"], xs_l["indexer"], h, new, cache, xs_l["layer_id"], xs_l["slot"],
                True if all_full else xs_l["is_full"], prev_topk, config)
            ys = dict(routing, topk=new_topk) if collect_routing else {}
            return (h, new_topk, cache), ys

        (x, topk, cache), ys = jax.lax.scan(body, (x, topk, cache), xs)
        if collect_routing:
            topk_by_stack.append(ys["topk"])
            expert_ids = ys.get("expert_ids", expert_ids)
    hidden = rms_norm(x, params["final_norm"]["scale"], config.rms_norm_eps)
    all_topk = jnp.concatenate(topk_by_stack) if collect_routing else None
    return CachedOutput(hidden, cache, all_topk, expert_ids)


def cached_mtp(params: dict, cache: KVCache, tokens: jax.Array, h_prev: jax.Array, new: NewTokens,
               config: ModelConfig) -> tuple[jax.Array, jax.Array, KVCache]:
    """The MTP module once over new entries: x = eh_proj([enorm(Emb(tokens)) ; hnorm(h_prev)]).

    Returns (raw layer output [B, S, D] to feed the next depth, its shared_head_norm [B, S, D] that the LM
    head reads, cache)."""
    mtp = params["mtp"]
    eps = config.rms_norm_eps
    dtype = h_prev.dtype
    emb = params["embed"]["embedding"][tokens].astype(dtype)
    merged = jnp.concatenate([rms_norm(emb, mtp["enorm"]["scale"], eps),
                              rms_norm(h_prev, mtp["hnorm"]["scale"], eps)], axis=-1)
    x = merged @ mtp["eh_proj"]["kernel"].astype(dtype)
    layer = {k: v for k, v in mtp["layer"].items() if k != "indexer"}
    b, s = tokens.shape
    no_topk = jnp.zeros((b, s, num_selected(config, cache.latent.shape[2])), jnp.int32)
    h, _, cache, _ = cached_layer(layer, mtp["layer"]["indexer"], x, new, cache, 0, 0, True, no_topk, config)
    return h, rms_norm(h, mtp["shared_head_norm"]["scale"], eps), cache
