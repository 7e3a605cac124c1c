"""Sparse MQA attention over gathered latent rows: the jnp form of DSA's attention (the model's path when it
runs no kernel, and through `reference.sparse_mla_attention_reference` the kernel's reference).

Every head of a query attends over the same N selected latent rows [c ; k_rope] (width C + R). The rows
gathered for a block of queries, [B, chunk, N, C+R], are the largest tensors of a DSA layer; they grow with
S x N, so at long context they decide whether a step fits. Two things bound them:
- a custom VJP keeps only (q, cache, indices, out, lse) and re-gathers rows in the backward pass;
- with `query_chunk` the queries run in blocks under `lax.map` (forward, target) and `lax.scan` (backward,
  which carries the fp32 cache gradient), so only one block's rows and row gradients exist at a time.
The indexer KL's target (head-mean probabilities at the selected keys) comes out of the same forward pass, so
the KL costs no second gather.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from pallas_kernels._common import NEG_INF
from pallas_kernels.query_chunks import map_query_chunks, merge_queries, num_query_chunks, split_queries


def gather_rows(cache: jax.Array, indices: jax.Array) -> jax.Array:
    """[B, T, X] rows at indices [B, S, N] (unused slots read row 0) -> [B, S, N, X]."""
    return jax.vmap(lambda c, i: c[i])(cache, jnp.maximum(indices, 0))


# Per-query products keep the gathered rows as the left operand with heads last ([N, X] @ [X, H], "BSNX,BSHX->BSNH"):
# XLA:CPU runs that batched layout 6x faster than "BSHX,BSNX->BSHN", which contracts both operands' last axes.
def _logits(q: jax.Array, rows: jax.Array, scale: float, precision) -> jax.Array:
    """[B, S, N, H] fp32 scaled logits."""
    return jnp.einsum("BSNX,BSHX->BSNH", rows, q, precision=precision).astype(jnp.float32) * scale


def _probs_from_lse(logits: jax.Array, lse: jax.Array, valid: jax.Array) -> jax.Array:
    """[B, S, N, H] probabilities from [B, S, N, H] logits and the [B, S, H] lse; unused slots get 0."""
    return jnp.where(valid[..., None], jnp.exp(logits - lse[:, :, None, :]), 0.0)


def _attend_block(q, cache, indices, scale, kv_lora_rank, precision):
    """(latent out [B, S, H, C], lse [B, S, H], head-mean probabilities [B, S, N]) of one block of queries."""
    rows = gather_rows(cache, indices)
    valid = indices >= 0
    logits = jnp.where(valid[..., None], _logits(q, rows, scale, precision), NEG_INF)
    lse = jax.nn.logsumexp(logits, axis=2)
    probs = _probs_from_lse(logits, lse, valid)
    # Full-width product, then slice: cheaper than slicing the [B, S, N, C+R] rows to their first C columns.
    out = jnp.einsum("BSNH,BSNX->BSHX", probs.astype(q.dtype), rows, precision=precision)[..., :kv_lora_rank]
    return out, lse, probs.mean(-1)


def _block_grads(d_cache, q, indices, out, lse, d_out, d_lse, cache, scale, kv_lora_rank, precision):
    """One query block's backward: returns (d_cache + this block's row gradients, d_q of the block)."""
    valid = indices >= 0
    rows = gather_rows(cache, indices)
    probs = _probs_from_lse(_logits(q, rows, scale, precision), lse, valid)
    d_out_wide = jnp.pad(d_out, [(0, 0)] * 3 + [(0, q.shape[-1] - kv_lora_rank)])  # zero rope columns
    d_probs = jnp.einsum("BSNX,BSHX->BSNH", rows, d_out_wide, precision=precision).astype(jnp.float32)
    # d logit = p * (d_out.v - (d_out.out - d_lse)), the softmax Jacobian with the lse cotangent folded in.
    shift = jnp.sum(d_out.astype(jnp.float32) * out.astype(jnp.float32), axis=-1) - d_lse
    d_logits = (probs * (d_probs - shift[:, :, None, :]) * scale).astype(q.dtype)
    d_q = jnp.einsum("BSNH,BSNX->BSHX", d_logits, rows, precision=precision)
    # Both row-gradient terms as one product over 2H stacked heads: one [N, X] output per query, not two.
    d_rows = jnp.einsum("BSNG,BSGX->BSNX", jnp.concatenate([d_logits, probs.astype(q.dtype)], axis=-1),
                        jnp.concatenate([q, d_out_wide], axis=2), precision=precision)
    targets = jnp.where(valid, indices, cache.shape[1])  # unused slots land out of range and are dropped
    # fp32 accumulation: a row chosen by many queries sums many contributions.
    d_cache = jax.vmap(lambda z, i, v: z.at[i].add(v, mode="drop"))(d_cache, targets, d_rows.astype(jnp.float32))
    return d_cache, d_q


@functools.partial(jax.custom_vjp, nondiff_argnums=(3, 4, 5, 6))
def _sparse_latent_core(q, cache, indices, scale, kv_lora_rank, query_chunk, precision):
    return _sparse_latent_fwd(q, cache, indices, scale, kv_lora_rank, query_chunk, precision)[0]


def _sparse_latent_fwd(q, cache, indices, scale, kv_lora_rank, query_chunk, precision):
    n = num_query_chunks(q.shape[1], query_chunk)
    out, lse, target = map_query_chunks(
        lambda q_c, i_c: _attend_block(q_c, cache, i_c, scale, kv_lora_rank, precision), n, q, indices)
    # The gathered rows are not kept: the backward re-gathers them.
    return (out, lse, target), (q, cache, indices, out, lse)


def _sparse_latent_bwd(scale, kv_lora_rank, query_chunk, precision, residuals, cotangents):
    q, cache, indices, out, lse = residuals
    d_out, d_lse, _ = cotangents  # the target is a constant: its cotangent is dropped
    zeros = jnp.zeros(cache.shape, jnp.float32)
    n = num_query_chunks(q.shape[1], query_chunk)
    if n == 1:
        d_cache, d_q = _block_grads(zeros, q, indices, out, lse, d_out, d_lse, cache, scale, kv_lora_rank, precision)
    else:
        def step(d_cache, blocks):
            return _block_grads(d_cache, *blocks, cache, scale, kv_lora_rank, precision)

        blocks = tuple(split_queries(a, n) for a in (q, indices, out, lse, d_out, d_lse))
        d_cache, d_q = jax.lax.scan(step, zeros, blocks)
        d_q = merge_queries(d_q)
    return d_q, d_cache.astype(cache.dtype), None


_sparse_latent_core.defvjp(_sparse_latent_fwd, _sparse_latent_bwd)


def sparse_latent_attention(q: jax.Array, cache: jax.Array, indices: jax.Array, scale: float,
                            kv_lora_rank: int, query_chunk: int = 0,
                            precision: jax.lax.Precision | None = None) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Sparse MQA attention: gather the N selected latent rows per query and attend with every head.

    q [B, S, H, C+R], cache [B, T, C+R], indices [B, S, N] (-1 = unused slot).
    Returns the latent output [B, S, H, C], the fp32 log-sum-exp [B, S, H] and the head-mean probabilities at
    the selected keys [B, S, N] (fp32; 0 at unused slots): the indexer KL's target, a constant that passes no
    gradient back. A query with no valid slot outputs zeros. `query_chunk` > 0 bounds the gathered rows to
    [B, chunk, N, C+R] (see module doc). `precision` of the matmuls: None (the backend's default) in the model,
    HIGHEST as the kernels' reference."""
    out, lse, target = _sparse_latent_core(q, cache, indices, float(scale), kv_lora_rank, query_chunk, precision)
    return out, lse, jax.lax.stop_gradient(target)
