"""Optimizer groups, Muon / Muon Split updates, trainable masks and learning-rate schedules."""

import numpy as np
import jax
import jax.numpy as jnp
import optax
import pytest

from glm5_jax.config import ConfigError, ModelConfig, from_dict
from glm5_jax.parallel.sharding import abstract_params
from glm5_jax.train.optim import OptimConfig, learning_rate_schedule, make_optimizer, param_path_labels

# A tiny model; Q > K and C > nope, P so per-head blocks are tall matrices; LF of its L + L layers index in full.
L, V, D, Q, C, R, H, NOPE, P, F, E, I, J, LF = 2, 16, 8, 12, 10, 2, 2, 3, 4, 6, 3, 2, 4, 2
K = NOPE + R
NS_COEFFS = (3.4445, -4.7750, 2.0315)
MODEL = ModelConfig(vocab_size=V, hidden_size=D, intermediate_size=F, moe_intermediate_size=F,
                    num_hidden_layers=2 * L, first_k_dense_replace=L, num_attention_heads=H, q_lora_rank=Q,
                    kv_lora_rank=C, qk_nope_head_dim=NOPE, qk_rope_head_dim=R, v_head_dim=P, n_routed_experts=E,
                    num_experts_per_tok=1, n_group=1, topk_group=1, index_n_heads=I, index_head_dim=J, index_topk=2,
                    indexer_types=("full", "shared", "full", "shared")).validate()
SHAPES_ABSTRACT = abstract_params(MODEL)
assert SHAPES_ABSTRACT["indexers"]["wq_b"]["kernel"].shape == (LF, Q, I, J)
assert SHAPES_ABSTRACT["moe_layers"]["attn"]["kv_b_proj"]["kernel"].shape == (L, C, H, NOPE + P)


def random_tree(seed):
    leaves, treedef = jax.tree.flatten(SHAPES_ABSTRACT)
    rng = np.random.default_rng(seed)
    return jax.tree.unflatten(treedef, [jnp.asarray(rng.normal(size=a.shape), jnp.float32) for a in leaves])


def newton_schulz(g, steps=5):
    """Independent numpy reference of Muon's quintic Newton-Schulz iteration on one matrix."""
    x = np.asarray(g, np.float64)
    transposed = x.shape[0] > x.shape[1]
    if transposed:
        x = x.T
    x = x / (np.linalg.norm(x) + 1e-8)
    a, b, c = NS_COEFFS
    for _ in range(steps):
        gram = x @ x.T
        x = a * x + (b * gram + c * gram @ gram) @ x
    return x.T if transposed else x


def muon_update(g, lr=0.1, rms=0.2):
    return -lr * rms * np.sqrt(max(g.shape)) * newton_schulz(g)


def one_update(cfg, grads, params):
    tx = make_optimizer(cfg, params, config=MODEL)
    updates, _ = jax.jit(tx.update)(grads, tx.init(params), params)
    return jax.tree.map(np.asarray, updates)


CONST = dict(lr=0.1, min_lr=0.1, warmup_steps=0, schedule="constant", weight_decay=0.0, grad_clip_norm=0.0)


@pytest.fixture(scope="module")
def params():
    return random_tree(0)


@pytest.fixture(scope="module")
def grads():
    return random_tree(1)


def muon_subtree(tree):
    """The leaves the Muon layout tests inspect (a subtree keeps XLA compilation short on CPU)."""
    attn = lambda a: {name: a[name] for name in ("q_b_proj", "kv_b_proj", "o_proj")}
    return {"moe_layers": {"attn": attn(tree["moe_layers"]["attn"]),
                           "moe": {"experts": {"down_proj": tree["moe_layers"]["moe"]["experts"]["down_proj"]}}},
            "mtp": {"eh_proj": tree["mtp"]["eh_proj"], "layer": {"attn": attn(tree["mtp"]["layer"]["attn"])}}}


@pytest.fixture(scope="module")
def split_updates(params, grads):
    return one_update(OptimConfig(name="muon", muon_split=True, **CONST), muon_subtree(grads), muon_subtree(params))


