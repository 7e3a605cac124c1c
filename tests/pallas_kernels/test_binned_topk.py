"""The binned top-k (`pallas_kernels/binned_topk.py`): `lax.top_k`'s selection bit for bit, ties, signed zeros,
NaN and masked scores included; the bin-size rule; and the TPU score kernel's on-chip bin maxima (interpret mode),
through `indexer_topk`'s values and gradients."""

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax

from pallas_kernels import NEG_INF, indexer_topk
from pallas_kernels.binned_topk import bin_maxima, bin_width, binned_topk, topk_bin_size, topk_from_bins
from pallas_kernels.reference import indexer_scores_reference, indexer_topk_reference
from pallas_kernels.tpu_indexer import tpu_indexer_scores

SPECIAL = np.array([0.0, -0.0, 1.0, -1.0, np.inf, -np.inf, np.nan, NEG_INF], np.float32)


def _rows(kind: str, rng, shape):
    if kind == "ties":  # four values: most of the top k ties with keys outside it
        return rng.integers(0, 4, shape).astype(np.float32)
    if kind == "masked":  # causal-style rows, most keys NEG_INF (fewer visible keys than k in some rows)
        x = rng.normal(size=shape).astype(np.float32)
        x[rng.random(shape) < 0.85] = NEG_INF
        return x
    if kind == "special":
        return rng.choice(SPECIAL, size=shape)
    return rng.normal(size=shape).astype(np.float32)


def _assert_same(got, want):
    (values, indices), (want_values, want_indices) = got, want
    np.testing.assert_array_equal(np.asarray(values).view(np.int32), np.asarray(want_values).view(np.int32))
    np.testing.assert_array_equal(indices, want_indices)
    assert indices.dtype == jnp.int32


