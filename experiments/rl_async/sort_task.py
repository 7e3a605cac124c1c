"""The verifiable task of the asynchronous RL experiment (sort a list of digits) and the few supervised
steps that teach its format before RL."""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator

import numpy as np

from glm5_jax.config import ConfigError, ModelConfig, TrainConfig
from glm5_jax.config.async_rl import AsyncRLConfig
from glm5_jax.config.optim import OptimConfig
from glm5_jax.rollout.async_rl import copy_tree
from glm5_jax.train.optim import make_optimizer
from glm5_jax.train.step import init_train_state, make_train_step


@dataclasses.dataclass(frozen=True)
class SortTask:
    """Prompt [BOS, d_1 .. d_n, SEP]; answer sorted(d) + [EOS]. Digits are token ids 0-9."""

    num_digits: int = 5
    bos: int = 10
    sep: int = 11
    eos: int = 12

    def validate(self, vocab_size: int) -> "SortTask":
        if not isinstance(self.num_digits, int) or self.num_digits < 1:
            raise ConfigError(f"task.num_digits={self.num_digits!r} is invalid: must be a positive integer")
        for name in ("bos", "sep", "eos"):
            value = getattr(self, name)
            if not 10 <= value < vocab_size:
                raise ConfigError(f"task.{name}={value!r} is invalid: must be a non-digit id in [10, {vocab_size})")
        return self

    @property
    def prompt_len(self) -> int:
        return self.num_digits + 2

    @property
    def answer_len(self) -> int:
        return self.num_digits + 1

    @property
    def seq_len(self) -> int:
        return self.prompt_len + self.answer_len

    def prompts(self, rng: np.random.Generator, n: int) -> np.ndarray:
        digits = rng.integers(0, 10, (n, self.num_digits))
        return np.concatenate([np.full((n, 1), self.bos), digits, np.full((n, 1), self.sep)], 1).astype(np.int32)

    def answer(self, prompt: np.ndarray) -> np.ndarray:
        return np.append(np.sort(prompt[1:-1]), self.eos).astype(np.int32)

    def reward(self, prompt: np.ndarray, response: np.ndarray) -> float:
        return float(np.array_equal(np.asarray(response), self.answer(prompt)))

    def sft_batch(self, rng: np.random.Generator, batch_size: int) -> dict[str, np.ndarray]:
        """Prompt + answer sequences with the loss on the answer tokens (the mode "sft" batch)."""
        prompts = self.prompts(rng, batch_size)
        tokens = np.stack([np.concatenate([p, self.answer(p)]) for p in prompts]).astype(np.int32)
        loss_mask = np.zeros_like(tokens)
        loss_mask[:, self.prompt_len:] = 1
        return {"tokens": tokens, "positions": np.broadcast_to(np.arange(self.seq_len, dtype=np.int32), tokens.shape),
                "segment_ids": np.ones_like(tokens), "loss_mask": loss_mask}


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