def test_muon_split_orthogonalises_each_head_block(split_updates, grads):
    g, u = grads["moe_layers"]["attn"], split_updates["moe_layers"]["attn"]
    for layer in range(L):
        for head in range(H):
            blocks = {
                "q_b_proj": (g["q_b_proj"]["kernel"][layer, :, head, :], u["q_b_proj"]["kernel"][layer, :, head, :]),
                "W_UK": (g["kv_b_proj"]["kernel"][layer, :, head, :NOPE],
                         u["kv_b_proj"]["kernel"][layer, :, head, :NOPE]),
                "W_UV": (g["kv_b_proj"]["kernel"][layer, :, head, NOPE:],
                         u["kv_b_proj"]["kernel"][layer, :, head, NOPE:]),
            }
            for name, (g_block, u_block) in blocks.items():
                np.testing.assert_allclose(u_block, muon_update(np.asarray(g_block)), rtol=2e-4, atol=1e-6,
                                           err_msg=f"{name} layer {layer} head {head}")
                singular = np.linalg.svd(u_block, compute_uv=False) / (0.1 * 0.2 * np.sqrt(max(u_block.shape)))
                assert singular.min() > 0.6 and singular.max() < 1.25, (name, singular)
    # The per-head blocks side by side are not one orthogonal matrix: the split is what made them so.
    whole = u["q_b_proj"]["kernel"][0].reshape(Q, H * K)
    singular = np.linalg.svd(whole, compute_uv=False)
    assert singular.max() / singular.min() > 1.5


def test_muon_batches_layers_experts_and_flattens_o_proj(split_updates, grads):
    g, u = grads["moe_layers"], split_updates["moe_layers"]
    for layer in range(L):
        o_grad = np.asarray(g["attn"]["o_proj"]["kernel"][layer]).reshape(D, H * P).T  # [D, H, P]: one [(H P), D]
        np.testing.assert_allclose(u["attn"]["o_proj"]["kernel"][layer].reshape(D, H * P).T, muon_update(o_grad),
                                   rtol=2e-4, atol=1e-6)
        for expert in range(E):
            np.testing.assert_allclose(u["moe"]["experts"]["down_proj"][layer, expert],
                                       muon_update(np.asarray(g["moe"]["experts"]["down_proj"][layer, expert])),
                                       rtol=2e-4, atol=1e-6)
    np.testing.assert_allclose(split_updates["mtp"]["eh_proj"]["kernel"],
                               muon_update(np.asarray(grads["mtp"]["eh_proj"]["kernel"])), rtol=2e-4, atol=1e-6)
    mtp_q = split_updates["mtp"]["layer"]["attn"]["q_b_proj"]["kernel"]
    np.testing.assert_allclose(mtp_q[:, 1, :],
                               muon_update(np.asarray(grads["mtp"]["layer"]["attn"]["q_b_proj"]["kernel"][:, 1, :])),
                               rtol=2e-4, atol=1e-6)


def test_muon_without_split_orthogonalises_whole_up_projections(params, grads):
    attn_only = lambda tree: {"dense_layers": {"attn": tree["dense_layers"]["attn"]}}
    cfg = OptimConfig(name="muon", muon_split=False, **CONST)
    u = one_update(cfg, attn_only(grads), attn_only(params))["dense_layers"]["attn"]
    g = grads["dense_layers"]["attn"]
    for layer in range(L):
        q_grad = np.asarray(g["q_b_proj"]["kernel"][layer]).reshape(Q, H * K)
        q_update = u["q_b_proj"]["kernel"][layer].reshape(Q, H * K)
        np.testing.assert_allclose(q_update, muon_update(q_grad), rtol=2e-4, atol=1e-6)
        kv_grad = np.asarray(g["kv_b_proj"]["kernel"][layer]).reshape(C, H * (NOPE + P))
        np.testing.assert_allclose(u["kv_b_proj"]["kernel"][layer].reshape(C, -1), muon_update(kv_grad),
                                   rtol=2e-4, atol=1e-6)
        head_block = q_update[:, :K]
        assert not np.allclose(head_block, muon_update(np.asarray(g["q_b_proj"]["kernel"][layer, :, 0, :])),
                               atol=1e-3)


def test_groups_by_path():
    labels = param_path_labels(SHAPES_ABSTRACT, OptimConfig(name="muon"), config=MODEL)
    assert labels["embed"]["embedding"] == "adamw"
    assert labels["lm_head"]["kernel"] == "adamw"
    assert labels["moe_layers"]["moe"]["router"]["kernel"] == "adamw"
    assert labels["moe_layers"]["moe"]["e_score_correction_bias"] == "frozen"
    assert labels["mtp"]["layer"]["moe"]["e_score_correction_bias"] == "frozen"
    for norm in (labels["final_norm"]["scale"], labels["moe_layers"]["attn"]["kv_a_norm"]["scale"],
                 labels["indexers"]["k_norm"]["bias"], labels["mtp"]["enorm"]["scale"]):
        assert norm == "adamw_no_decay"
    for matrix in (labels["dense_layers"]["attn"]["q_b_proj"]["kernel"],
                   labels["moe_layers"]["moe"]["experts"]["up_proj"],
                   labels["indexers"]["wq_b"]["kernel"], labels["mtp"]["eh_proj"]["kernel"],
                   labels["mtp"]["layer"]["indexer"]["weights_proj"]["kernel"]):
        assert matrix == "muon"
    adamw_labels = set(jax.tree.leaves(param_path_labels(SHAPES_ABSTRACT, OptimConfig(name="adamw"), config=MODEL)))
    assert adamw_labels == {"adamw", "adamw_no_decay", "frozen"}


