"""Indexer KL targets (interpret mode) against dense jnp computations: the sparse target from the sparse
kernel's lse, the blockwise dense warm-up target, and their agreement when the selection covers every key; the
attention with its target (`sparse_mla_attention_with_target`) on the Triton path, which composes the two."""

import jax
import jax.numpy as jnp
import numpy as np

from pallas_kernels import (
    dense_attention_target,
    sparse_attention_target,
    sparse_mla_attention,
    sparse_mla_attention_with_target,
)
from pallas_kernels.reference import (
    dense_attention_target_reference,
    sparse_attention_target_reference,
    sparse_mla_attention_reference,
)

SCALE = 0.15


def _inputs(seed, batch, q_len, num_keys, heads, width):
    keys = jax.random.split(jax.random.key(seed), 2)
    return (jax.random.normal(keys[0], (batch, q_len, heads, width)),
            jax.random.normal(keys[1], (batch, num_keys, width)))


def test_sparse_target_matches_reference_and_dense_when_all_keys_selected():
    """Selecting every causal key (slots in shuffled order, the rest -1) makes the sparse target the dense
    one, scattered: an independent check of both, on top of the jnp reference."""
    batch, q_len, heads, width = 2, 7, 4, 48
    q, latent = _inputs(0, batch, q_len, q_len, heads, width)
    rng = np.random.default_rng(0)
    indices = np.full((batch, q_len, 20), -1, np.int32)
    for b in range(batch):
        for s in range(q_len):
            indices[b, s, rng.choice(20, size=s + 1, replace=False)] = rng.permutation(s + 1)
    indices = jnp.asarray(indices)
    indices = indices.at[1, 3].set(-1)  # a query without valid slots: all-zero target row

    @jax.jit
    def run(q, latent):  # the lse of the attention kernel's reference (the kernel's own is tested to match it)
        _, lse = sparse_mla_attention_reference(q, latent, indices, scale=SCALE, kv_lora_rank=32)
        return (lse, sparse_attention_target(q, latent, indices, lse, scale=SCALE, block_n=16),
                dense_attention_target(q, latent, scale=SCALE, block_t=16))

    lse, sparse, dense = run(q, latent)
    np.testing.assert_allclose(sparse, sparse_attention_target_reference(q, latent, indices, lse, scale=SCALE),
                               rtol=1e-5, atol=1e-6)
    assert sparse.shape == indices.shape and sparse.dtype == jnp.float32
    assert np.all(np.asarray(sparse)[np.asarray(indices) < 0] == 0)
    row_sums = np.asarray(np.sum(sparse, axis=-1))
    np.testing.assert_allclose(np.delete(row_sums.reshape(-1), q_len + 3), 1.0, rtol=1e-5)
    assert row_sums[1, 3] == 0
    scattered = np.zeros((batch, q_len, q_len), np.float32)
    idx = np.asarray(indices)
    for b, s, n in zip(*np.nonzero(idx >= 0)):
        scattered[b, s, idx[b, s, n]] = sparse[b, s, n]
    keep = np.ones((batch, q_len), bool)
    keep[1, 3] = False
    np.testing.assert_allclose(scattered[keep], np.asarray(dense)[keep], rtol=1e-5, atol=1e-6)


def test_sparse_target_of_programs_that_stop_early_matches_reference():
    """Valid slots first and -1 last, as the indexer's top-k returns them (the Triton programs stop after each
    query's last block with a valid slot and write 0 to the blocks after it): still the reference's target."""
    batch, q_len, num_keys, heads, width, num_slots = 2, 6, 30, 4, 48, 40
    q, latent = _inputs(1, batch, q_len, num_keys, heads, width)
    rng = np.random.default_rng(1)
    indices = np.full((batch, q_len, num_slots), -1, np.int32)
    for b in range(batch):
        for s in range(q_len):
            count = int(rng.integers(0, 21))  # 0 to 20 valid slots: no, one or two blocks of 16 visited
            indices[b, s, :count] = rng.choice(num_keys, size=count, replace=False)
    indices = jnp.asarray(indices)

    @jax.jit
    def run(q, latent):
        _, lse = sparse_mla_attention_reference(q, latent, indices, scale=SCALE, kv_lora_rank=32)
        return lse, sparse_attention_target(q, latent, indices, lse, scale=SCALE, block_n=16, platform="gpu")

    lse, sparse = run(q, latent)
    np.testing.assert_allclose(sparse, sparse_attention_target_reference(q, latent, indices, lse, scale=SCALE),
                               rtol=1e-5, atol=1e-6)
    assert np.all(np.asarray(sparse)[np.asarray(indices) < 0] == 0)


