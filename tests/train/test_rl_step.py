"""Mode "rl" of the training step: on-policy update, routing replay, frozen indexer, record validation and a
short bandit run that learns. Records are sampled from a tiny GLM-5-shaped model with plain `generate`."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from param_fill import random_params

from glm5_jax.config import ModelConfig, TrainConfig
from glm5_jax.data.rollouts import RolloutError
from glm5_jax.generation import SamplingParams, generate, to_rollout_records
from glm5_jax.model.transformer import forward, init
from glm5_jax.train.optim import OptimConfig, make_optimizer
from glm5_jax.train.rl import RLConfig
from glm5_jax.config.rl import RLStepConfig, rl_step_config_from_dict
from glm5_jax.train.rl_step import RLObjective, rl_batch, rl_optim_config
from glm5_jax.train.step import init_train_state, make_train_step

# Dense layer + MoE layers with group-limited routing, DSA pruning (index_topk 4 < every sequence), MTP stored.
CONFIG = ModelConfig(vocab_size=97, hidden_size=32, intermediate_size=48, moe_intermediate_size=16,
                     num_hidden_layers=3, num_attention_heads=2, q_lora_rank=16, kv_lora_rank=16,
                     qk_nope_head_dim=8, qk_rope_head_dim=4, v_head_dim=8, n_routed_experts=8,
                     num_experts_per_tok=2, n_group=2, topk_group=1, first_k_dense_replace=1, index_n_heads=4,
                     index_head_dim=8, index_topk=4, mtp_num_steps=1, compute_dtype="float32").validate()
PROMPTS = [list(np.random.default_rng(row).integers(0, CONFIG.vocab_size, 6 + row % 3)) for row in range(4)]
MAX_NEW = 4
SEQ_LEN = 8 + MAX_NEW
RL = RLStepConfig(objective=RLConfig(loss="double_sided_is", eps_low=0.2, eps_high=0.2))
TRAIN = TrainConfig(mode="rl", batch_size=8, seq_len=SEQ_LEN, microbatches=2, bias_update_rate=0.0)


@pytest.fixture(scope="module")
def params():
    return random_params(CONFIG, seed=0, std=0.3)  # large enough for routing to depend on the input


@pytest.fixture(scope="module")
def records(params):
    """Two samples per prompt at temperature 1, with routing recorded; groups = prompts."""
    prompts = [p for p in PROMPTS for _ in range(2)]
    out = generate(params, prompts, config=CONFIG, sampling=SamplingParams(temperature=1.0, max_new_tokens=MAX_NEW),
                   rng=jax.random.key(3), max_len=SEQ_LEN, collect_routing=True)
    rewards = [1.0, 0.0, 0.5, 0.0, 1.0, 1.0, 0.0, 1.0]
    return to_rollout_records(out, rollout_ids=[f"r{i}" for i in range(8)],
                              group_ids=[f"g{i // 2}" for i in range(8)], rewards=rewards, weight_versions=0)


# One program for the whole tree (jnp.copy leaf by leaf compiles one program per leaf shape).
_copy = jax.jit(lambda tree: jax.tree.map(jnp.copy, tree))


def _state(params, optimizer):
    """A train state over a copy of `params`: the step donates its state."""
    return init_train_state(_copy(params), optimizer)


def _batch(records, rl=RL):
    batch, counts = rl_batch(records, model_config=CONFIG, seq_len=SEQ_LEN, rl_config=rl, current_version=0)
    assert counts["output"] == len(records)
    return {k: jnp.asarray(v) for k, v in batch.items()}


def _reinforce_grad(params, batch):
    """grad of -(1/N) sum_t A_t log pi(a_t) from full logits (no replay, no chunking): the on-policy PG."""
    def loss(p):
        logits = forward(p, batch["tokens"], config=CONFIG, positions=batch["positions"],
                         segment_ids=batch["segment_ids"], mtp_steps=0).logits
        logp = jax.nn.log_softmax(logits / batch["temperature"][:, None, None], axis=-1)
        logp = jnp.take_along_axis(logp, batch["targets"][..., None], axis=-1)[..., 0]
        mask = batch["loss_mask"]
        return -jnp.sum(mask * batch["advantages"] * logp) / jnp.sum(mask)

    return jax.jit(jax.grad(loss))(params)


@pytest.mark.slow
def test_on_policy_double_sided_is_step_is_the_policy_gradient_update(params, records):
    batch = _batch(records)
    assert float(jnp.abs(batch["advantages"]).sum()) > 0
    lr = 0.5
    step = make_train_step(CONFIG, TRAIN, optax.sgd(lr), rl_config=RL)
    state = _state(params, optax.sgd(lr))
    new_state, metrics = step(state, batch)
    # Generation logprobs are the trainer's: every token is inside the band with ratio 1.
    np.testing.assert_allclose(metrics["ratio_mean"], 1.0, atol=1e-4)
    assert float(metrics["masked_below_frac"]) == 0.0 and float(metrics["masked_above_frac"]) == 0.0
    assert float(metrics["loss_tokens"]) == float(batch["loss_mask"].sum())
    np.testing.assert_allclose(metrics["reward_mean"], np.mean([r.reward for r in records]), rtol=1e-6)
    expected = _reinforce_grad(params, batch)
    # On the host: device arithmetic leaf by leaf would compile a few programs per leaf shape.
    expected = jax.device_get(expected)
    got = jax.tree.map(lambda new, old: (old - new) / np.float32(lr), *jax.device_get((new_state.params, params)))
    norm = np.sqrt(sum(np.sum(np.square(leaf, dtype=np.float64)) for leaf in jax.tree.leaves(expected)))
    assert float(norm) > 1e-3
    for (path, g), e in zip(jax.tree_util.tree_leaves_with_path(got), jax.tree.leaves(expected)):
        np.testing.assert_allclose(g, e, atol=2e-4 * float(norm), err_msg=jax.tree_util.keystr(path))


jit_forward = jax.jit(forward, static_argnames=("config", "mtp_steps", "collect_routing"))


def _with_bias(params, seed):
    layers = dict(params["moe_layers"])
    moe = dict(layers["moe"])
    bias = moe["e_score_correction_bias"]
    moe["e_score_correction_bias"] = jnp.asarray(np.random.default_rng(seed).normal(0, 2.0, bias.shape), bias.dtype)
    layers["moe"] = moe
    return {**params, "moe_layers": layers}


@pytest.mark.slow
def test_routing_replay_reproduces_recorded_choices_after_the_bias_changed(params, records):
    batch = _batch(records)
    moved = _with_bias(params, seed=1)
    replay = {"expert_choices": jnp.swapaxes(batch["expert_choices"], 0, 1),
              "topk_indices": jnp.swapaxes(batch["indexer_topk"], 0, 1)}
    common = dict(config=CONFIG, positions=batch["positions"], segment_ids=batch["segment_ids"], mtp_steps=0,
                  collect_routing=True)
    original = jit_forward(params, batch["tokens"], **common)
    replayed = jit_forward(moved, batch["tokens"], **common, **replay)
    fresh = jit_forward(moved, batch["tokens"], **common)
    used = np.zeros(batch["tokens"].shape, bool)  # positions whose routing was recorded: all but the last
    for row, record in enumerate(records):
        used[row, :record.num_tokens - 1] = True
    recorded = np.sort(np.asarray(batch["expert_choices"]).transpose(1, 0, 2, 3), -1)[:, used]
    np.testing.assert_array_equal(np.sort(np.asarray(replayed.aux["expert_ids"]), -1)[:, used], recorded)
    assert not np.array_equal(np.sort(np.asarray(fresh.aux["expert_ids"]), -1)[:, used], recorded)
    np.testing.assert_allclose(replayed.logits[used], original.logits[used], atol=1e-5)

    # Through the RL objective: with replay the trainer is exactly on-policy again despite the new bias.
    def ratio_stats(rl):
        objective = RLObjective(CONFIG, dataclasses.replace(TRAIN, microbatches=1), rl)
        _, (sums, _) = jax.jit(lambda p, b: objective(p, b, objective.denominators(b)))(moved, batch)
        return float(sums["ratio_mean"]), float(sums["mismatch_k3_kl"])

    ratio, kl = ratio_stats(RL)
    np.testing.assert_allclose(ratio, 1.0, atol=1e-4)
    assert kl < 1e-8


@pytest.fixture(scope="module")
def adamw_step():
    """AdamW with weight decay through `rl_optim_config`, built once (the bandit run reuses its compile)."""
    optim = rl_optim_config(OptimConfig(name="adamw", lr=5e-2, weight_decay=0.1, warmup_steps=0, total_steps=100,
                                        schedule="constant"), RL)
    assert optim.trainable == "non_indexer"
    return make_train_step(CONFIG, TRAIN, make_optimizer(optim, _params_like(), config=CONFIG), rl_config=RL), optim


def _params_like():
    return jax.eval_shape(lambda: init(CONFIG, jax.random.key(0)))


@pytest.mark.slow
def test_indexer_is_frozen_by_default_in_rl(params, records, adamw_step):
    step, optim = adamw_step
    assert rl_optim_config(OptimConfig(), dataclasses.replace(RL, train_indexer=True)).trainable == "all"
    new_params = step(_state(params, make_optimizer(optim, params, config=CONFIG)), _batch(records))[0].params
    for name, old, new in (("indexers", params["indexers"], new_params["indexers"]),
                           ("mtp indexer", params["mtp"]["layer"]["indexer"], new_params["mtp"]["layer"]["indexer"])):
        for a, b in zip(jax.tree.leaves(old), jax.tree.leaves(new)):
            np.testing.assert_array_equal(a, b, err_msg=name)
    assert not np.allclose(params["lm_head"]["kernel"], new_params["lm_head"]["kernel"])


@pytest.mark.parametrize("field, value, message", [
    ("rollout_logprobs", lambda r: np.abs(r.rollout_logprobs) + 0.5, "finite and <= 0"),
    ("rollout_logprobs", lambda r: np.where(np.arange(len(r.response_ids)) == 1, np.nan, r.rollout_logprobs),
     "finite and <= 0"),
    ("loss_mask", lambda r: r.loss_mask[:-1], "one entry per response token"),
    ("prompt_ids", lambda r: np.append(r.prompt_ids, CONFIG.vocab_size), "valid ids"),
])
@pytest.mark.slow
def test_bad_records_fail_before_the_step_naming_the_record(records, field, value, message):
    bad = dataclasses.replace(records[5], **{field: value(records[5])})
    with pytest.raises(RolloutError, match=rf"rollout 'r5': field '{field}'.*{message}"):
        rl_batch([*records[:5], bad, *records[6:]], model_config=CONFIG, seq_len=SEQ_LEN, rl_config=RL,
                 current_version=0)


@pytest.mark.slow
def test_stale_samples_are_dropped_and_counted(records):
    stale = [dataclasses.replace(r, weight_versions=(0,) if i % 2 else (3,)) for i, r in enumerate(records)]
    rl = rl_step_config_from_dict({"loss": "double_sided_is", "eps_low": 0.2, "eps_high": 0.2, "max_staleness": 1})
    batch, counts = rl_batch(stale, model_config=CONFIG, seq_len=SEQ_LEN, rl_config=rl, current_version=3)
    # Every group of two lost one sample: half is not "more than half", so every group is dropped.
    assert counts["dropped_stale"] == 4 and counts["dropped_groups"] == 4 and batch is None


@pytest.mark.slow
def test_a_short_rl_run_on_a_bandit_task_raises_the_mean_reward(params, adamw_step):
    """One-token answers (every id is an EOS id); reward 1 for an id in the lower half of the vocabulary
    (about half at the start). Same shapes as the other tests, so generation and the step are compiled once."""
    step, optim = adamw_step
    state = _state(params, make_optimizer(optim, params, config=CONFIG))
    group_size = 4
    prompts = [PROMPTS[1 + row // group_size] for row in range(2 * group_size)]
    sampling = SamplingParams(temperature=1.0, max_new_tokens=MAX_NEW, eos_ids=tuple(range(CONFIG.vocab_size)))
    rewards = []
    for iteration in range(12):
        out = generate(state.params, prompts, config=CONFIG, sampling=sampling, rng=jax.random.key(iteration),
                       max_len=SEQ_LEN, collect_routing=True)
        assert (out.lengths == 1).all()
        reward = (out.tokens[:, 0] < CONFIG.vocab_size // 2).astype(np.float32)
        rewards.append(float(reward.mean()))
        records = to_rollout_records(out, rollout_ids=[f"{iteration}-{i}" for i in range(len(prompts))],
                                     group_ids=[f"{iteration}-{i // group_size}" for i in range(len(prompts))],
                                     rewards=reward.tolist(), weight_versions=iteration)
        state, metrics = step(state, _batch(records))
        np.testing.assert_allclose(metrics["ratio_mean"], 1.0, atol=1e-4)
    assert np.mean(rewards[:3]) < 0.75, rewards
    assert np.mean(rewards[-3:]) > np.mean(rewards[:3]) + 0.25, rewards


@pytest.mark.parametrize("name, loss", [("rl_agentic", "double_sided_is"), ("rl_grpo_icepop", "icepop_grpo")])
def test_rl_recipes_set_the_band_explicitly_and_freeze_the_indexer(name, loss, tmp_path):
    import shutil
    from pathlib import Path

    from glm5_jax.config.experiment import load_experiment

    configs = Path(__file__).resolve().parents[2] / "configs"
    start = tmp_path / "sft"  # the recipes take their model from the run they start from
    (start / "checkpoints").mkdir(parents=True)
    shutil.copy(configs / "tiny.yaml", start / "model.yaml")
    experiment = load_experiment(configs / f"{name}.yaml", [f"train.init_from={start}"])
    rl = experiment.rl  # parsed when the file was loaded
    assert experiment.train.mode == "rl" and rl.objective.loss == loss
    assert rl.objective.eps_low is not None and rl.objective.eps_high is not None  # given in the file, no default
    assert rl_optim_config(experiment.optim, rl).trainable == "non_indexer"
    assert experiment.train.bias_update_rate == 0.0 and rl.replay_routing
    make_train_step(experiment.model, experiment.train, optax.sgd(0.1), rl_config=experiment.rl, jit=False)
