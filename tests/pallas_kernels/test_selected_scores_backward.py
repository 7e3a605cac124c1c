"""The Mosaic backward of the index scores at a selection (`selected_scores_backward`, the sparse KL's gradient)
in TPU interpret mode against jax's VJP of the jnp scores the model differentiates (`gathered_scores`): unused
slots (-1 and >= T), packed segments, a query with no valid slot, N not a multiple of block_n, padded heads and
indexer dim, query chunks that do not divide S, fp32 and bf16. Shapes are tiny: every DMA is a host callback."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels import selected_scores_backward
from pallas_kernels.chunked_topk import select_topk_with_scores
from pallas_kernels.selected_scores import gathered_scores

TPU = dict(platform="tpu", interpret=True)


def _inputs(dtype, batch=2, seq=6, heads=3, dim=8, topk=21):
    """A selection over packed segments (early queries see fewer than `topk` keys: -1 slots), query (1, 2) with
    no valid slot, and a cotangent that is garbage on the unused slots (the kernel must ignore it)."""
    keys = jax.random.split(jax.random.key(3), 5)
    q = jax.random.normal(keys[0], (batch, seq, heads, dim)).astype(dtype)
    k = jax.random.normal(keys[1], (batch, 2 * seq, dim)).astype(dtype)
    w = jax.random.normal(keys[2], (batch, seq, heads))
    segments = jnp.array([[1] * 5 + [2] * 7, [1] * 2 * seq])
    # The queries are the last `seq` positions of the keys' sequence (q_offset), so slots reach T = 2 seq.
    topk, _ = select_topk_with_scores(q, k, w, segments[:, seq:], segments, topk, q_offset=seq)
    topk = topk.at[1, 2].set(-1)
    valid = topk >= 0
    assert (~valid).any() and valid.any() and topk.shape[2] % 16
    d_scores = jax.random.normal(keys[3], topk.shape)
    garbage = jnp.where(valid, d_scores, 1e3)
    return q, k, w, topk, jnp.where(valid, d_scores, 0.0), garbage


@pytest.mark.parametrize("dtype, query_chunk", [("float32", 4), ("bfloat16", 0)])
def test_backward_equals_the_vjp_of_the_gathered_scores(dtype, query_chunk):
    q, k, w, topk, d_scores, garbage = _inputs(dtype)
    _, vjp = jax.vjp(lambda q, w, k: gathered_scores(q, w, k, topk), q, w, k)
    want = vjp(d_scores)
    out_of_range = jnp.where(topk < 0, k.shape[1], topk).at[0, 0].set(-1)  # >= T is unused too
    got = jax.jit(lambda *a: selected_scores_backward(*a, block_n=16, bwd_query_chunk=query_chunk, **TPU))(
        q, k, w, jnp.where(topk < 0, out_of_range, topk), garbage)
    tol = dict(rtol=1e-5, atol=1e-5) if dtype == "float32" else dict(rtol=2e-2, atol=2e-2)
    for name, g, r in zip(("dq", "dw", "dk"), got, want):
        assert g.dtype == r.dtype and g.shape == r.shape, name
        assert np.abs(np.asarray(r, np.float32)).max() > 0, name
        np.testing.assert_allclose(np.asarray(g, np.float32), np.asarray(r, np.float32), err_msg=name, **tol)
    assert not np.asarray(got[0][1, 2]).any() and not np.asarray(got[1][1, 2]).any()  # the query with no slot


def test_bad_inputs_are_named():
    q, k, w, topk, d_scores, _ = _inputs("float32")
    with pytest.raises(ValueError, match=r"weights.shape is \(2, 6, 4\)"):
        selected_scores_backward(q, k, jnp.zeros((2, 6, 4)), topk, d_scores, **TPU)
    with pytest.raises(ValueError, match="d_scores.shape"):
        selected_scores_backward(q, k, w, topk, d_scores[:, :, :-1], **TPU)
    with pytest.raises(ValueError, match="Mosaic TPU kernel only; got platform='gpu'"):
        selected_scores_backward(q, k, w, topk, d_scores, platform="gpu", interpret=True)
    with pytest.raises(ValueError, match="bwd_query_chunk must be an int >= 0"):
        selected_scores_backward(q, k, w, topk, d_scores, bwd_query_chunk=-1, **TPU)