@pytest.mark.parametrize("name", ["muon", "adamw"])
def test_weight_decay_groups_and_bias_leaf_untouched(params, name):
    cfg = OptimConfig(name=name, lr=0.1, min_lr=0.1, warmup_steps=0, schedule="constant", weight_decay=0.5,
                      grad_clip_norm=1.0)
    # A subtree keeps compilation short; group rules depend only on each leaf's own path.
    params = {"lm_head": params["lm_head"], "final_norm": params["final_norm"], "indexers": params["indexers"],
              "dense_layers": {"mlp": params["dense_layers"]["mlp"]},
              "moe_layers": {"moe": params["moe_layers"]["moe"]}}
    tx = make_optimizer(cfg, params, config=MODEL)
    grads = jax.tree.map(jnp.zeros_like, params)
    grads["moe_layers"]["moe"]["e_score_correction_bias"] = jnp.ones((L, E))
    state, current = tx.init(params), params
    step = jax.jit(lambda p, s: (lambda u, s: (optax.apply_updates(p, u), s))(*tx.update(grads, s, p)))
    for _ in range(3):
        current, state = step(current, state)
    bias = "moe_layers", "moe", "e_score_correction_bias"
    np.testing.assert_array_equal(current[bias[0]][bias[1]][bias[2]], params[bias[0]][bias[1]][bias[2]])
    np.testing.assert_array_equal(current["final_norm"]["scale"], params["final_norm"]["scale"])
    np.testing.assert_array_equal(current["indexers"]["k_norm"]["bias"], params["indexers"]["k_norm"]["bias"])
    # With zero gradients only decoupled decay moves a matrix: w <- w * (1 - lr * wd) per step.
    for path in (("lm_head", "kernel"), ("dense_layers", "mlp", "up_proj", "kernel")):
        before, after = params, current
        for key in path:
            before, after = before[key], after[key]
        np.testing.assert_allclose(after, before * (1 - 0.1 * 0.5) ** 3, rtol=1e-5)


def _changed_paths(before, after):
    flat_before = jax.tree_util.tree_flatten_with_path(before)[0]
    flat_after = jax.tree.leaves(after)
    return {"/".join(str(k.key) for k in path) for (path, b), a in zip(flat_before, flat_after)
            if not np.array_equal(np.asarray(b), np.asarray(a))}


def test_trainable_indexer_updates_only_indexer_leaves(params):
    cfg = OptimConfig(name="muon", trainable="indexer", **CONST)
    tx = make_optimizer(cfg, params, config=MODEL)
    state, current = tx.init(params), params

    @jax.jit
    def step(p, s, g):
        u, s = tx.update(g, s, p)
        return optax.apply_updates(p, u), s

    for seed in range(3):
        current, state = step(current, state, random_tree(10 + seed))
    changed = _changed_paths(params, current)
    indexer_paths = {path for path in _changed_paths(params, jax.tree.map(lambda x: x + 1, params))
                     if path.startswith("indexers/") or path.startswith("mtp/layer/indexer/")}
    assert changed == indexer_paths
    # Optimizer state exists for the indexer only: Muon momentum for matrices, Adam mu + nu for norms.
    sizes = {"/".join(str(k.key) for k in path): leaf.size for path, leaf in
             jax.tree_util.tree_flatten_with_path(params)[0]}
    norms = [p for p in indexer_paths if p.endswith("scale") or p.endswith("bias")]
    expected = sum(sizes[p] for p in indexer_paths if p not in norms) + 2 * sum(sizes[p] for p in norms)
    assert sum(x.size for x in jax.tree.leaves(state) if x.ndim > 0 and x.size > 3) == expected


def test_trainable_regex_list_and_yaml_loading(params):
    cfg = from_dict(OptimConfig, {"name": "adamw", "trainable": ["^lm_head/", "router"], **CONST})
    assert cfg.trainable == ("^lm_head/", "router")
    labels = param_path_labels(params, cfg, config=MODEL)
    assert labels["lm_head"]["kernel"] == "adamw"
    assert labels["moe_layers"]["moe"]["router"]["kernel"] == "adamw"
    assert labels["mtp"]["layer"]["moe"]["router"]["kernel"] == "adamw"
    assert labels["embed"]["embedding"] == "frozen"
    assert from_dict(OptimConfig, {"trainable": "indexer"}).trainable == "indexer"
    with pytest.raises(ConfigError, match="optim.trainable.*no_such_leaf"):
        make_optimizer(OptimConfig(trainable=("no_such_leaf",)), params, config=MODEL)


