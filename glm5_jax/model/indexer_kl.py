"""Attention that also measures how well the lightning indexer predicts it (DSA continued pre-training).

Target per query: p = L1-normalised head sum of the main attention probabilities (a stop-gradient target).
Indexer distribution: softmax of the index scores. Loss per query: KL(p || softmax(I)).
- `dense_warmup`: attention stays dense over every visible key; the KL runs over all of them.
- `sparse`: attention over the selected top-k only; the KL is restricted to the selected set.
The indexer reads detached inputs, so it learns only from the KL and the model only from the LM loss.
Under context parallelism every per-query term runs on each chip's queries against the keys gathered over
`context` (`glm5_jax.distributed.context_local`); the masks and sums over [B, S] stay global arrays.
On IndexShare "shared" layers the KL trains the source layer's indexer toward this layer's attention too
(the one indexer serves both layers).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.ad_checkpoint import checkpoint_name

from glm5_jax.distributed.context_local import context_local
from glm5_jax.distributed.context_order import to_balanced, to_natural
from glm5_jax.model.attention import MLA, Projection
from glm5_jax.model.context import LayerContext
from glm5_jax.model.indexer import Indexer
from glm5_jax.ops.indexer_select import indexer_scores
from pallas_kernels import NEG_INF
from pallas_kernels.masks import selected_mask, visible_keys
from pallas_kernels.query_chunks import map_query_chunks, num_query_chunks
from pallas_kernels.sparse_latent import gather_rows

INDEXER_MODES = ("dense_warmup", "sparse")


def _kl(p: jax.Array, index_logits: jax.Array, valid: jax.Array) -> jax.Array:
    """sum over keys of p * (log p - log_softmax(index_logits)), with invalid keys excluded. -> [B, S]"""
    log_q = jax.nn.log_softmax(jnp.where(valid, index_logits, NEG_INF), axis=-1)
    terms = jnp.where(valid & (p > 0), p * (jnp.log(jnp.where(p > 0, p, 1.0)) - log_q), 0.0)
    return terms.sum(-1)


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


def attend_with_indexer_kl(attn: MLA, indexer: Indexer, h: jax.Array, proj: Projection, topk: jax.Array,
                           ctx: LayerContext, mode: str, mesh=None) -> tuple[jax.Array, dict]:
    """Returns (attention output [B, S, D], {indexer_kl_sum, indexer_kl_count, topk_mass_sum})."""
    config = attn.config
    q_i, w_i, k_i = indexer(jax.lax.stop_gradient(h), jax.lax.stop_gradient(proj.q_resid), ctx.cos, ctx.sin)
    segment_ids = ctx.segment_ids
    if mode == "dense_warmup":
        # Keys by natural position, queries in the layers' order (load-balanced under a context split).
        natural_segments = to_natural(segment_ids, mesh)
        visible = to_balanced(visible_keys(natural_segments, natural_segments), mesh)
        out, p = attn.attend_dense_with_target(proj, visible, segment_ids, mesh)
        p = jax.lax.stop_gradient(p)  # rows sum to 1 over the visible keys
        scores = indexer_scores(q_i, k_i, w_i, segment_ids, config=config, mesh=mesh)
        kl = _kl(p, scores, visible)
        captured = (p * selected_mask(topk, p.shape[-1])).sum(-1)
    elif mode == "sparse":
        out, p = attn.attend_sparse_with_target(proj, topk, mesh)
        p = checkpoint_name(jax.lax.stop_gradient(p), "dsa_target")
        kl = context_local(lambda _, p, q_i, w_i, topk, k_i: _selected_kl(p, q_i, w_i, k_i, topk,
                                                                         config.index_query_chunk),
                           mesh, (p, q_i, w_i, topk), (k_i,))
        captured = jnp.where(ctx.token_mask, 1.0, 0.0)  # the attention *is* the selected set
    else:
        raise ValueError(f"indexer_mode={mode!r} is invalid: must be one of {INDEXER_MODES}")
    real = ctx.token_mask.astype(jnp.float32)
    aux = {
        "indexer_kl_sum": (kl * real).sum(),
        "indexer_kl_count": real.sum(),
        "topk_mass_sum": (captured * real).sum(),
    }
    return out, aux
