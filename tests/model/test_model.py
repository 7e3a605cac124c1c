"""Model properties that do not need the HF reference: causality with pruning, backend equalities,
IndexShare, packed segments, MTP, scan, the tie-break rule, bad input."""

import dataclasses
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from param_fill import random_params

from glm5_jax.config import ModelConfig
from glm5_jax.model.mtp import shift_within_segment
from glm5_jax.model.transformer import FORWARD_STATIC_ARGNAMES, forward as pure_forward, init, merge
from pallas_kernels import chunked_topk as indexer
from glm5_jax.model.validation import InputError

forward = jax.jit(pure_forward, static_argnames=FORWARD_STATIC_ARGNAMES)

TINY = ModelConfig(vocab_size=97, hidden_size=32, intermediate_size=48, moe_intermediate_size=16,
                   num_hidden_layers=3, num_attention_heads=2, q_lora_rank=16, kv_lora_rank=16,
                   qk_nope_head_dim=8, qk_rope_head_dim=4, v_head_dim=8, n_routed_experts=8,
                   num_experts_per_tok=2, n_group=2, topk_group=1, first_k_dense_replace=1, index_n_heads=4,
                   index_head_dim=8, index_topk=4, mtp_num_steps=3, compute_dtype="float32",
                   attention_backend="sparse", moe_backend="ragged").validate()


@pytest.fixture(scope="module")
def params():
    return random_params(TINY, seed=0)  # init's layout and scales, without compiling init op by op


def _tokens(seed, shape=(2, 16)):
    return jax.random.randint(jax.random.key(seed), shape, 0, TINY.vocab_size)


@pytest.mark.parametrize("backend", ["dense", "sparse"])
def test_future_tokens_never_change_earlier_logits(params, backend):
    config = dataclasses.replace(TINY, attention_backend=backend)
    tokens = _tokens(1)
    p = 9
    changed = tokens.at[:, p + 1:].set((tokens[:, p + 1:] + 7) % TINY.vocab_size)
    a = forward(params, tokens, config=config)
    b = forward(params, changed, config=config)
    np.testing.assert_array_equal(np.asarray(a.logits[:, : p + 1]), np.asarray(b.logits[:, : p + 1]))
    assert not np.allclose(a.logits[:, p + 1:], b.logits[:, p + 1:])
    # MTP depth k reads t_{i+k}: positions i <= p - k are untouched by the change.
    for k in range(1, TINY.mtp_num_steps + 1):
        np.testing.assert_array_equal(np.asarray(a.mtp_logits[k - 1, :, : p + 1 - k]),
                                      np.asarray(b.mtp_logits[k - 1, :, : p + 1 - k]))


@pytest.mark.slow
def test_short_sequences_are_exactly_dense(params):
    tokens = _tokens(2, (2, TINY.index_topk))  # T <= index_topk: every causal key is selected
    sparse = forward(params, tokens, config=TINY, collect_routing=True)
    no_pruning = dataclasses.replace(TINY, index_topk=10_000, attention_backend="dense")
    dense = forward(params, tokens, config=no_pruning)
    np.testing.assert_allclose(sparse.logits, dense.logits, atol=1e-5)
    topk = np.asarray(sparse.aux["topk"])
    for s in range(tokens.shape[1]):
        assert set(topk[0, 0, s][topk[0, 0, s] >= 0]) == set(range(s + 1))


def test_sparse_equals_dense_and_absorbed_equals_expanded(params):
    tokens = _tokens(3)  # the causality test's shape: both forwards are compiled already
    dense = forward(params, tokens, config=dataclasses.replace(TINY, attention_backend="dense"))
    sparse = forward(params, tokens, config=TINY)
    np.testing.assert_allclose(sparse.logits, dense.logits, atol=1e-5)
    np.testing.assert_allclose(sparse.mtp_logits, dense.mtp_logits, atol=1e-5)