@pytest.mark.parametrize("kind", ["ties", "masked", "special", "normal"])
def test_binned_topk_is_lax_top_k_bit_for_bit(kind):
    rng = np.random.default_rng(len(kind))
    top_k, binned = jax.jit(lax.top_k, static_argnums=1), jax.jit(binned_topk, static_argnums=(1, 2, 3))
    for _ in range(10):  # each draw compiles anew
        num_keys = int(rng.integers(16, 400))
        k = int(rng.integers(1, num_keys // 4))
        bin_size, align = int(rng.choice([2, 3, 4, 8])), int(rng.choice([1, 8, 128]))
        scores = jnp.asarray(_rows(kind, rng, (2, 3, num_keys)))
        _assert_same(binned(scores, k, bin_size, align), top_k(scores, k))


def test_a_tie_between_bins_goes_to_the_lowest_key_not_the_lowest_bin():
    """Strided bins {0, 2} and {1, 3} both peak at 5; key 1 (bin 1) precedes key 2 (bin 0), so ranking bins by
    their number alone would pick key 2."""
    scores = jnp.array([[0.0, 5.0, 5.0, 0.0]])
    order, first_key = bin_maxima(scores, 2)
    np.testing.assert_array_equal(first_key, [[2, 1]])
    _assert_same(topk_from_bins(scores, order, first_key, 1), lax.top_k(scores, 1))
    np.testing.assert_array_equal(binned_topk(scores, 1, bin_size=2, align=1)[1], [[1]])


def test_the_bin_size_sorts_fewest_and_only_when_it_halves_the_sort():
    assert topk_bin_size(202_752, 2048) == 8  # 25,344 maxima + 16,384 candidates
    assert topk_bin_size(65_536, 2048) == 4  # 16,384 + 8,192 (b = 8 ties and is not taken)
    assert topk_bin_size(25_344, 2048) == 1  # 6,336 + 8,192 is more than half of 25,344
    assert topk_bin_size(16_384, 2048) == 1
    assert bin_width(202_752, 2048) == 25_344 and bin_width(65_536, 2048) == 16_384
    assert bin_width(50_000, 2048, align=256) == 12_544  # 12,500 bins rounded up to whole 256-key blocks
    assert bin_width(16_384, 2048) is None
    with pytest.raises(ValueError, match="k must be in"):
        binned_topk(jnp.zeros((2, 8)), 9)


# 64 queries at positions 936.., 1000 keys, top 16: bins of 8 keys (128 of them, one 128-lane block) in every band.
Q_LEN, NUM_KEYS, TOPK, Q_OFFSET = 64, 1000, 16, 936


def _index_inputs(seed, jitter=0.0):
    rng = np.random.default_rng(seed)
    q = rng.integers(-2, 3, (1, Q_LEN, 2, 16)).astype(np.float32)
    k = rng.integers(-2, 3, (1, NUM_KEYS, 16)).astype(np.float32)
    w = rng.integers(-4, 5, (1, Q_LEN, 2)).astype(np.float32) / 4
    return tuple(jnp.asarray(x + jitter * rng.normal(size=x.shape).astype(np.float32)) for x in (q, k, w))


def test_the_tpu_score_kernel_folds_the_bin_maxima_on_chip():
    """`tpu_indexer_scores(..., bins=)` (TPU interpret mode): the scores, padded to whole slices, and bin maxima
    equal to `bin_maxima` of the unpadded scores (keys past T rank as -inf)."""
    q, k, w = _index_inputs(0)
    width = bin_width(NUM_KEYS, TOPK)
    assert width == 128
    q_pos = Q_OFFSET + jnp.arange(Q_LEN, dtype=jnp.int32)
    segments = jnp.ones((1, Q_LEN), jnp.int32), jnp.ones((1, NUM_KEYS), jnp.int32)
    scores, order, first_key = tpu_indexer_scores(q, k, w, q_pos, segments[0], segments[1], block_t=128,
                                                  interpret=True, span=(Q_OFFSET, Q_LEN, 1), bins=width)
    assert scores.shape == (1, Q_LEN, 1024)
    np.testing.assert_array_equal(scores[..., :NUM_KEYS], indexer_scores_reference(q, k, w, q_offset=Q_OFFSET))
    assert np.all(np.asarray(scores[..., NUM_KEYS:]) == NEG_INF)
    # Zeros are +0.0, as the reference's are: the top-k's total order ranks -0.0 below +0.0, and assert_array_equal
    # above does not tell them apart.
    zeros = np.asarray(scores) == 0
    assert zeros.sum() > 1000 and not np.signbit(np.asarray(scores)[zeros]).any()
    want_order, want_first = bin_maxima(indexer_scores_reference(q, k, w, q_offset=Q_OFFSET), width)
    np.testing.assert_array_equal(order, want_order)
    np.testing.assert_array_equal(first_key, want_first)


@pytest.mark.slow
def test_tpu_topk_from_on_chip_bins_selects_and_differentiates_like_the_reference():
    """indexer_topk on the TPU kernels (interpret mode) at a size where every band is binned: the selection of
    lax.top_k over the reference scores (exact ties present), and the selected scores' gradients."""
    select = jax.jit(lambda q, k, w: indexer_topk(q, k, w, topk=TOPK, query_chunk=32, block_t=128, q_offset=Q_OFFSET,
                                                  platform="tpu", interpret=True))
    q, k, w = _index_inputs(1)
    indices, values = select(q, k, w)
    want_values, want_indices = lax.top_k(indexer_scores_reference(q, k, w, q_offset=Q_OFFSET), TOPK)
    np.testing.assert_array_equal(indices, np.where(want_values > NEG_INF / 2, want_indices, -1))
    np.testing.assert_array_equal(values, want_values)
    assert any(len(set(row)) < len(row) for row in np.asarray(values)[0])  # real ties among the selected

    def loss(fn, **kwargs):
        return jax.grad(lambda *a: jnp.sum(jnp.sin(fn(*a, topk=TOPK, q_offset=Q_OFFSET, **kwargs)[1])),
                        argnums=(0, 1, 2))

    q, k, w = _index_inputs(2, jitter=0.1)  # no exact ties or ReLU kinks
    got = jax.jit(loss(indexer_topk, query_chunk=32, block_t=128, platform="tpu", interpret=True))(q, k, w)
    want = jax.jit(loss(indexer_topk_reference))(q, k, w)
    for g, r in zip(got, want):
        np.testing.assert_allclose(g, r, rtol=1e-4, atol=1e-4 * float(np.abs(np.asarray(r)).max()))
        assert np.abs(np.asarray(r)).max() > 0


@pytest.mark.slow
@pytest.mark.gpu_aot
def test_binned_topk_compiles_for_gpu():
    """The Triton path ranks its bins in XLA: one chunk's top 2048 of 202,752 scores, XLA:GPU for H100."""
    from gpu_compile import lower_for, require_cuda_plugin

    require_cuda_plugin()
    scores = jax.ShapeDtypeStruct((1, 256, 202_752), jnp.float32)
    text = lower_for(lambda x: binned_topk(x, 2048), (scores,), "h100").compile().as_text()
    sorted_rows = [int(n) for n in re.findall(r"= \((?:f32|s32)\[1,256,(\d+)\][^=]*\) sort\(", text)]
    assert sorted_rows and max(sorted_rows) < 202_752, sorted_rows  # candidates and bins, never whole rows