def test_dense_target_with_segments_and_offset_matches_reference():
    """Packed segments, a decode-style q_offset, T not a multiple of block_t, a single head (15 padded kernel
    heads that must add nothing) and a query whose segment has no visible key (all-zero row)."""
    batch, q_len, num_keys = 2, 6, 21
    q_seg = jnp.array([[1, 1, 2, 2, 2, 2], [3, 1, 1, 1, 1, 1]], jnp.int32)
    k_seg = jnp.array([[1] * 17 + [2] * 4, [1] * 21], jnp.int32)
    q, latent = _inputs(1, batch, q_len, num_keys, 1, 40)
    masks = dict(q_segment_ids=q_seg, k_segment_ids=k_seg, q_offset=15)
    target, want = jax.jit(lambda q, latent: (dense_attention_target(q, latent, scale=SCALE, block_t=16, **masks),
                                              dense_attention_target_reference(q, latent, scale=SCALE, **masks)))(
        q, latent)
    np.testing.assert_allclose(target, want, rtol=1e-5, atol=1e-6)
    assert np.all(np.asarray(target[1, 0]) == 0)  # segment 3 has no key
    np.testing.assert_allclose(np.sum(target[0], axis=-1), 1.0, rtol=1e-5)


def test_dense_reference_matches_float64_loop():
    """The dense reference itself against a direct float64 numpy loop (causal, one segment)."""
    q, latent = _inputs(3, 1, 3, 5, 2, 8)
    q64, latent64 = np.asarray(q, np.float64), np.asarray(latent, np.float64)
    got = jax.jit(lambda q, latent: dense_attention_target_reference(q, latent, scale=SCALE, q_offset=2))(q, latent)
    for s in range(3):
        visible = latent64[0, : s + 3]
        logits = SCALE * q64[0, s] @ visible.T
        p = np.exp(logits - logits.max(axis=1, keepdims=True))
        head_sum = (p / p.sum(axis=1, keepdims=True)).sum(axis=0)
        np.testing.assert_allclose(got[0, s, : s + 3], head_sum / head_sum.sum(), rtol=1e-5)
        assert np.all(np.asarray(got[0, s, s + 3:]) == 0)


def test_attention_with_target_on_gpu_is_the_two_kernels():
    """platform "gpu": out, lse and dq / d latent of sparse_mla_attention, the target sparse_attention_target's
    from that lse, and no gradient through the target (its cotangent changes nothing)."""
    batch, q_len, num_keys, heads, width, num_slots = 1, 3, 12, 4, 48, 8
    q, latent = _inputs(2, batch, q_len, num_keys, heads, width)
    indices = jax.random.randint(jax.random.key(3), (batch, q_len, num_slots), -1, num_keys + 2).astype(jnp.int32)
    d_out = jax.random.normal(jax.random.key(4), (batch, q_len, heads, 32))
    d_lse = jax.random.normal(jax.random.key(5), (batch, q_len, heads))
    options = dict(scale=SCALE, kv_lora_rank=32, block_n=16, platform="gpu")

    @jax.jit
    def run(q, latent):
        (out, lse, target), vjp = jax.vjp(lambda q_, l_: sparse_mla_attention_with_target(q_, l_, indices, **options),
                                          q, latent)
        (want_out, want_lse), want_vjp = jax.vjp(lambda q_, l_: sparse_mla_attention(q_, l_, indices, **options),
                                                 q, latent)
        want_target = sparse_attention_target(q, latent, indices, want_lse, scale=SCALE, block_n=16, platform="gpu")
        return ((out, lse, target, *vjp((d_out, d_lse, jnp.ones_like(target)))),
                (want_out, want_lse, want_target, *want_vjp((d_out, d_lse))))

    for name, got, want in zip(("out", "lse", "target", "dq", "dlatent"), *run(q, latent)):
        np.testing.assert_array_equal(got, want, err_msg=name)
