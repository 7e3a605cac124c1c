"""The training step: losses against hand computations, exact accumulation, DSA gradient isolation,
aux-loss-free balancing, resumable runs and clear failures."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from param_fill import random_params

from glm5_jax.config import ConfigError, ModelConfig, TrainConfig
from glm5_jax.model import moe
from glm5_jax.model.indexer_kl import _kl
from glm5_jax.model.transformer import forward
from glm5_jax.train import losses
from glm5_jax.train.optim import OptimConfig, make_optimizer
from glm5_jax.train.step import init_train_state, make_train_step

MODEL = ModelConfig(vocab_size=64, hidden_size=32, intermediate_size=48, moe_intermediate_size=16,
                    num_hidden_layers=2, num_attention_heads=2, q_lora_rank=16, kv_lora_rank=16,
                    qk_nope_head_dim=8, qk_rope_head_dim=4, v_head_dim=8, n_routed_experts=4,
                    num_experts_per_tok=2, first_k_dense_replace=1, index_n_heads=2, index_head_dim=8,
                    index_topk=4, mtp_num_steps=2, compute_dtype="float32").validate()


def _batch(seed=0, b=4, s=12):
    rng = np.random.RandomState(seed)
    seg = np.ones((b, s), np.int32)
    seg[0, 7:] = 2  # a packed row
    seg[1, 10:] = 0  # padding
    pos = np.concatenate([np.arange(7), np.arange(5)])[None].repeat(b, 0).astype(np.int32)
    pos[1:] = np.arange(s)
    mask = (seg > 0).astype(np.int32)
    mask[2, :5] = 0  # e.g. a prompt without loss
    return {"tokens": jnp.asarray(rng.randint(0, MODEL.vocab_size, (b, s)), jnp.int32),
            "segment_ids": jnp.asarray(seg), "positions": jnp.asarray(pos), "loss_mask": jnp.asarray(mask)}


def _log_softmax(x):
    x = x - x.max(-1, keepdims=True)
    return x - np.log(np.exp(x).sum(-1, keepdims=True))


def test_cross_entropy_and_mtp_loss_match_a_hand_loop():
    rng = np.random.RandomState(0)
    b, s, d, v = 2, 7, 5, 11
    hidden = rng.randn(b, s, d).astype(np.float32)
    mtp_hidden = rng.randn(2, b, s, d).astype(np.float32)
    kernel = rng.randn(d, v).astype(np.float32)
    tokens = rng.randint(0, v, (b, s))
    seg = np.array([[1, 1, 1, 2, 2, 2, 2], [1, 1, 1, 1, 1, 0, 0]])
    mask = (seg > 0).astype(np.int32)
    mask[1, 2] = 0
    logp = _log_softmax(hidden @ kernel)
    expected, count = 0.0, 0
    for i in range(b):
        for t in range(s - 1):
            if seg[i, t] > 0 and seg[i, t + 1] == seg[i, t] and mask[i, t + 1]:
                expected -= logp[i, t, tokens[i, t + 1]]
                count += 1
    total, denom = losses.cross_entropy(jnp.asarray(hidden), jnp.asarray(kernel), jnp.asarray(tokens),
                                        jnp.asarray(seg), jnp.asarray(mask), vocab_chunk=4)
    np.testing.assert_allclose(total, expected, rtol=1e-5)
    assert denom == count
    expected, count = 0.0, 0
    for k in (1, 2):  # depth k predicts t_{i+k+1}
        lp = _log_softmax(mtp_hidden[k - 1] @ kernel)
        for i in range(b):
            for t in range(s - k - 1):
                if seg[i, t] > 0 and seg[i, t + k + 1] == seg[i, t] and mask[i, t + k + 1]:
                    expected -= lp[i, t, tokens[i, t + k + 1]]
                    count += 1
    total, denom = losses.mtp_cross_entropy(jnp.asarray(mtp_hidden), jnp.asarray(kernel), jnp.asarray(tokens),
                                            jnp.asarray(seg), jnp.asarray(mask), vocab_chunk=4)
    np.testing.assert_allclose(total, expected, rtol=1e-5)
    assert denom == count


def test_sequence_balance_loss_matches_the_formula():
    scores = jnp.array([[[0.9, 0.1, 0.5, 0.2], [0.3, 0.8, 0.1, 0.6], [0.5, 0.5, 0.5, 0.5]]])
    expert_ids = jnp.array([[[0, 2], [1, 3], [0, 1]]])
    token_mask = jnp.array([[True, True, False]])
    config = dataclasses.replace(MODEL, num_experts_per_tok=2)
    got = moe.sequence_balance_terms(scores, expert_ids, token_mask, config)
    e, k, t = 4, 2, 2
    f = np.zeros(e)
    for row in ([0, 2], [1, 3]):
        for i in row:
            f[i] += e / (k * t)
    s = np.asarray(scores[0, :2])
    p = (s / s.sum(-1, keepdims=True)).mean(0)
    np.testing.assert_allclose(got, [np.sum(f * p)], rtol=1e-6)


def test_indexer_kl_matches_the_definition():
    p = jnp.array([[[0.5, 0.5, 0.0, 0.0]]])
    logits = jnp.array([[[1.0, 2.0, 3.0, 9.0]]])
    valid = jnp.array([[[True, True, True, False]]])
    q = np.exp([1.0, 2.0, 3.0]) / np.exp([1.0, 2.0, 3.0]).sum()
    expected = 0.5 * np.log(0.5 / q[0]) + 0.5 * np.log(0.5 / q[1])
    np.testing.assert_allclose(_kl(p, logits, valid), [[expected]], rtol=1e-6)


def _train_config(mode="pretrain", microbatches=1, bias_rate=1e-3):
    return TrainConfig(mode=mode, batch_size=4, seq_len=12, microbatches=microbatches, vocab_chunk=32,
                       bias_update_rate=bias_rate)


def _step(mode="pretrain", lr=1e-2, trainable="all", bias_rate=1e-3):
    """A step over AdamW built by `make_optimizer` (its trainable groups), as `glm5 train` builds it."""
    optim = OptimConfig(name="adamw", lr=lr, min_lr=0.0, warmup_steps=1, total_steps=10, schedule="constant",
                        weight_decay=0.0, trainable=trainable)
    params = random_params(MODEL, seed=0)  # init's layout and scales, without compiling init op by op
    tx = make_optimizer(optim, params, config=MODEL)
    return make_train_step(MODEL, _train_config(mode, bias_rate=bias_rate), tx), init_train_state(params, tx)


SGD_LR = 1e-2


@pytest.fixture(scope="module")
def sgd_steps():
    """Steps over plain SGD with 1 and 4 microbatches, built once for the microbatch and bias tests. SGD's
    update is linear in the gradient (Adam would amplify fp32 summation noise in near-zero gradients to
    lr-sized steps), and it compiles in a fraction of AdamW's time (about 4 s vs 14 s of CPU here)."""
    return {n: make_train_step(MODEL, _train_config(microbatches=n), optax.sgd(SGD_LR)) for n in (1, 4)}