@pytest.mark.slow
def test_absorbed_attention_equals_expanded_on_all_keys(params):
    from glm5_jax.model.layers import rope_angles
    from pallas_kernels.sparse_latent import sparse_latent_attention

    graph, stacked = nnx.split(merge(params, TINY).dense_layers.attn)
    attn = nnx.merge(graph, jax.tree.map(lambda a: a[0], stacked))  # the first layer's MLA
    x = jax.random.normal(jax.random.key(4), (1, 6, TINY.hidden_size))
    cos, sin = rope_angles(jnp.arange(6)[None], TINY.qk_rope_head_dim, TINY.rope_theta)
    proj = attn.project(x, cos, sin)
    allowed = jnp.tril(jnp.ones((6, 6), bool))[None]
    expanded = attn.expanded_attention(proj, allowed)
    indices = jnp.where(allowed, jnp.arange(6)[None, None], -1)
    latent = sparse_latent_attention(attn.absorbed_queries(proj), proj.rows, indices, TINY.softmax_scale,
                                     TINY.kv_lora_rank)[0]
    np.testing.assert_allclose(attn.latent_to_heads(latent), expanded, atol=1e-5)


@pytest.mark.slow
def test_moe_backends_agree_values_and_gradients(params):
    tokens = _tokens(5, (2, 12))

    def loss(p, backend):
        out = forward(p, tokens, config=dataclasses.replace(TINY, moe_backend=backend), mtp_steps=1)
        return jnp.mean(out.logits**2) + jnp.mean(out.mtp_logits**2)

    value_and_grad = jax.jit(jax.value_and_grad(loss), static_argnums=1)
    ref_val, ref_grad = value_and_grad(params, "reference")
    rag_val, rag_grad = value_and_grad(params, "ragged")
    np.testing.assert_allclose(rag_val, ref_val, rtol=1e-5)
    for a, b in zip(jax.tree.leaves(rag_grad), jax.tree.leaves(ref_grad)):
        np.testing.assert_allclose(a, b, atol=1e-6)


@pytest.mark.slow
def test_packed_segments_never_interact(params):
    a, b = _tokens(6, (1, 9)), _tokens(7, (1, 7))
    packed = jnp.concatenate([a, b], axis=1)
    segment_ids = jnp.array([[1] * 9 + [2] * 7])
    positions = jnp.array([list(range(9)) + list(range(7))])
    out = forward(params, packed, config=TINY, segment_ids=segment_ids, positions=positions)
    # a and b each run alone, as the rows of one [2, 16] batch (the causality test's program): the tokens after
    # them are outside every position compared below (causal attention, top-k and MTP reads).
    alone = forward(params, jnp.concatenate([packed, jnp.roll(packed, -9, axis=1)]), config=TINY)
    np.testing.assert_allclose(out.logits[:, :9], alone.logits[:1, :9], atol=1e-5)
    np.testing.assert_allclose(out.logits[:, 9:], alone.logits[1:, :7], atol=1e-5)
    # MTP: positions whose shifted token stays inside the segment match the unpacked run.
    for k in range(1, 4):
        np.testing.assert_allclose(out.mtp_logits[k - 1, :, : 9 - k], alone.mtp_logits[k - 1, :1, : 9 - k],
                                   atol=1e-5)
        np.testing.assert_allclose(out.mtp_logits[k - 1, :, 9: 16 - k], alone.mtp_logits[k - 1, 1:, : 7 - k],
                                   atol=1e-5)


@pytest.mark.slow
def test_index_share_layers_reuse_previous_topk():
    config = dataclasses.replace(TINY, num_hidden_layers=4, indexer_types=("full", "shared", "shared", "full"))
    p = init(config, jax.random.key(1))
    assert p["indexers"]["wk"]["kernel"].shape[0] == 2  # only full layers own an indexer
    topk = np.asarray(forward(p, _tokens(8), config=config, collect_routing=True).aux["topk"])
    np.testing.assert_array_equal(topk[1], topk[0])
    np.testing.assert_array_equal(topk[2], topk[0])
    assert not np.array_equal(topk[3], topk[0])


