"""Sparse MQA attention over gathered latent rows (`ops/sparse_latent.py`): the custom VJP and the query
blocks equal autodiff of the plain math, the indexer-KL target equals the plain probabilities, DSA's sparse
stage gives the same loss and gradients with and without query blocks, and the blocks bound its memory."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from pallas_model import small_pallas_model

from pallas_kernels.query_chunks import num_query_chunks
from pallas_kernels.sparse_latent import sparse_latent_attention

from glm5_jax.model.transformer import forward, init
from pallas_kernels import NEG_INF

B, S, T, H, C, R, N = 2, 6, 9, 3, 8, 4, 4
SCALE = 0.3


def _inputs(seed=0):
    rng = np.random.RandomState(seed)
    q = jnp.asarray(rng.randn(B, S, H, C + R), jnp.float32)
    cache = jnp.asarray(rng.randn(B, T, C + R), jnp.float32)
    indices = np.stack([[rng.choice(T, N, replace=False) for _ in range(S)] for _ in range(B)]).astype(np.int32)
    indices[0, 1, 2:] = -1   # some unused slots
    indices[1, 3, :] = -1    # a query with no valid slot
    indices[1, 4] = indices[1, 5]  # repeats across queries
    return q, cache, jnp.asarray(indices)


def _plain(q, cache, indices):
    """The math written out, for autodiff: gather, masked softmax, weighted sum of the first C columns."""
    rows = jax.vmap(lambda c, i: c[i])(cache, jnp.maximum(indices, 0))
    valid = (indices >= 0)[:, :, None, :]
    logits = jnp.where(valid, jnp.einsum("BSHX,BSNX->BSHN", q, rows) * SCALE, NEG_INF)
    lse = jax.nn.logsumexp(logits, axis=-1)
    probs = jnp.where(valid, jnp.exp(logits - lse[..., None]), 0.0)
    return jnp.einsum("BSHN,BSNC->BSHC", probs, rows[..., :C]), lse, probs


def test_query_chunk_rule_matches_the_indexer():
    assert num_query_chunks(12, 0) == 1 and num_query_chunks(12, 12) == 1 and num_query_chunks(12, 5) == 1
    assert num_query_chunks(12, 4) == 3 and num_query_chunks(12, 1) == 12


@pytest.mark.parametrize("query_chunk", [0, 2, 3])
def test_custom_vjp_in_query_blocks_equals_autodiff_of_the_plain_math(query_chunk):
    q, cache, indices = _inputs()
    rng = np.random.RandomState(1)
    w_out, w_lse = jnp.asarray(rng.randn(B, S, H, C), jnp.float32), jnp.asarray(rng.randn(B, S, H), jnp.float32)
    some_valid = indices.max(-1, keepdims=True) >= 0

    def loss(q_, cache_, attention):
        out, lse = attention(q_, cache_)[:2]
        return jnp.sum(out * w_out) + jnp.sum(jnp.where(some_valid, lse, 0.0) * w_lse)

    custom = jax.jit(jax.value_and_grad(lambda q_, c_: loss(q_, c_, lambda a, b: sparse_latent_attention(
        a, b, indices, SCALE, C, query_chunk)), argnums=(0, 1)))(q, cache)
    plain = jax.jit(jax.value_and_grad(lambda q_, c_: loss(q_, c_, lambda a, b: _plain(a, b, indices)),
                                       argnums=(0, 1)))(q, cache)
    np.testing.assert_allclose(custom[0], plain[0], rtol=1e-6)
    for got, want in zip(custom[1], plain[1]):
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
    assert float(jnp.abs(custom[1][0][1, 3]).max()) == 0.0  # no valid slot: no gradient
    out = sparse_latent_attention(q, cache, indices, SCALE, C, query_chunk)[0]
    assert float(jnp.abs(out[1, 3]).max()) == 0.0  # ... and a zero output


@pytest.mark.parametrize("query_chunk", [0, 3])
def test_target_equals_the_head_mean_probabilities_and_is_a_constant(query_chunk):
    q, cache, indices = _inputs(2)
    _, _, probs = _plain(q, cache, indices)
    target = sparse_latent_attention(q, cache, indices, SCALE, C, query_chunk)[2]
    np.testing.assert_allclose(target, probs.mean(2), rtol=1e-6, atol=1e-7)
    grads = jax.grad(lambda q_: sparse_latent_attention(q_, cache, indices, SCALE, C, query_chunk)[2].sum())(q)
    assert not np.any(grads)


CONFIG = small_pallas_model(compute_dtype="float32", attention_backend="sparse", moe_backend="ragged")


@pytest.mark.slow
def test_dsa_sparse_stage_in_query_blocks_equals_one_block_in_loss_kl_and_gradients():
    params = init(CONFIG, jax.random.key(0))
    tokens = jax.random.randint(jax.random.key(1), (2, 12), 0, CONFIG.vocab_size)
    segment_ids = jnp.array([[1] * 7 + [2] * 5, [1] * 12])

    def loss(p, query_chunk):
        out = forward(p, tokens, config=dataclasses.replace(CONFIG, index_query_chunk=query_chunk),
                      segment_ids=segment_ids, indexer_mode="sparse")
        kl = out.aux["indexer_kl_sum"].sum() + out.aux["mtp"]["indexer_kl_sum"].sum()
        return jnp.mean(out.logits ** 2) + jnp.mean(out.mtp_logits ** 2) + kl, kl

    grad_fn = jax.jit(jax.value_and_grad(loss, has_aux=True), static_argnums=1)
    (ref_value, ref_kl), ref_grads = grad_fn(params, 0)
    (value, kl), grads = grad_fn(params, 4)
    assert float(ref_kl) > 0
    np.testing.assert_allclose(kl, ref_kl, rtol=1e-5)
    np.testing.assert_allclose(value, ref_value, rtol=1e-5)
    for (path, g), r in zip(jax.tree_util.tree_flatten_with_path(grads)[0], jax.tree.leaves(ref_grads)):
        np.testing.assert_allclose(g, r, atol=1e-6, rtol=1e-4, err_msg=jax.tree_util.keystr(path))


def test_query_blocks_bound_the_compiled_temporaries_of_the_attention_backward():
    """At 1024 queries x 64 selected rows, blocks of 64 queries cut XLA's temporaries for value-and-grad by
    more than 4x: only one block's gathered rows and row gradients exist at a time."""
    s, t, h, x, n = 1024, 1024, 4, 160, 64
    args = (jax.ShapeDtypeStruct((1, s, h, x), jnp.float32), jax.ShapeDtypeStruct((1, t, x), jnp.float32),
            jax.ShapeDtypeStruct((1, s, n), jnp.int32))

    def temp_bytes(query_chunk):
        def loss(q, cache, indices):
            out, lse, target = sparse_latent_attention(q, cache, indices, SCALE, 128, query_chunk)
            return out.sum() + lse.sum() + target.sum()

        compiled = jax.jit(jax.grad(loss, argnums=(0, 1))).trace(*args).lower().compile()
        return compiled.memory_analysis().temp_size_in_bytes

    whole, blocked = temp_bytes(0), temp_bytes(64)
    rows_bytes = s * n * x * 4
    assert whole >= rows_bytes, (whole, rows_bytes)  # the unblocked backward does hold every gathered row
    assert blocked * 4 < whole, (blocked, whole)