def _sgd_state():
    return init_train_state(random_params(MODEL, seed=0), optax.sgd(SGD_LR))  # a fresh one: the step donates it


@pytest.mark.slow
def test_four_microbatches_equal_one_step_on_the_whole_batch(sgd_steps):
    batch = _batch()
    new1, m1 = sgd_steps[1](_sgd_state(), batch)
    new4, m4 = sgd_steps[4](_sgd_state(), batch)
    for key in ("loss", "lm_loss", "mtp_loss", "balance_loss", "grad_norm"):
        np.testing.assert_allclose(m4[key], m1[key], rtol=2e-5, err_msg=key)
    for (path, a), b in zip(jax.tree_util.tree_flatten_with_path(new4.params)[0], jax.tree.leaves(new1.params)):
        np.testing.assert_allclose(a, b, atol=1e-6, err_msg=jax.tree_util.keystr(path))


def _is_indexer(path) -> bool:
    keys = jax.tree_util.keystr(path)
    return "indexer" in keys and "e_score" not in keys


@pytest.mark.slow
def test_dense_warmup_changes_only_indexer_parameters():
    step, state = _step(mode="dsa_warmup", trainable="indexer", bias_rate=0.02)  # the bias must not move either
    before = jax.tree.map(np.asarray, state.params)
    new, metrics = step(state, _batch())
    changed_indexer = 0
    for (path, a), b in zip(jax.tree_util.tree_flatten_with_path(new.params)[0], jax.tree.leaves(before)):
        if _is_indexer(path):
            changed_indexer += not np.array_equal(a, b)
        else:
            np.testing.assert_array_equal(a, b, err_msg=jax.tree_util.keystr(path))
    assert changed_indexer > 0
    assert 0 < float(metrics["topk_attention_mass"]) <= 1 and float(metrics["indexer_kl"]) > 0


