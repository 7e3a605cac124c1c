"""The lightning indexer's scores at a selection of keys, from the gathered key rows (jnp): what the sparse KL
differentiates, and the one reference of the Mosaic backward (`tpu_selected_scores`).

I[s, n] = sum_i w[s, i] relu(J^-0.5 q[s, i].k[topk[s, n]]) in fp32, for index queries q [B, S, I, J], head
weights w [B, S, I] (fp32), index keys k [B, T, J] and a selection topk int [B, S, N] (-1 = unused slot, which
reads row 0 here; callers mask its score).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from pallas_kernels.query_chunks import merge_queries, num_query_chunks, split_queries
from pallas_kernels.sparse_latent import gather_rows


def gathered_scores(q: jax.Array, w: jax.Array, k: jax.Array, topk: jax.Array) -> jax.Array:
    """fp32 index scores [B, S, N] at the selected keys, from their gathered rows [B, S, N, J]."""
    keys = gather_rows(k, topk)
    # Rows as the left operand ([N, J] @ [J, I]): XLA:CPU's fast layout for these per-query products. The rows
    # stay in their dtype (bf16 products are exact in fp32): no fp32 copy of the gathered rows, nor of their
    # gradient, which is rounded to the keys' dtype before the scatter-add all the same.
    logits = jnp.einsum("BSNJ,BSIJ->BSNI", keys, q.astype(keys.dtype), preferred_element_type=jnp.float32)
    return jnp.einsum("BSI,BSNI->BSN", w, jax.nn.relu(logits * q.shape[-1] ** -0.5))


def gathered_scores_backward(q: jax.Array, w: jax.Array, k: jax.Array, topk: jax.Array, d_scores: jax.Array,
                             query_chunk: int) -> tuple[jax.Array, jax.Array, jax.Array]:
    """(dq, dw, dk) of `gathered_scores` for the cotangent d_scores [B, S, N] (fp32; zero on unused slots), one
    query block of `query_chunk` at a time (0: all at once). Each block gathers its rows and recomputes the
    per-head logits; the blocks' key gradients (per slot in the keys' dtype) are summed in fp32 and rounded once."""
    n = num_query_chunks(topk.shape[1], query_chunk)

    def block(dk, chunk):  # dk: the key gradient so far, fp32 (the blocks' scatter-adds summed once, not in bf16)
        q_c, w_c, topk_c, g_c = chunk
        _, vjp = jax.vjp(lambda q, w, k: gathered_scores(q, w, k, topk_c), q_c, w_c, k)
        dq, dw, dk_c = vjp(g_c)
        return dk + dk_c.astype(jnp.float32), (dq, dw)

    dk = jnp.zeros(k.shape, jnp.float32)
    if n == 1:
        dk, (dq, dw) = block(dk, (q, w, topk, d_scores))
    else:
        dk, (dq, dw) = jax.lax.scan(block, dk, tuple(split_queries(a, n) for a in (q, w, topk, d_scores)))
        dq, dw = merge_queries(dq), merge_queries(dw)
    return dq, dw, dk.astype(k.dtype)
