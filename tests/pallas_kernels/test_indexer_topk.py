"""Indexer score kernel and chunked top-k (interpret mode): scores equal to the jnp reference, the same
indices as jax.lax.top_k on the reference score matrix (exact ties included), masking, gradients."""

import jax
import jax.extend.core
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels import NEG_INF, indexer_scores, indexer_topk
from pallas_kernels.chunked_topk import select_topk_with_scores
from pallas_kernels.query_chunks import Band, causal_bands
from pallas_kernels.reference import indexer_scores_reference, indexer_topk_reference


def dyadic_inputs(seed, batch, q_len, num_keys, heads, head_dim, low=-2):
    """Small integers (and quarter weights) with head_dim 16 or 64, so every product, the J^-0.5 scale and
    every sum is exact in fp32: kernel and reference scores agree bit for bit and ties are real ties."""
    rng = np.random.default_rng(seed)
    q = rng.integers(low, 3, (batch, q_len, heads, head_dim)).astype(np.float32)
    k = rng.integers(-2, 3, (batch, num_keys, head_dim)).astype(np.float32)
    w = rng.integers(-4, 5, (batch, q_len, heads)).astype(np.float32) / 4
    return jnp.asarray(q), jnp.asarray(k), jnp.asarray(w)


# (batch, S, T, I, J, topk, query_chunk, q_offset, segments): query chunks and key blocks that do not divide
# S and T, topk > T (N = T), decode-style q_offset, packed segments.
CASES = {
    "segments_offset": (2, 11, 37, 4, 16, 8, 4, 26, True),
    "topk_above_keys": (1, 6, 20, 2, 64, 32, 256, 14, False),
}