@pytest.mark.slow
def test_sparse_stage_separates_lm_and_indexer_gradients():
    params = random_params(MODEL, seed=3)
    batch = _batch(1)

    def parts(p):
        out = forward(p, batch["tokens"], config=MODEL, positions=batch["positions"],
                      segment_ids=batch["segment_ids"], return_logits=False, indexer_mode="sparse")
        lm, _ = losses.cross_entropy(out.hidden, p["lm_head"]["kernel"], batch["tokens"], batch["segment_ids"],
                                     batch["loss_mask"])
        mtp, _ = losses.mtp_cross_entropy(out.mtp_hidden, p["lm_head"]["kernel"], batch["tokens"],
                                          batch["segment_ids"], batch["loss_mask"])
        kl = out.aux["indexer_kl_sum"].sum() + out.aux["mtp"]["indexer_kl_sum"].sum()
        return lm + mtp, kl

    lm_grads, kl_grads = jax.jit(lambda p: (jax.grad(lambda q: parts(q)[0])(p),
                                            jax.grad(lambda q: parts(q)[1])(p)))(params)
    lm_nonzero = kl_nonzero = 0
    for (path, g_lm), g_kl in zip(jax.tree_util.tree_flatten_with_path(lm_grads)[0], jax.tree.leaves(kl_grads)):
        if _is_indexer(path):
            assert not np.any(g_lm), jax.tree_util.keystr(path)
            kl_nonzero += bool(np.any(g_kl))
        else:
            assert not np.any(g_kl), jax.tree_util.keystr(path)
            lm_nonzero += bool(np.any(g_lm))
    assert lm_nonzero > 10 and kl_nonzero > 0


def test_bias_update_moves_load_toward_balance():
    from glm5_jax.train.balancing import bias_update

    config = dataclasses.replace(MODEL, n_routed_experts=8, num_experts_per_tok=2)
    rng = np.random.RandomState(0)
    x = jnp.asarray(rng.randn(256, 32) + 1.0, jnp.float32)
    kernel = rng.randn(32, 8) * 0.05
    kernel[:, 0] += 0.3  # every token prefers expert 0 (and the mean direction is positive)
    params = {"router": {"kernel": jnp.asarray(kernel, jnp.float32)}, "e_score_correction_bias": jnp.zeros(8)}

    def imbalance(p):
        ids = moe.choose_experts(jax.nn.sigmoid(x @ p["router"]["kernel"]) + p["e_score_correction_bias"], config)
        counts = moe.expert_counts(ids, jnp.ones(256, bool), 8)
        return counts, float(counts.max() / counts.mean())

    counts, start = imbalance(params)
    for _ in range(150):
        params["e_score_correction_bias"] = bias_update(params["e_score_correction_bias"], counts, 0.01)
        counts, _ = imbalance(params)
    _, end = imbalance(params)
    assert start > 2.5 and end < 1.5, (start, end)


