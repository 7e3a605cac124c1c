"""Attention that also measures how well the lightning indexer predicts it (DSA continued pre-training).

Target per query: p = L1-normalised head sum of the main attention probabilities (a stop-gradient target).
Indexer distribution: softmax of the index scores. Loss per query: KL(p || softmax(I)).
- `dense_warmup`: attention stays dense over every visible key; the KL runs over all of them.
- `sparse`: attention over the selected top-k only; the KL is restricted to the selected set. Where the top-k
  would keep every visible key and the kernels attend by flash attention, no top-k runs and the KL is the one
  over every visible key (the same set), as in the warm-up.
The indexer reads detached inputs, so it learns only from the KL and the model only from the LM loss.
Under context parallelism every per-query term runs on each chip's queries against the keys gathered over
`context` (`glm5_jax.distributed.context_local`); the masks and sums over [B, S] stay global arrays.
On IndexShare "shared" layers the KL trains the source layer's indexer toward this layer's attention too
(the one indexer serves both layers).
The sparse KL's forward reads the index scores the top-k selection ranked by (saved through remat as
"dsa_topk_scores"); only its backward gathers the selected index keys (`ops.selected_scores_backward`: XLA's
gather, or on TPU with `attention_backend: pallas` a Mosaic kernel that DMAs them into VMEM). A layer whose
selection is not its own indexer's (a "shared" layer: the source's keys, this layer's queries; a replayed top-k)
gathers its scores.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.ad_checkpoint import checkpoint_name

from glm5_jax.distributed.context_local import context_local
from glm5_jax.distributed.context_order import causal_cost_offset, to_balanced, to_natural
from glm5_jax.model.attention import MLA, Projection
from glm5_jax.model.context import LayerContext
from glm5_jax.model.indexer import Indexer
from glm5_jax.ops.indexer_select import indexer_scores
from glm5_jax.ops.selected_scores_grad import selected_scores_backward, uses_selected_scores_kernel
from pallas_kernels import NEG_INF
from pallas_kernels.masks import selected_mask, visible_keys
from pallas_kernels.query_chunks import map_query_chunks, num_query_chunks
from pallas_kernels.selected_scores import gathered_scores

INDEXER_MODES = ("dense_warmup", "sparse")


def _kl(p: jax.Array, index_logits: jax.Array, valid: jax.Array) -> jax.Array:
    """sum over keys of p * (log p - log_softmax(index_logits)), with invalid keys excluded. -> [B, S]"""
    log_q = jax.nn.log_softmax(jnp.where(valid, index_logits, NEG_INF), axis=-1)
    terms = jnp.where(valid & (p > 0), p * (jnp.log(jnp.where(p > 0, p, 1.0)) - log_q), 0.0)
    return terms.sum(-1)


def selected_scores(q_i, w_i, k_i, topk, query_chunk):
    """The index scores [B, S, N] at a selection made elsewhere (a constant): the gather path, for selections
    that are not this indexer's own (IndexShare "shared" layers, replayed top-k)."""
    scores = map_query_chunks(lambda q_c, w_c, topk_c: gathered_scores(q_c, w_c, k_i, topk_c),
                              num_query_chunks(topk.shape[1], query_chunk), q_i, w_i, topk)
    return jax.lax.stop_gradient(jnp.where(topk >= 0, scores, NEG_INF))


@functools.partial(jax.custom_vjp, nondiff_argnums=(5, 6))
def _scores_at_selection(scores, q_i, w_i, k_i, topk, config, cost_q_offset):
    """`scores` (the selection's own, a constant) as the forward value, differentiated as the gathered index
    scores at `topk` are: the backward (`ops.selected_scores_backward`: jnp, or the Mosaic kernel on TPU) gathers
    the selected keys and recomputes the per-head logits once per query block, instead of the forward, its
    recompute and the backward each doing so. cost_q_offset: the static position of query 0 in its causal
    selection, for the kernel's declared cost."""
    return scores


def _scores_at_selection_fwd(scores, q_i, w_i, k_i, topk, config, cost_q_offset):
    return scores, (q_i, w_i, k_i, topk)


def _scores_at_selection_bwd(config, cost_q_offset, residuals, g):
    q_i, w_i, k_i, topk = residuals
    dq, dw, dk = selected_scores_backward(q_i, w_i, k_i, topk, g, config=config, cost_q_offset=cost_q_offset)
    return None, dq, dw, dk, None