def _segments(batch, q_len, num_keys, q_offset):
    k_seg = np.ones((batch, num_keys), np.int32)
    k_seg[:, num_keys // 2:] = 2
    k_seg[-1, :3] = 0
    positions = q_offset + np.arange(q_len)
    q_seg = np.broadcast_to(np.where(positions < num_keys // 2, 1, 2), (batch, q_len)).copy()
    q_seg[-1, 0] = 7  # a query whose segment has no key: all its slots are -1
    return jnp.asarray(q_seg), jnp.asarray(k_seg)


def _inputs(name):
    batch, q_len, num_keys, heads, head_dim, _, _, q_offset, segmented = CASES[name]
    q, k, w = dyadic_inputs(q_len, batch, q_len, num_keys, heads, head_dim)
    masks = dict(q_offset=q_offset)
    if segmented:
        masks["q_segment_ids"], masks["k_segment_ids"] = _segments(batch, q_len, num_keys, q_offset)
    return q, k, w, masks


@pytest.fixture(scope="module", params=sorted(CASES))
def case(request):
    topk, query_chunk = CASES[request.param][5:7]
    q, k, w, masks = _inputs(request.param)

    @jax.jit
    def run(q, k, w):
        return (indexer_scores(q, k, w, block_t=16, **masks),
                indexer_topk(q, k, w, topk=topk, query_chunk=query_chunk, block_t=16, **masks))

    scores, (indices, values) = run(q, k, w)
    return dict(q=q, k=k, w=w, masks=masks, topk=topk, scores=scores, indices=indices, values=values,
                reference=indexer_scores_reference(q, k, w, **masks))


def test_scores_equal_reference_exactly(case):
    np.testing.assert_array_equal(case["scores"], case["reference"])
    assert case["scores"].dtype == jnp.float32


def test_topk_identical_to_lax_top_k_on_reference_scores(case):
    reference = case["reference"]
    values, indices = jax.lax.top_k(reference, min(case["topk"], reference.shape[-1]))
    visible = values > NEG_INF / 2
    np.testing.assert_array_equal(case["indices"], np.where(visible, indices, -1))
    np.testing.assert_array_equal(case["values"], values)
    assert case["indices"].shape == values.shape and case["indices"].dtype == jnp.int32
    # Exact ties inside the selection (the case is built to have them) and every query's visible keys
    # counted exactly: min(N, number of visible keys) slots are valid.
    assert any(len(set(row[: int(v.sum())])) < int(v.sum()) for row, v in
               zip(np.asarray(values).reshape(-1, values.shape[-1]), np.asarray(visible).reshape(-1, values.shape[-1])))
    counts = np.sum(np.asarray(reference) > NEG_INF / 2, axis=-1)
    np.testing.assert_array_equal(np.sum(np.asarray(case["indices"]) >= 0, axis=-1),
                                  np.minimum(counts, values.shape[-1]))


def test_all_zero_scores_pick_lowest_indices_first():
    """ReLU zeros everywhere (q.k <= 0): every visible score is exactly 0 and the tie-break rule alone
    decides, so the selection is keys 0, 1, 2, ... (hand-derived), -1 past the causal horizon."""
    q = -jnp.ones((1, 5, 2, 16))
    k = jnp.ones((1, 9, 16))
    w = jnp.ones((1, 5, 2))
    indices, values = jax.jit(lambda q, k, w: indexer_topk(q, k, w, topk=4, query_chunk=2, block_t=16))(q, k, w)
    want = np.array([[0, -1, -1, -1], [0, 1, -1, -1], [0, 1, 2, -1], [0, 1, 2, 3], [0, 1, 2, 3]])
    np.testing.assert_array_equal(indices[0], want)
    np.testing.assert_array_equal(values[0], np.where(want >= 0, 0.0, np.float32(NEG_INF)))


def test_causal_bands_end_at_each_bands_last_query():
    assert causal_bands(48, 48, 0, 6) == [Band(8 * i, 8, 8 * (i + 1)) for i in range(6)]
    assert causal_bands(36, 40, 2, 9) == [Band(0, 12, 14), Band(12, 12, 26), Band(24, 12, 38)]  # 3 divides 9
    assert causal_bands(64, 64, 0, 16) == [Band(8 * i, 8, 8 * (i + 1)) for i in range(8)]  # at most 8 bands
    every_key = [Band(0, 48, 48)]
    assert causal_bands(48, 48, 0, 1) == every_key  # one chunk
    assert causal_bands(48, 48, jnp.int32(0), 6) == every_key  # an offset known only when the step runs
    assert causal_bands(48, 60, 52, 6) == [Band(0, 48, 60)]  # the first band already sees every key


def _top_k_key_lengths(fn, *args) -> list[int]:
    """The key length of every lax.top_k in fn's jaxpr (sub-jaxprs of lax.map included)."""
    lengths = []

    def visit(jaxpr):
        for eqn in jaxpr.eqns:
            if eqn.primitive.name == "top_k":
                lengths.append(eqn.invars[0].aval.shape[-1])
            for sub in jax.extend.core.jaxprs_in_params(eqn.params):
                visit(sub)

    visit(jax.make_jaxpr(fn)(*args).jaxpr)
    return lengths


@pytest.mark.parametrize("path", ["kernel", pytest.param("kernel_tpu", marks=pytest.mark.slow), "jnp"])
def test_causal_self_selection_ranks_each_bands_visible_keys_only(path):
    """S = T = 48 in 6 query chunks of 8: the top-k of each band of chunks runs over the keys its queries can
    see (8, 16, ..., 48: the first bands hold fewer keys than N = 12, so their slots are padded), and the
    selection is still lax.top_k's over every key, exact ties and packed segments included."""
    q, k, w = dyadic_inputs(5, 1, 48, 48, 32, 16)
    masks = dict(zip(("q_segment_ids", "k_segment_ids"), _segments(1, 48, 48, 0)))
    if path == "jnp":
        def select(q, k, w):
            return select_topk_with_scores(q, k, w, masks["q_segment_ids"], masks["k_segment_ids"], 12,
                                           query_chunk=8)
    else:
        platform = dict(platform="tpu", interpret=True) if path == "kernel_tpu" else {}

        def select(q, k, w):
            return indexer_topk(q, k, w, topk=12, query_chunk=8, block_t=16, **masks, **platform)
    assert _top_k_key_lengths(select, q, k, w) == [8, 16, 24, 32, 40, 48]
    indices, values = jax.jit(select)(q, k, w)
    reference = indexer_scores_reference(q, k, w, **masks)
    want_values, want_indices = jax.lax.top_k(reference, 12)
    np.testing.assert_array_equal(indices, np.where(want_values > NEG_INF / 2, want_indices, -1))
    np.testing.assert_array_equal(values, want_values)
    assert np.all(np.asarray(indices[0, :8, 8:]) == -1)  # the first band: at most 8 visible keys
    assert any(len(set(row)) < len(row) for row in np.asarray(values).reshape(-1, 12))  # real ties


@pytest.mark.slow
def test_gradients_match_reference():
    """Through indexer_scores (random cotangent) and through indexer_topk's selected scores."""
    q, k, w, masks = _inputs("segments_offset")
    d_scores = jax.random.normal(jax.random.key(0), q.shape[:2] + k.shape[1:2])

    def selected_loss(fn, **kwargs):
        def loss(q, k, w):
            indices, values = fn(q, k, w, topk=8, **masks, **kwargs)
            return jnp.sum(jnp.where(indices >= 0, jnp.sin(values), 0.0))
        return jax.grad(loss, argnums=(0, 1, 2))

    @jax.jit
    def grads(q, k, w):
        kernel = jax.vjp(lambda *a: indexer_scores(*a, block_t=16, bwd_query_chunk=4, **masks), q, k, w)[1]
        reference = jax.vjp(lambda *a: indexer_scores_reference(*a, **masks), q, k, w)[1]
        return ((kernel(d_scores), reference(d_scores)),
                (selected_loss(indexer_topk, query_chunk=4, block_t=16)(q, k, w),
                 selected_loss(indexer_topk_reference)(q, k, w)))

    # Random (non-dyadic) inputs so that the ReLU kinks and score ties are not hit exactly.
    q, k, w = (x + 0.1 * jax.random.normal(jax.random.key(i), x.shape) for i, x in enumerate((q, k, w)))
    for kernel, reference in grads(q, k, w):
        for got, want in zip(kernel, reference):
            np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4 * float(np.abs(np.asarray(want)).max()))
            assert np.abs(np.asarray(want)).max() > 0


@pytest.mark.parametrize("change, message", [
    (dict(q_index=jnp.zeros((1, 3, 2))), "q_index must have rank 4"),
    (dict(k_index=jnp.zeros((1, 8, 8))), "k_index.shape\\[-1\\]"),
    (dict(weights=jnp.zeros((1, 3, 4))), "weights.shape"),
    (dict(topk=0), "topk must be a positive int"),
    (dict(block_t=48), "block_t must be a power of two"),
    (dict(q_offset=-1), "q_offset must be >= 0"),
    (dict(q_segment_ids=jnp.zeros((1, 3), jnp.int32)), "given together"),
    (dict(q_segment_ids=jnp.zeros((1, 4), jnp.int32), k_segment_ids=jnp.zeros((1, 8), jnp.int32)),
     "q_segment_ids.shape"),
])
def test_bad_input_is_rejected_before_compiling(change, message):
    args = dict(q_index=jnp.zeros((1, 3, 2, 16)), k_index=jnp.zeros((1, 8, 16)), weights=jnp.zeros((1, 3, 2)),
                topk=4, block_t=16)
    args.update(change)
    with pytest.raises(ValueError, match=message):
        indexer_topk(args.pop("q_index"), args.pop("k_index"), args.pop("weights"), **args)
