"""Plain-jnp references of the DSA kernels, with the kernels' signatures so either can be swapped in.

They materialise what the kernels avoid ([B, S, N, C+R] gathered rows, [B, S, I, T] / [B, H, S, T]
score tensors), so use them for tests, the `sparse` attention backend and small shapes. Block sizes,
chunk sizes and `interpret` are accepted for drop-in compatibility and have no effect here.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax

from pallas_kernels._common import NEG_INF, positions_and_segments

HIGHEST = lax.Precision.HIGHEST


def _safe_softmax_stats(logits: jax.Array, valid: jax.Array):
    """Probabilities and lse along the last axis; rows without a valid entry give p = 0, lse = NEG_INF."""
    logits = jnp.where(valid, logits, NEG_INF)
    row_max = lax.stop_gradient(jnp.max(logits, axis=-1, keepdims=True))  # softmax is shift-invariant
    p = jnp.where(valid, jnp.exp(logits - row_max), 0.0)
    total = jnp.sum(p, axis=-1, keepdims=True)
    has_valid = total > 0
    safe_total = jnp.where(has_valid, total, 1.0)
    lse = jnp.where(has_valid, row_max + jnp.log(safe_total), NEG_INF)[..., 0]
    return p / safe_total, lse


def _gather_selected(latent: jax.Array, indices: jax.Array):
    """[B, T, C+R], [B, S, N] -> rows [B, S, N, C+R] (zeros at invalid slots) and the valid mask."""
    valid = (indices >= 0) & (indices < latent.shape[1])
    rows = jax.vmap(lambda lat, idx: lat[idx])(latent, jnp.where(valid, indices, 0))
    return jnp.where(valid[..., None], rows, 0), valid


def sparse_mla_attention_reference(q, latent, indices, *, scale, kv_lora_rank, block_n=64,
                                   bwd_query_chunk=256, interpret=None):
    """softmax(scale * q.k over the valid selected rows) @ v; returns (out [B,S,H,C] q.dtype, lse fp32)."""
    rows, valid = _gather_selected(latent, indices)
    logits = jnp.einsum("BSHX,BSNX->BSHN", q.astype(jnp.float32), rows.astype(jnp.float32),
                        precision=HIGHEST) * scale
    p, lse = _safe_softmax_stats(logits, valid[:, :, None, :])
    out = jnp.einsum("BSHN,BSNC->BSHC", p, rows[..., :kv_lora_rank].astype(jnp.float32), precision=HIGHEST)
    return out.astype(q.dtype), lse


def indexer_scores_reference(q_index, k_index, weights, *, q_segment_ids=None, k_segment_ids=None,
                             q_offset=0, block_t=64, bwd_query_chunk=64, interpret=None):
    """I[s,t] = sum_i w[s,i] relu(q[s,i].k[t] J^-0.5) in fp32; invisible keys get NEG_INF. [B, S, T]."""
    batch, q_len, _, head_dim = q_index.shape
    k_len = k_index.shape[1]
    logits = jnp.einsum("BSIJ,BTJ->BSIT", q_index.astype(jnp.float32), k_index.astype(jnp.float32),
                        precision=HIGHEST) * head_dim**-0.5
    scores = jnp.einsum("BSI,BSIT->BST", weights.astype(jnp.float32), jax.nn.relu(logits), precision=HIGHEST)
    q_pos, q_seg, k_seg = positions_and_segments(q_offset, q_segment_ids, k_segment_ids, batch, q_len, k_len)
    visible = (jnp.arange(k_len)[None, None, :] <= q_pos[None, :, None]) & (q_seg[:, :, None] == k_seg[:, None, :])
    return jnp.where(visible, scores, NEG_INF)


def indexer_topk_reference(q_index, k_index, weights, *, topk, q_segment_ids=None, k_segment_ids=None,
                           q_offset=0, query_chunk=256, block_t=64, interpret=None):
    """jax.lax.top_k over the full reference score matrix; slots on invisible keys become -1."""
    scores = indexer_scores_reference(q_index, k_index, weights, q_segment_ids=q_segment_ids,
                                      k_segment_ids=k_segment_ids, q_offset=q_offset)
    values, indices = lax.top_k(scores, min(topk, scores.shape[-1]))
    batch, q_len, k_len = scores.shape
    q_pos, q_seg, k_seg = positions_and_segments(q_offset, q_segment_ids, k_segment_ids, batch, q_len, k_len)
    visible = (indices <= q_pos[None, :, None]) & (jnp.take_along_axis(k_seg[:, None, :], indices, axis=-1)
                                                   == q_seg[:, :, None])
    return jnp.where(visible, indices, -1).astype(jnp.int32), values


def _l1_normalise(p: jax.Array) -> jax.Array:
    total = jnp.sum(p, axis=-1, keepdims=True)
    return p / jnp.where(total > 0, total, 1.0)


def sparse_attention_target_reference(q, latent, indices, lse, *, scale, block_n=64, interpret=None):
    """L1-normalised head sum of exp(scale q_h.k_n - lse_h) at the selected rows; [B, S, N] fp32."""
    rows, valid = _gather_selected(latent, indices)
    logits = jnp.einsum("BSHX,BSNX->BSHN", q.astype(jnp.float32), rows.astype(jnp.float32),
                        precision=HIGHEST) * scale
    p = jnp.where(valid[:, :, None, :], jnp.exp(logits - lse[..., None]), 0.0)
    return _l1_normalise(jnp.sum(p, axis=2))


def dense_attention_target_reference(q, latent, *, scale, q_segment_ids=None, k_segment_ids=None, q_offset=0,
                                     block_s=None, block_t=64, interpret=None):
    """The same over every visible key: L1-normalised head sum of the dense softmax; [B, S, T] fp32."""
    batch, q_len = q.shape[:2]
    k_len = latent.shape[1]
    logits = jnp.einsum("BSHX,BTX->BHST", q.astype(jnp.float32), latent.astype(jnp.float32),
                        precision=HIGHEST) * scale
    q_pos, q_seg, k_seg = positions_and_segments(q_offset, q_segment_ids, k_segment_ids, batch, q_len, k_len)
    visible = (jnp.arange(k_len)[None, None, :] <= q_pos[None, :, None]) & (q_seg[:, :, None] == k_seg[:, None, :])
    p, _ = _safe_softmax_stats(logits, visible[:, None])
    return _l1_normalise(jnp.sum(p, axis=1))
