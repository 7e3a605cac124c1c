"""Attention that also measures how well the lightning indexer predicts it (DSA continued pre-training).

Target per query: p = L1-normalised head sum of the main attention probabilities (a stop-gradient target).
Indexer distribution: softmax of the index scores. Loss per query: KL(p || softmax(I)).
- `dense_warmup`: attention stays dense over every visible key; the KL runs over all of them.
- `sparse`: attention over the selected top-k only; the KL is restricted to the selected set.
The indexer reads detached inputs, so it learns only from the KL and the model only from the LM loss.
On IndexShare "shared" layers the KL trains the source layer's indexer toward this layer's attention too
(the one indexer serves both layers).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from glm5_jax.config import ModelConfig
from glm5_jax.model import attention, indexer
from glm5_jax.model.masks import selected_mask, visible_keys
from glm5_jax.model.query_chunks import map_query_chunks, num_query_chunks
from glm5_jax.model.sparse_latent import gather_rows, sparse_latent_attention
from pallas_kernels import NEG_INF, dense_attention_target, indexer_scores, sparse_attention_target, sparse_mla_attention

INDEXER_MODES = ("dense_warmup", "sparse")


def _kl(p: jax.Array, index_logits: jax.Array, valid: jax.Array) -> jax.Array:
    """sum over keys of p * (log p - log_softmax(index_logits)), with invalid keys excluded. -> [B, S]"""
    log_q = jax.nn.log_softmax(jnp.where(valid, index_logits, NEG_INF), axis=-1)
    terms = jnp.where(valid & (p > 0), p * (jnp.log(jnp.where(p > 0, p, 1.0)) - log_q), 0.0)
    return terms.sum(-1)


def _dense_attention_and_target(attn, proj, visible, segment_ids, config):
    """Dense attention over every visible key, and the head-mean probability target [B, S, T]."""
    if config.attention_backend != "pallas":
        heads, probs = attention.expanded_attention(attn, proj, visible, config, return_probs=True)
        return heads, probs.astype(jnp.float32).mean(1)
    q = attention.absorbed_queries(attn, proj, config)
    every_visible = jnp.where(visible, jnp.arange(visible.shape[-1]), -1).astype(jnp.int32)
    latent, _ = sparse_mla_attention(q, proj["cache"], every_visible, scale=config.softmax_scale,
                                     kv_lora_rank=config.kv_lora_rank, **config.pallas_options)
    target = dense_attention_target(jax.lax.stop_gradient(q), jax.lax.stop_gradient(proj["cache"]),
                                    scale=config.softmax_scale, q_segment_ids=segment_ids, k_segment_ids=segment_ids,
                                    **config.pallas_options)
    return attention.latent_to_heads(attn, latent, config), target


def _sparse_attention_and_target(attn, proj, topk, config):
    """Attention over the selected keys, and the head-mean probability target at those keys [B, S, N].
    The `sparse` backend returns the target from its forward pass; the Pallas one rebuilds it from the lse.
    Neither keeps gathered rows for the backward."""
    q = attention.absorbed_queries(attn, proj, config)
    if config.attention_backend != "pallas":
        chunk = config.index_query_chunk
        latent, _, target = sparse_latent_attention(q, proj["cache"], topk, config.softmax_scale,
                                                    config.kv_lora_rank, chunk)
        return attention.latent_to_heads(attn, latent, config), target
    latent, lse = sparse_mla_attention(q, proj["cache"], topk, scale=config.softmax_scale,
                                       kv_lora_rank=config.kv_lora_rank, **config.pallas_options)
    target = sparse_attention_target(jax.lax.stop_gradient(q), jax.lax.stop_gradient(proj["cache"]), topk,
                                     jax.lax.stop_gradient(lse), scale=config.softmax_scale, **config.pallas_options)
    return attention.latent_to_heads(attn, latent, config), target


def _selected_kl(p, q_i, w_i, k_i, topk, query_chunk):
    """KL(p || softmax of the index scores at the selected keys) per query [B, S]. The gathered index keys
    [B, chunk, N, J] are recomputed in the backward (checkpointed blocks), not kept."""

    @jax.checkpoint
    def block(p_c, q_c, w_c, topk_c):
        keys = gather_rows(k_i, topk_c)  # [B, c, N, J]: only selected rows
        # Rows as the left operand ([N, J] @ [J, I]): XLA:CPU's fast layout for these per-query products.
        logits = jnp.einsum("BSNJ,BSIJ->BSNI", keys.astype(jnp.float32), q_c.astype(jnp.float32))
        scores = jnp.einsum("BSI,BSNI->BSN", w_c, jax.nn.relu(logits * q_c.shape[-1] ** -0.5))
        return _kl(p_c, scores, topk_c >= 0)

    return map_query_chunks(block, num_query_chunks(topk.shape[1], query_chunk), p, q_i, w_i, topk)


def attend_with_indexer_kl(attn: dict, indexer_params: dict, h: jax.Array, proj: dict, topk: jax.Array,
                           segment_ids: jax.Array, token_mask: jax.Array, cos, sin, config: ModelConfig,
                           mode: str) -> tuple[jax.Array, dict]:
    """Returns (attention output [B, S, D], {indexer_kl_sum, indexer_kl_count, topk_mass_sum})."""
    q_i, w_i = indexer.indexer_queries(indexer_params, jax.lax.stop_gradient(proj["q_resid"]),
                                       jax.lax.stop_gradient(h), cos, sin, config)
    k_i = indexer.indexer_keys(indexer_params, jax.lax.stop_gradient(h), cos, sin, config)
    if mode == "dense_warmup":
        visible = visible_keys(segment_ids, segment_ids)
        heads, p = _dense_attention_and_target(attn, proj, visible, segment_ids, config)
        p = jax.lax.stop_gradient(p)  # rows sum to 1 over the visible keys
        if config.attention_backend == "pallas":
            scores = indexer_scores(q_i, k_i, w_i, q_segment_ids=segment_ids, k_segment_ids=segment_ids,
                                    **config.pallas_options)
        else:
            scores = indexer.index_scores(q_i, k_i, w_i, segment_ids, segment_ids)
        kl = _kl(p, scores, visible)
        captured = (p * selected_mask(topk, p.shape[-1])).sum(-1)
    elif mode == "sparse":
        heads, p = _sparse_attention_and_target(attn, proj, topk, config)
        p = jax.lax.stop_gradient(p)
        kl = _selected_kl(p, q_i, w_i, k_i, topk, config.index_query_chunk)
        captured = jnp.where(token_mask, 1.0, 0.0)  # the attention *is* the selected set
    else:
        raise ValueError(f"indexer_mode={mode!r} is invalid: must be one of {INDEXER_MODES}")
    real = token_mask.astype(jnp.float32)
    aux = {
        "indexer_kl_sum": (kl * real).sum(),
        "indexer_kl_count": real.sum(),
        "topk_mass_sum": (captured * real).sum(),
    }
    return attention.output_projection(attn, heads), aux
