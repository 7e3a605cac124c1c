"""Plain-jnp references of the DSA kernels, with the kernels' signatures so either can be swapped in.

The sparse MLA attention and the indexer's scores and top-k are the same jnp code the model runs when it runs
no kernel (`sparse_latent.py`, `chunked_topk.py`: one implementation per operation); here they compute at
HIGHEST matmul precision, the model at the backend's default. The dense KL target's softmax and head mean are
the model's own code too (`dense_target.py`: the model applies them to its expanded attention's probabilities);
the sparse target's reference exists for the kernel only (the model's jnp path takes it from its attention's
forward). They materialise what the kernels avoid ([B, S, N, C+R] gathered rows, [B, S, I, T] / [B, H, S, T] score tensors), so use them for tests
and small shapes. Block sizes, chunk sizes and `interpret` are accepted for drop-in compatibility and have no
effect here.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax

from pallas_kernels._common import NEG_INF, positions_and_segments
from pallas_kernels.dense_target import head_mean_target, visible_softmax
from pallas_kernels.masks import visible_keys
from pallas_kernels.selected_scores import gathered_scores_backward
from pallas_kernels.sparse_latent import sparse_latent_attention

HIGHEST = lax.Precision.HIGHEST


def _gather_selected(latent: jax.Array, indices: jax.Array):
    """[B, T, C+R], [B, S, N] -> rows [B, S, N, C+R] (zeros at invalid slots) and the valid mask."""
    valid = (indices >= 0) & (indices < latent.shape[1])
    rows = jax.vmap(lambda lat, idx: lat[idx])(latent, jnp.where(valid, indices, 0))
    return jnp.where(valid[..., None], rows, 0), valid


def sparse_mla_attention_reference(q, latent, indices, *, scale, kv_lora_rank, precision=HIGHEST, block_n=64,
                                   bwd_query_chunk=None, interpret=None):
    """softmax(scale * q.k over the valid selected rows) @ v; returns (out [B,S,H,C] q.dtype, lse fp32).
    An index outside [0, T) is an unused slot."""
    in_range = jnp.where(indices < latent.shape[1], indices, -1)
    out, lse, _ = sparse_latent_attention(q, latent, in_range, scale, kv_lora_rank, precision=precision)
    return out, lse


def indexer_scores_reference(q_index, k_index, weights, *, q_segment_ids=None, k_segment_ids=None,
                             q_offset=0, precision=HIGHEST, block_t=64, bwd_query_chunk=64, interpret=None):
    """I[s,t] = sum_i w[s,i] relu(q[s,i].k[t] J^-0.5) in fp32; invisible keys get NEG_INF. [B, S, T]."""
    batch, q_len, _, head_dim = q_index.shape
    k_len = k_index.shape[1]
    logits = jnp.einsum("BSIJ,BTJ->BSIT", q_index.astype(jnp.float32), k_index.astype(jnp.float32),
                        precision=precision) * head_dim**-0.5
    scores = jnp.einsum("BSI,BSIT->BST", weights.astype(jnp.float32), jax.nn.relu(logits), precision=precision)
    q_pos, q_seg, k_seg = positions_and_segments(q_offset, q_segment_ids, k_segment_ids, batch, q_len, k_len)
    visible = (jnp.arange(k_len)[None, None, :] <= q_pos[None, :, None]) & (q_seg[:, :, None] == k_seg[:, None, :])
    return jnp.where(visible, scores, NEG_INF)


def topk_with_scores(scores: jax.Array, topk: int) -> tuple[jax.Array, jax.Array]:
    """The top-k rule: (int32 key indices [B, S, min(topk, T)], their scores), slots that landed on invisible
    (NEG_INF) keys -1. Among equal scores `lax.top_k` takes the lowest key index first."""
    values, indices = lax.top_k(scores, min(topk, scores.shape[-1]))
    return jnp.where(values > NEG_INF / 2, indices, -1).astype(jnp.int32), values


def topk_from_scores(scores: jax.Array, topk: int) -> jax.Array:
    """The key indices of `topk_with_scores`."""
    return topk_with_scores(scores, topk)[0]


def indexer_topk_reference(q_index, k_index, weights, *, topk, q_segment_ids=None, k_segment_ids=None,
                           q_offset=0, query_chunk=256, block_t=64, interpret=None):
    """The top-k rule over the full reference score matrix: (indices [B, S, N] int32, their scores)."""
    return topk_with_scores(indexer_scores_reference(q_index, k_index, weights, q_segment_ids=q_segment_ids,
                                                     k_segment_ids=k_segment_ids, q_offset=q_offset), topk)


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


def sparse_mla_attention_with_target_reference(q, latent, indices, *, scale, kv_lora_rank, precision=HIGHEST,
                                               block_n=64, bwd_query_chunk=None, interpret=None):
    """(out, lse) of `sparse_mla_attention_reference` and the sparse target from that lse (a constant)."""
    out, lse = sparse_mla_attention_reference(q, latent, indices, scale=scale, kv_lora_rank=kv_lora_rank,
                                              precision=precision)
    target = sparse_attention_target_reference(*(lax.stop_gradient(x) for x in (q, latent)), indices,
                                               lax.stop_gradient(lse), scale=scale)
    return out, lse, target


def dense_attention_target_reference(q, latent, *, scale, q_segment_ids=None, k_segment_ids=None, q_offset=0,
                                     block_s=None, block_t=64, interpret=None):
    """The same over every visible key: the head mean of the dense softmax (`dense_target`, the model's own
    code); [B, S, T] fp32."""
    batch, q_len = q.shape[:2]
    k_len = latent.shape[1]
    logits = jnp.einsum("BSHX,BTX->BHST", q.astype(jnp.float32), latent.astype(jnp.float32),
                        precision=HIGHEST) * scale
    q_pos, q_seg, k_seg = positions_and_segments(q_offset, q_segment_ids, k_segment_ids, batch, q_len, k_len)
    visible = (jnp.arange(k_len)[None, None, :] <= q_pos[None, :, None]) & (q_seg[:, :, None] == k_seg[:, None, :])
    return head_mean_target(visible_softmax(logits, visible[:, None]))


def selected_scores_backward_reference(q_index, k_index, weights, indices, d_scores, *, block_n=64,
                                       bwd_query_chunk=0, interpret=None, platform=None):
    """(dq, dw, dk) of the index scores at a selection: the model's jnp backward (`gathered_scores_backward`).
    An index outside [0, T) is an unused slot, whose cotangent is ignored."""
    valid = (indices >= 0) & (indices < k_index.shape[1])
    return gathered_scores_backward(q_index, weights, k_index, jnp.where(valid, indices, -1),
                                    jnp.where(valid, d_scores, 0.0), bwd_query_chunk)


def causal_flash_attention_with_target_reference(q, k, v, segment_ids, *, scale, interpret=None, platform=None):
    """(`causal_flash_attention_reference`, the head mean of its probabilities [B, S, S] fp32)."""
    logits = jnp.einsum("BSHK,BTHK->BHST", q.astype(jnp.float32), k.astype(jnp.float32), precision=HIGHEST) * scale
    probs = visible_softmax(logits, visible_keys(segment_ids, segment_ids)[:, None])
    out = jnp.einsum("BHST,BTHP->BSHP", probs, v.astype(jnp.float32), precision=HIGHEST)
    return out, head_mean_target(probs)


def causal_flash_attention_reference(q, k, v, segment_ids, *, scale, interpret=None, platform=None):
    """softmax(scale q.k) v over the keys each query sees (t <= s within its segment), in fp32 at HIGHEST
    precision: [B, S, H, P] fp32 (the kernels return the inputs' dtype)."""
    return causal_flash_attention_with_target_reference(q, k, v, segment_ids, scale=scale)[0]
