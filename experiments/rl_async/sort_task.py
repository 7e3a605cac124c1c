"""The few supervised steps that teach the format of the asynchronous RL experiment's task (sort a list of
digits: glm5_jax.examples.sort_task, the example task of `glm5 rl-async`) before RL."""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np

from glm5_jax.config import ModelConfig, TrainConfig
from glm5_jax.config.async_rl import AsyncRLConfig
from glm5_jax.config.optim import OptimConfig
from glm5_jax.examples.sort_task import SortTask
from glm5_jax.rollout.async_rl import copy_tree
from glm5_jax.train.optim import make_optimizer
from glm5_jax.train.step import init_train_state, make_train_step


def sft_batches(task: SortTask, config: AsyncRLConfig) -> Iterator[dict[str, np.ndarray]]:
    """The SFT steps' batches, in order; their prompts come from async.seed (offset from the worker's prompts)."""
    rng = np.random.default_rng(config.seed + 1)
    for _ in range(config.sft_steps):
        yield task.sft_batch(rng, config.sft_batch_size)


def sft(params, model_config: ModelConfig, task: SortTask, config: AsyncRLConfig):
    """A few supervised steps on prompt -> sorted answer (AdamW, constant LR); returns (params, last loss)."""
    if config.sft_steps == 0:
        return params, None
    train = TrainConfig(mode="sft", batch_size=config.sft_batch_size, seq_len=task.seq_len, bias_update_rate=1e-3)
    optim = OptimConfig(name="adamw", lr=config.sft_lr, min_lr=config.sft_lr, warmup_steps=0,
                        total_steps=config.sft_steps, schedule="constant", weight_decay=0.0)
    optimizer = make_optimizer(optim, params, config=model_config)
    step = make_train_step(model_config, train, optimizer)
    state = init_train_state(copy_tree(params), optimizer)
    loss = None
    for batch in sft_batches(task, config):
        state, metrics = step(state, batch)
        loss = float(metrics["loss"])
    return state.params, loss