_scores_at_selection.defvjp(_scores_at_selection_fwd, _scores_at_selection_bwd)


def _selected_kl(p, scores, q_i, w_i, k_i, topk, config, cost_q_offset):
    """KL(p || softmax of the index scores at the selected keys) per query [B, S]. Its value reads `scores`, the
    selection's own scores at `topk` (no gather); its gradient in q_i, w_i and k_i is the gathered scores'
    (`_scores_at_selection`): softmax(scores) - p on the valid slots, through the per-head logits."""
    scores = _scores_at_selection(jax.lax.stop_gradient(scores), q_i, w_i, k_i, topk, config, cost_q_offset)
    return _kl(p, scores, topk >= 0)


def scores_at(indexer: Indexer, h: jax.Array, proj: Projection, topk: jax.Array, ctx: LayerContext,
              mesh=None) -> jax.Array:
    """This layer's index scores [B, S, N] at a selection `topk` it did not make (the gather path)."""
    q_i, w_i, k_i = indexer(jax.lax.stop_gradient(h), jax.lax.stop_gradient(proj.q_resid), ctx.cos, ctx.sin)
    chunk = indexer.config.index_query_chunk
    return context_local(lambda _, q_i, w_i, topk, k_i: selected_scores(q_i, w_i, k_i, topk, chunk),
                         mesh, (q_i, w_i, topk), (k_i,))


def attend_with_indexer_kl(attn: MLA, indexer: Indexer, h: jax.Array, proj: Projection, topk: jax.Array,
                           ctx: LayerContext, mode: str, mesh=None,
                           scores: jax.Array | None = None, every_key: bool = False) -> tuple[jax.Array, dict]:
    """Returns (attention output [B, S, D], {indexer_kl_sum, indexer_kl_count, topk_mass_sum}). `scores`: this
    indexer's scores at `topk` [B, S, N] (the top-k's own); without them the sparse mode gathers them.
    `every_key`: `topk` is the causal mask itself (`ops.causal_selection`, no top-k ran), so the sparse mode's KL
    over the selection is the one over every visible key, from the dense index scores as in the warm-up."""
    if mode not in INDEXER_MODES:
        raise ValueError(f"indexer_mode={mode!r} is invalid: must be one of {INDEXER_MODES}")
    config = attn.config
    q_i, w_i, k_i = indexer(jax.lax.stop_gradient(h), jax.lax.stop_gradient(proj.q_resid), ctx.cos, ctx.sin)
    segment_ids = ctx.segment_ids
    if mode == "dense_warmup" or every_key:
        # Keys by natural position, queries in the layers' order (load-balanced under a context split).
        natural_segments = to_natural(segment_ids, mesh)
        visible = to_balanced(visible_keys(natural_segments, natural_segments), mesh)
        out, p = attn.attend_dense_with_target(proj, visible, segment_ids, mesh)
        p = jax.lax.stop_gradient(p)  # rows sum to 1 over the visible keys
        if every_key:
            p = checkpoint_name(p, "dsa_target")  # the sparse stage's target, as below
        scores = indexer_scores(q_i, k_i, w_i, segment_ids, config=config, mesh=mesh)
        kl = _kl(p, scores, visible)
        captured = (jnp.where(ctx.token_mask, 1.0, 0.0) if every_key
                    else (p * selected_mask(topk, p.shape[-1])).sum(-1))
    else:
        out, p = attn.attend_sparse_with_target(proj, topk, segment_ids, mesh)
        p = checkpoint_name(jax.lax.stop_gradient(p), "dsa_target")
        if scores is None:
            scores = scores_at(indexer, h, proj, topk, ctx, mesh)
        # The backward's Mosaic kernel must see its device's rows only (GSPMD cannot partition it).
        kl = context_local(lambda chip_offset, p, scores, q_i, w_i, topk, k_i: _selected_kl(
                               p, scores, q_i, w_i, k_i, topk, config,
                               causal_cost_offset(chip_offset, k_i.shape[1], q_i.shape[1])),
                           mesh, (p, scores, q_i, w_i, topk), (k_i,),
                           local_rows=uses_selected_scores_kernel(config))
        captured = jnp.where(ctx.token_mask, 1.0, 0.0)  # the attention *is* the selected set
    real = ctx.token_mask.astype(jnp.float32)
    aux = {
        "indexer_kl_sum": (kl * real).sum(),
        "indexer_kl_count": real.sum(),
        "topk_mass_sum": (captured * real).sum(),
    }
    return out, aux