@pytest.mark.parametrize("fields, field", [
    ({"name": "sgd"}, "optim.name"), ({"schedule": "step"}, "optim.schedule"),
    ({"min_lr": 1.0, "lr": 0.1}, "optim.min_lr"), ({"warmup_steps": 20, "total_steps": 10}, "optim.warmup_steps"),
    ({"b2": 1.0}, "optim.b2"), ({"trainable": "mlp_only"}, "optim.trainable"),
    ({"trainable": ("([",)}, "optim.trainable"), ({"muon_rms": 0.0}, "optim.muon_rms"),
    ({"mu_dtype": "float8"}, "optim.mu_dtype"),
])
def test_config_errors_name_the_field(fields, field):
    with pytest.raises(ConfigError, match=field):
        OptimConfig(**fields)


def test_schedules_at_key_steps():
    base = dict(lr=1.0, min_lr=0.1, warmup_steps=10, total_steps=110)
    cosine = learning_rate_schedule(OptimConfig(schedule="cosine", **base))
    linear = learning_rate_schedule(OptimConfig(schedule="linear", **base))
    constant = learning_rate_schedule(OptimConfig(schedule="constant", **base))
    for schedule in (cosine, linear, constant):
        np.testing.assert_allclose([schedule(0), schedule(4), schedule(9), schedule(10)], [0.1, 0.5, 1.0, 1.0],
                                   rtol=1e-6)
    np.testing.assert_allclose([cosine(60), cosine(110), cosine(500)], [0.55, 0.1, 0.1], rtol=1e-5)
    np.testing.assert_allclose(cosine(35), 0.1 + 0.9 * 0.5 * (1 + np.cos(np.pi * 0.25)), rtol=1e-5)
    np.testing.assert_allclose([linear(35), linear(60), linear(110), linear(500)], [0.775, 0.55, 0.1, 0.1],
                               rtol=1e-5)
    np.testing.assert_allclose([constant(60), constant(500)], [1.0, 1.0])
    no_warmup = learning_rate_schedule(OptimConfig(schedule="cosine", lr=1.0, min_lr=0.0, warmup_steps=0,
                                                   total_steps=100))
    np.testing.assert_allclose([no_warmup(0), no_warmup(50), no_warmup(100)], [1.0, 0.5, 0.0], atol=1e-6)


def test_optimizer_applies_schedule_to_update_size(params, grads):
    """AdamW's first update is -lr(0) * sign(g) elementwise: the schedule reaches the optimizer."""
    cfg = OptimConfig(name="adamw", lr=1.0, min_lr=0.0, warmup_steps=4, total_steps=8, eps=1e-12,
                      weight_decay=0.0, grad_clip_norm=0.0)
    u = one_update(cfg, {"lm_head": grads["lm_head"]}, {"lm_head": params["lm_head"]})
    np.testing.assert_allclose(u["lm_head"]["kernel"], -0.25 * np.sign(grads["lm_head"]["kernel"]), rtol=1e-4)


def test_muon_spread_layers_must_be_a_bool():
    with pytest.raises(ValueError, match="optim.muon_spread_layers"):
        OptimConfig(name="muon", muon_spread_layers="yes")


def test_a_bfloat16_first_moment_halves_the_momentum_and_keeps_the_update(params, grads):
    """mu_dtype bfloat16: Muon's momentum and AdamW's first moment are stored in bf16 (AdamW's second moment and
    the step count untouched), and the first update stays within bf16 rounding of the fp32 one."""
    subtree = lambda tree: {"lm_head": tree["lm_head"], **muon_subtree(tree)}  # noqa: E731  AdamW and Muon leaves
    small_params, small_grads = subtree(params), subtree(grads)
    by_dtype = {}
    for mu_dtype in (None, "bfloat16"):
        tx = make_optimizer(OptimConfig(name="muon", mu_dtype=mu_dtype, **CONST), small_params, config=MODEL)
        state = tx.init(small_params)
        updates, state = jax.jit(tx.update)(small_grads, state, small_params)
        by_dtype[mu_dtype] = (jax.tree.map(np.asarray, updates), state)
    state_dtypes = lambda state, kind: {  # noqa: E731
        leaf.dtype.name for path, leaf in jax.tree_util.tree_flatten_with_path(state)[0]
        if any(getattr(key, "name", None) == kind for key in path) and leaf.ndim > 0}
    assert state_dtypes(by_dtype["bfloat16"][1], "mu") == {"bfloat16"}
    assert state_dtypes(by_dtype["bfloat16"][1], "nu") == {"float32"}
    assert state_dtypes(by_dtype[None][1], "mu") == {"float32"}
    for fp32, bf16 in zip(jax.tree.leaves(by_dtype[None][0]), jax.tree.leaves(by_dtype["bfloat16"][0])):
        np.testing.assert_allclose(bf16, fp32, rtol=0.05, atol=0.05 * np.abs(fp32).max())