@pytest.mark.slow
def test_mtp_shares_one_parameter_set_and_matches_a_direct_loop(params):
    from glm5_jax.model.context import LayerContext
    from glm5_jax.model.layers import rms_norm, rope_angles

    assert "mtp" in params and "layers" not in params["mtp"]  # one module, no per-depth copies
    tokens = _tokens(9, (1, 12))
    out = forward(params, tokens, config=TINY)
    assert out.mtp_logits.shape == (3, 1, 12, TINY.vocab_size)
    mtp, eps = params["mtp"], TINY.rms_norm_eps
    cos, sin = rope_angles(jnp.arange(12)[None], TINY.qk_rope_head_dim, TINY.rope_theta)
    h = out.hidden
    mtp_layer = merge(params, TINY).mtp.layer
    layer_fn = jax.jit(lambda x, ctx: mtp_layer(x, ctx).hidden)  # the MTP layer with its own indexer
    for k in range(1, 4):
        # Depth k at position i reads t_{i+k}; it is compared where i+k is inside the sequence.
        n = 12 - k
        emb = params["embed"]["embedding"][tokens[:, k:]]
        x = jnp.concatenate([rms_norm(emb, mtp["enorm"]["scale"], eps),
                             rms_norm(h[:, :n], mtp["hnorm"]["scale"], eps)], -1) @ mtp["eh_proj"]["kernel"]
        ctx = LayerContext(cos[:, :n], sin[:, :n], jnp.ones((1, n), jnp.int32), jnp.ones((1, n), bool))
        h = layer_fn(x, ctx)
        logits = rms_norm(h, mtp["shared_head_norm"]["scale"], eps) @ params["lm_head"]["kernel"]
        np.testing.assert_allclose(out.mtp_logits[k - 1, :, :n], logits, atol=1e-5)


def test_shift_within_segment_marks_targets_across_boundaries():
    tokens = jnp.array([[10, 11, 12, 20, 21]])
    seg = jnp.array([[1, 1, 1, 2, 2]])
    shifted, valid = shift_within_segment(tokens, seg, 1)
    np.testing.assert_array_equal(shifted, [[11, 12, 0, 21, 0]])
    np.testing.assert_array_equal(valid, [[True, True, False, True, False]])


def test_scan_keeps_the_jaxpr_independent_of_depth():
    def size(layers):
        config = dataclasses.replace(TINY, num_hidden_layers=layers, mtp_num_steps=0)
        shapes = jax.eval_shape(lambda: init(config, jax.random.key(0)))
        jaxpr = jax.make_jaxpr(lambda p, t: forward(p, t, config=config).logits)(shapes, jnp.zeros((1, 8), jnp.int32))
        # Shapes print the layer count (3 vs 24); everything else must be identical.
        return re.sub(r"\s+", " ", re.sub(r"\d+", "N", str(jaxpr)))

    assert size(24) == size(3)


@pytest.mark.slow
def test_unrolled_layers_equal_scanned_layers(params):
    """scan_layers false (MaxText's name) unrolls the layer stacks: same logits, MTP outputs and gradients."""
    tokens = jnp.asarray(np.random.RandomState(3).randint(0, TINY.vocab_size, (2, 12)), jnp.int32)
    unrolled = dataclasses.replace(TINY, scan_layers=False)

    def loss(p, config):
        out = forward(p, tokens, config=config)
        return jnp.sum(jnp.sin(out.logits)) + sum(jnp.sum(jnp.cos(h)) for h in jax.tree.leaves(out.mtp_hidden))

    value_and_grad = jax.jit(jax.value_and_grad(loss), static_argnums=1)  # one program each, not op by op
    scanned_loss, scanned_grads = value_and_grad(params, TINY)
    unrolled_loss, unrolled_grads = value_and_grad(params, unrolled)
    np.testing.assert_allclose(unrolled_loss, scanned_loss, rtol=1e-5)
    for got, want in zip(jax.tree.leaves(unrolled_grads), jax.tree.leaves(scanned_grads)):
        np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-5)
    with pytest.raises(Exception, match="scan_layers"):
        dataclasses.replace(TINY, scan_layers="no").validate()


def test_topk_tie_break_takes_the_lowest_index_first():
    # Keys 1..5 all score exactly 0 (ReLU); key 0 is invisible to nobody; k=3 must take 0 (largest) then 1, 2.
    scores = jnp.array([[[5.0, 0.0, 0.0, 0.0, 0.0, 0.0]]])
    np.testing.assert_array_equal(indexer.topk_with_scores(scores, 3)[0], [[[0, 1, 2]]])
    masked = jnp.array([[[1.0, -1e30, -1e30]]])
    np.testing.assert_array_equal(indexer.topk_with_scores(masked, 3)[0], [[[0, -1, -1]]])


# Jitted as the model runs it: one program per call, where op by op every band's `lax.map` compiles on its own.
select_topk = jax.jit(indexer.select_topk, static_argnames=("topk", "q_offset", "query_chunk", "key_block"))


