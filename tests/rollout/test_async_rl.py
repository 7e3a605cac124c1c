"""The asynchronous RL driver: the sorting task against hand-written answers, and a few steps of a lagging
worker whose staleness, drops and weight pushes follow the configuration."""

import dataclasses

import jax
import numpy as np
import pytest

from glm5_jax.config import ConfigError, ModelConfig, TrainConfig
from glm5_jax.model.transformer import init
from experiments.rl_async.sort_task import SortTask
from glm5_jax.config.async_rl import AsyncRLConfig
from glm5_jax.rollout.async_rl import RolloutWorker, run_async_rl
from glm5_jax.train.optim import OptimConfig
from glm5_jax.config.rl import rl_step_config_from_dict

TASK = SortTask(num_digits=3)
# One dense layer keeps the compile short; the MoE path of the step is covered by tests/train/test_rl_step.py.
CONFIG = ModelConfig(vocab_size=16, hidden_size=16, intermediate_size=32, moe_intermediate_size=8,
                     num_hidden_layers=1, first_k_dense_replace=1, num_attention_heads=2, q_lora_rank=8,
                     kv_lora_rank=8, qk_nope_head_dim=4, qk_rope_head_dim=4, v_head_dim=4, n_routed_experts=4,
                     num_experts_per_tok=2, n_group=1, topk_group=1, index_n_heads=2, index_head_dim=4,
                     index_topk=8, num_nextn_predict_layers=0, mtp_num_steps=0, compute_dtype="float32").validate()
ASYNC = AsyncRLConfig(steps=7, prompts_per_step=2, group_size=2, push_every=2, queue_depth=1, eval_every=100,
                      eval_prompts=4, sft_steps=0)
TRAIN = TrainConfig(mode="rl", batch_size=4, seq_len=TASK.seq_len, bias_update_rate=0.0)
OPTIM = OptimConfig(name="adamw", lr=1e-3, warmup_steps=0, total_steps=10, schedule="constant")
RL = rl_step_config_from_dict({"loss": "double_sided_is", "eps_low": 0.2, "eps_high": 0.2, "max_staleness": 1})


def test_sort_task_prompts_answers_rewards_and_sft_batch():
    prompt = np.array([10, 3, 1, 2, 11])
    np.testing.assert_array_equal(TASK.answer(prompt), [1, 2, 3, 12])
    assert TASK.reward(prompt, [1, 2, 3, 12]) == 1.0
    assert TASK.reward(prompt, [1, 2, 3]) == 0.0 and TASK.reward(prompt, [3, 2, 1, 12]) == 0.0
    prompts = TASK.prompts(np.random.default_rng(0), 5)
    assert prompts.shape == (5, 5) and (prompts[:, 0] == 10).all() and (prompts[:, -1] == 11).all()
    batch = TASK.sft_batch(np.random.default_rng(0), 3)
    row = batch["tokens"][0]
    np.testing.assert_array_equal(row[5:], sorted(row[1:4]) + [12])
    np.testing.assert_array_equal(batch["loss_mask"][0], [0, 0, 0, 0, 0, 1, 1, 1, 1])


def test_config_errors_name_the_field():
    with pytest.raises(ConfigError, match="async.push_every=0"):
        dataclasses.replace(ASYNC, push_every=0).validate()
    with pytest.raises(ConfigError, match="task.eos=5"):
        SortTask(eos=5).validate(CONFIG.vocab_size)
    with pytest.raises(ConfigError, match="batch_size = prompts_per_step \\* group_size = 4"):
        run_async_rl(None, CONFIG, dataclasses.replace(TRAIN, batch_size=8), OPTIM, RL, ASYNC, TASK)


@pytest.mark.slow
def test_lagging_worker_staleness_drops_and_pushes(monkeypatch):
    pushes = []
    push = RolloutWorker.push
    monkeypatch.setattr(RolloutWorker, "push", lambda self, params, version: (pushes.append(version),
                                                                             push(self, params, version)))
    params = init(CONFIG, jax.random.key(0))
    rows = run_async_rl(params, CONFIG, TRAIN, OPTIM, RL, ASYNC, TASK)
    assert [r["step"] for r in rows] == list(range(1, 8))
    assert pushes == [2, 4, 6]
    # The queue holds one batch ahead and weights move every 2 steps, so a batch can be 2 versions old:
    # those exceed tau = 1 and are dropped (whole groups), and the trainer only ever sees staleness <= 1.
    assert max(r["staleness"] for r in rows) <= 1
    assert rows[-1]["dropped_stale"] > 0 and rows[-1]["dropped_stale"] % ASYNC.group_size == 0
    # The first batch is on-policy: ratio 1, nothing masked.
    assert rows[0]["staleness"] == 0 and rows[0]["masked_frac"] == 0.0
    np.testing.assert_allclose([rows[0]["offpolicy_ratio_min"], rows[0]["offpolicy_ratio_max"]], 1.0, atol=1e-4)
    assert "greedy_accuracy" in rows[0] and 0.0 <= rows[0]["greedy_accuracy"] <= 1.0