@pytest.mark.slow
def test_train_step_applies_the_bias_update_outside_the_optimizer(sgd_steps):
    # The microbatch test's step (bias_update_rate 1e-3). SGD moves every leaf by lr * its gradient: a bias
    # moved by the optimizer too would not change by exactly the update rate.
    rate = 1e-3
    new, metrics = sgd_steps[1](_sgd_state(), _batch(2))
    delta = np.asarray(new.params["moe_layers"]["moe"]["e_score_correction_bias"])
    load = np.asarray(metrics["expert_load_max"])
    assert np.all(np.isclose(np.abs(delta), rate, rtol=1e-4) | (delta == 0)) and np.any(delta != 0)
    assert load.shape == (MODEL.num_moe_layers,)
    mtp_delta = np.asarray(new.params["mtp"]["layer"]["moe"]["e_score_correction_bias"])
    assert np.any(mtp_delta != 0)  # the MTP layer balances its own experts too


def test_bad_batches_are_rejected_before_compiling():
    step, state = _step()
    batch = _batch()
    with pytest.raises(ValueError, match="missing"):
        step(state, {k: v for k, v in batch.items() if k != "loss_mask"})
    with pytest.raises(ValueError, match="outside the vocabulary"):
        step(state, {**batch, "tokens": batch["tokens"].at[0, 0].set(MODEL.vocab_size)})
    with pytest.raises(ConfigError, match="train.mode"):
        TrainConfig(mode="finetune").validate()


@pytest.mark.slow
def test_the_optimizer_scope_holds_muons_newton_schulz_flops_and_none_of_the_models():
    """`glm5 compile` reports the optimizer's matmul FLOPs apart (`OPTIMIZER_SCOPE`). Muon adds exactly its
    Newton-Schulz products to the step, ns_steps x (4 p^2 q + 2 p^3) per matrix of p x q (p <= q: X X^T, A A,
    B X), every loop trip counted; AdamW adds none. XLA:CPU's library fusions drop some dots' op_name, so on CPU
    the scope holds only part of them (the TPU compile in tests/parallel/test_compile_cli.py holds them all)."""
    from optax.contrib import MuonDimensionNumbers

    from glm5_jax.parallel.hlo_stats import flops_in_scope, hlo_stats
    from glm5_jax.train.muon_layerwise import fans
    from glm5_jax.train.optim import _dimension_numbers_fn, param_path_labels
    from glm5_jax.train.step import OPTIMIZER_SCOPE

    params = random_params(MODEL, seed=0)
    batch = _batch()

    def counted(optim):
        tx = make_optimizer(optim, params, config=MODEL)
        step = make_train_step(MODEL, _train_config(), tx)
        state = jax.eval_shape(lambda p: init_train_state(p, tx), params)
        stats = hlo_stats(step.jitted.trace(state, batch).lower().compile().as_text(), 1)
        return stats.matmul_flops, flops_in_scope(stats, OPTIMIZER_SCOPE)

    muon = OptimConfig(name="muon", muon_split=False, ns_steps=5)
    muon_total, muon_optimizer = counted(muon)
    adamw_total, adamw_optimizer = counted(OptimConfig(name="adamw"))
    labels = jax.tree.leaves(param_path_labels(params, muon, config=MODEL))
    expected = 0
    dims_tree = _dimension_numbers_fn(False, MODEL)(params)
    all_dims = jax.tree.leaves(dims_tree, is_leaf=lambda x: isinstance(x, MuonDimensionNumbers))
    for leaf, dims, label in zip(jax.tree.leaves(params), all_dims, labels):
        if label != "muon":
            continue
        fan_in, fan_out = fans(leaf.shape, dims)
        p, q = min(fan_in, fan_out), max(fan_in, fan_out)
        matrices = leaf.size // (fan_in * fan_out)
        expected += matrices * muon.ns_steps * (4 * p * p * q + 2 * p ** 3)
    assert adamw_optimizer == 0 and expected > 0
    assert muon_total - adamw_total == expected
    assert 0 < muon_optimizer <= expected
