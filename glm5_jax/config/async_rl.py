"""The `async:` section of the asynchronous RL experiment (`glm5_jax.rollout.async_rl`)."""

from __future__ import annotations

import dataclasses

from glm5_jax.config.core import ConfigError


@dataclasses.dataclass(frozen=True)
class AsyncRLConfig:
    steps: int = 60
    prompts_per_step: int = 8      # groups per trainer step
    group_size: int = 8            # samples per prompt (the group-mean baseline's group)
    push_every: int = 4            # K: the trainer pushes its weights to the worker every K steps
    queue_depth: int = 2           # batches the worker keeps generated ahead of the trainer
    temperature: float = 1.0
    importance_correction: bool = True
    eval_every: int = 5            # greedy accuracy of the trainer's weights on held-out prompts
    eval_prompts: int = 128
    sft_steps: int = 100
    sft_lr: float = 3e-3
    sft_batch_size: int = 64
    seed: int = 0

    def validate(self) -> "AsyncRLConfig":
        for name in ("steps", "prompts_per_step", "group_size", "push_every", "eval_every", "eval_prompts",
                     "sft_batch_size"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ConfigError(f"async.{name}={value!r} is invalid: must be a positive integer")
        for name in ("queue_depth", "sft_steps"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise ConfigError(f"async.{name}={value!r} is invalid: must be a non-negative integer")
        if not self.temperature > 0:
            raise ConfigError(f"async.temperature={self.temperature!r} is invalid: must be > 0 (logprobs are "
                              "recorded at the sampling temperature)")
        if not self.sft_lr > 0:
            raise ConfigError(f"async.sft_lr={self.sft_lr!r} is invalid: must be > 0")
        return self

    @property
    def batch_size(self) -> int:
        return self.prompts_per_step * self.group_size