@pytest.mark.parametrize("seq, query_chunk, topk", [(16, 4, 5), (48, 4, 7), (48, 6, 9), (40, 4, 40)])
def test_query_chunked_indexer_matches_unchunked(seq, query_chunk, topk):
    """Blocks of queries grouped into causal key bands (up to 8; 48 / 6 gives 8 bands of 6 queries, 48 / 4 gives
    6 bands of 8) select exactly what one [S, T] score matrix does, packed segments and slots padded with -1
    where a band has fewer keys than top-k included."""
    q = jax.random.normal(jax.random.key(10), (2, seq, 4, 8))
    k = jax.random.normal(jax.random.key(11), (2, seq, 8))
    w = jax.random.normal(jax.random.key(12), (2, seq, 4))
    seg = jnp.stack([jnp.ones(seq, jnp.int32), jnp.repeat(jnp.arange(4), seq // 4)])
    full = select_topk(q, k, w, seg, seg, topk)
    chunked = select_topk(q, k, w, seg, seg, topk, query_chunk=query_chunk)
    assert chunked.shape == full.shape == (2, seq, topk)
    np.testing.assert_array_equal(full, chunked)
    # With a query offset (queries after a prefix) the bands are off and every block scores every key.
    offset = select_topk(q[:, seq // 2:], k, w[:, seq // 2:], seg[:, seq // 2:], seg, topk, seq // 2,
                         query_chunk=query_chunk)
    np.testing.assert_array_equal(full[:, seq // 2:], offset)


@pytest.mark.parametrize("key_block, query_chunk, topk", [(5, 0, 9), (16, 6, 9), (7, 4, 40)])
def test_running_topk_over_key_blocks_equals_one_topk_over_all_keys(key_block, query_chunk, topk):
    """Keys scored `key_block` at a time (not dividing T = 48) and merged into a running top-k select exactly
    what one top-k over every key does: ties at the ReLU's exact zeros (about 1 key in 16 here) by lowest index,
    packed segments, slots past the visible keys -1 (topk 40), with a static or a traced query offset."""
    seq = 48
    q = jax.random.normal(jax.random.key(10), (2, seq, 4, 8))
    k = jax.random.normal(jax.random.key(11), (2, seq, 8))
    w = jax.random.normal(jax.random.key(12), (2, seq, 4))
    seg = jnp.stack([jnp.ones(seq, jnp.int32), jnp.repeat(jnp.arange(4), seq // 4)])
    full = select_topk(q, k, w, seg, seg, topk)
    assert (indexer.index_scores(q, k, w, seg, seg) == 0).sum() > 50  # ties the merge must break like top_k
    blocked = select_topk(q, k, w, seg, seg, topk, query_chunk=query_chunk, key_block=key_block)
    np.testing.assert_array_equal(blocked, full)
    traced = jax.jit(lambda offset: indexer.select_topk(q[:, seq // 2:], k, w[:, seq // 2:], seg[:, seq // 2:], seg,
                                                        topk, offset, key_block=key_block))(jnp.int32(seq // 2))
    np.testing.assert_array_equal(traced, full[:, seq // 2:])


@pytest.mark.parametrize("bad, message", [
    (lambda t: t.at[0, 3].set(97), "outside the vocabulary"),
    (lambda t: t.at[1, 0].set(-1), "outside the vocabulary"),
    (lambda t: t.astype(jnp.float32), "integer"),
    (lambda t: t[0], "rank 2"),
])
def test_bad_tokens_are_rejected_with_clear_errors(params, bad, message):
    with pytest.raises(InputError, match=message):
        pure_forward(params, bad(_tokens(13)), config=TINY)  # values are checked where they are concrete


def test_bad_segment_ids_and_positions_are_rejected(params):
    tokens = _tokens(14, (1, 6))
    with pytest.raises(InputError, match="segment_ids has shape"):
        pure_forward(params, tokens, config=TINY, segment_ids=jnp.ones((1, 5), jnp.int32))
    with pytest.raises(InputError, match="not contiguous"):
        pure_forward(params, tokens, config=TINY, segment_ids=jnp.array([[1, 1, 2, 2, 1, 1]]))
    with pytest.raises(InputError, match="positions"):
        pure_forward(params, tokens, config=TINY, positions=jnp.full((1, 6), -1))
    wrong_shape = dataclasses.replace(TINY, hidden_size=64)
    with pytest.raises(InputError, match="another model shape"):
        pure_forward(params, tokens, config=wrong_shape)


@pytest.mark.parametrize("block", [1, 4, 128])
def test_grouped_expert_layouts_equal_the_reference(block):
    from glm5_jax.model import experts as dispatch

    rng = np.random.RandomState(0)
    e, d, f, t, a = 6, 8, 5, 11, 2
    experts = {"gate_proj": jnp.asarray(rng.randn(e, d, f), jnp.float32),
               "up_proj": jnp.asarray(rng.randn(e, d, f), jnp.float32),
               "down_proj": jnp.asarray(rng.randn(e, f, d), jnp.float32)}
    x = jnp.asarray(rng.randn(t, d), jnp.float32)
    ids = jnp.asarray(np.stack([rng.choice(e - 1, a, replace=False) for _ in range(t)]), jnp.int32)  # e-1 unused
    w = jnp.asarray(rng.rand(t, a), jnp.float32)

    def loss(fn, ex, xx, ww):
        return jnp.sum(fn(ex, xx, ids, ww) ** 2)

    def grouped_ragged(ex_, x_, i_, w_):
        order = jnp.argsort(i_.reshape(-1), stable=True)
        sizes = jnp.bincount(i_.reshape(-1), length=e).astype(jnp.int32)
        out = dispatch.grouped_swiglu(ex_, x_[order // a], sizes) * w_.reshape(-1)[order][:, None]
        return jnp.zeros_like(x_).at[order // a].add(out)

    # Gradients in the expert weights, the tokens and the routing weights (the router learns through them).
    # Jitted: op-by-op dispatch of block=1's many small matmuls costs more than one compile.
    grad = lambda fn: jax.jit(jax.value_and_grad(fn, argnums=(0, 1, 2)))  # noqa: E731
    reference = grad(lambda ex, xx, ww: loss(dispatch.experts_reference, ex, xx, ww))(experts, x, w)
    blocked = grad(lambda ex, xx, ww: loss(lambda *z: dispatch.experts_blocked(*z, block=block), ex, xx, ww))(
        experts, x, w)
    grouped = grad(lambda ex, xx, ww: loss(grouped_ragged, ex, xx, ww))(experts, x, w)
    gathered = grad(lambda ex, xx, ww: loss(dispatch.experts_gathered, ex, xx, ww))(experts, x, w)
    for got in (blocked, grouped, gathered):
        np.testing.assert_allclose(got[0], reference[0], rtol=1e-5)
        for g, r in zip(jax.tree.leaves(got[1]), jax.tree.leaves(reference[1])):
            np.testing.assert_allclose(g, r, rtol=1e-4, atol=1e-4)


def test_ragged_dispatch_gathers_expert_weights_only_when_there_are_no_more_assignments_than_experts():
    from glm5_jax.model import experts as dispatch

    e, d, f, a = 8, 4, 3, 2
    experts = {"gate_proj": jnp.ones((e, d, f)), "up_proj": jnp.ones((e, d, f)), "down_proj": jnp.ones((e, f, d))}

    def ops(tokens):
        args = (experts, jnp.ones((tokens, d)), jnp.zeros((tokens, a), jnp.int32), jnp.ones((tokens, a)))
        return str(jax.make_jaxpr(lambda *z: dispatch.experts_ragged(*z, platform="cpu"))(*args))

    assert " sort[" not in ops(e // a) and "while" not in ops(e // a)  # a decode step: gathered weights
    assert " sort[" in ops(e // a + 1)  # more assignments than experts: the sorted, blocked dispatch


def test_auto_attention_backend_picks_dense_only_for_few_keys_per_selection_and_bounded_scores():
    from glm5_jax.model.attention import AUTO_DENSE_MAX_SCORE_BYTES, choose_backend

    auto = dataclasses.replace(TINY, attention_backend="auto")
    n = auto.index_topk
    assert choose_backend(auto, batch=2, num_queries=4 * n, num_keys=4 * n) == "dense"
    assert choose_backend(auto, batch=2, num_queries=4 * n + 1, num_keys=4 * n + 1) == "sparse"
    too_big = AUTO_DENSE_MAX_SCORE_BYTES // (4 * auto.num_attention_heads * n * n) + 1
    assert choose_backend(auto, batch=too_big, num_queries=n, num_keys=n) == "sparse"
    for fixed in ("dense", "sparse", "pallas"):
        assert choose_backend(dataclasses.replace(TINY, attention_backend=fixed), 1, 10**6, 10**6) == fixed
