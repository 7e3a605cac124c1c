"""Asynchronous off-policy RL at small scale: a rollout worker samples with weights that lag the trainer,
the trainer runs the RL step on what the worker recorded (token ids, logprobs, routing), weights are pushed
to the worker every `push_every` trainer steps, and samples staler than `rl.max_staleness` are dropped.

The worker and the trainer are interleaved in one process (deterministic, and fair on a 2-core CPU): the
worker keeps `queue_depth` batches generated ahead of the trainer, so a batch the trainer consumes at
version v was sampled with weights of version w with v - w <= queue_depth + push_every - 1 (a dropped batch
is replaced by the next one in the queue and a fresh one is generated). GLM-5's rollout engine and trainer
overlap the same way, with the queue in the data buffer.

The task (`SortTask`) is verifiable: sort a list of digits; reward 1 for the exact sorted list followed by
EOS, else 0. `sft` teaches the format with a few supervised steps before RL.

`importance_correction: false` is the comparison run without any correction: the trainer overwrites the
recorded rollout logprobs with its own current logprobs, so every ratio is 1 and the update is plain
policy gradient on stale samples. The fraction of tokens the double-sided band would have masked is still
reported (`would_mask_frac`).
"""

from __future__ import annotations

import collections
import dataclasses
import functools
import time
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np

from glm5_jax.config import ConfigError, ModelConfig, TrainConfig
from glm5_jax.generation import SamplingParams, generate, to_rollout_records
from glm5_jax.model.transformer import forward
from glm5_jax.train.optim import OptimConfig, make_optimizer
from glm5_jax.train.rl_step import RLStepConfig, as_rl_step_config, rl_batch, rl_optim_config
from glm5_jax.train.step import init_train_state, make_train_step
from glm5_jax.train.token_logprobs import token_logprobs


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


def _copy(tree):
    return jax.tree.map(jnp.copy, tree)


def sft(params, model_config: ModelConfig, task: SortTask, config: AsyncRLConfig):
    """A few supervised steps on prompt -> sorted answer (AdamW, constant LR); returns (params, last loss)."""
    if config.sft_steps == 0:
        return params, None
    train = TrainConfig(mode="sft", batch_size=config.sft_batch_size, seq_len=task.seq_len, bias_update_rate=1e-3)
    optim = OptimConfig(name="adamw", lr=config.sft_lr, min_lr=config.sft_lr, warmup_steps=0,
                        total_steps=config.sft_steps, schedule="constant", weight_decay=0.0)
    optimizer = make_optimizer(optim, params)
    step = make_train_step(model_config, train, optimizer)
    state = init_train_state(_copy(params), optimizer)
    rng = np.random.default_rng(config.seed + 1)
    loss = None
    for _ in range(config.sft_steps):
        state, metrics = step(state, task.sft_batch(rng, config.sft_batch_size))
        loss = float(metrics["loss"])
    return state.params, loss


def greedy_accuracy(params, model_config: ModelConfig, task: SortTask, prompts: np.ndarray) -> float:
    out = generate(params, prompts.tolist(), config=model_config, collect_routing=True, max_len=task.seq_len,
                   sampling=SamplingParams(temperature=0.0, max_new_tokens=task.answer_len, eos_ids=(task.eos,)))
    return float(np.mean([task.reward(p, out.tokens[row, :out.lengths[row]]) for row, p in enumerate(prompts)]))


@functools.partial(jax.jit, static_argnames=("config", "vocab_chunk"))
def _current_logprobs(params, batch, *, config: ModelConfig, vocab_chunk: int):
    """The trainer's logprobs of the batch's targets under its current weights (with routing replay)."""
    routing = {}
    if "expert_choices" in batch:
        routing["expert_choices"] = jnp.swapaxes(batch["expert_choices"], 0, 1)
    if "indexer_topk" in batch:
        routing["topk_indices"] = jnp.swapaxes(batch["indexer_topk"], 0, 1)
    out = forward(params, batch["tokens"], config=config, positions=batch["positions"],
                  segment_ids=batch["segment_ids"], return_logits=False, mtp_steps=0, **routing)
    return token_logprobs(out.hidden, params["lm_head"]["kernel"], batch["targets"],
                          temperature=batch["temperature"], vocab_chunk=vocab_chunk)[0]


class RolloutWorker:
    """Samples groups with the weights it was last given and records them token-in-token-out."""

    def __init__(self, params, version: int, model_config: ModelConfig, task: SortTask, config: AsyncRLConfig):
        self.params, self.version = _copy(params), version
        self.model_config, self.task, self.config = model_config, task, config
        self.rng = np.random.default_rng(config.seed + 2)
        self.batches = 0

    def push(self, params, version: int) -> None:
        self.params, self.version = _copy(params), version

    def rollout(self) -> list:
        task, config = self.task, self.config
        prompts = np.repeat(task.prompts(self.rng, config.prompts_per_step), config.group_size, axis=0)
        out = generate(self.params, prompts.tolist(), config=self.model_config, collect_routing=True,
                       rng=jax.random.key(config.seed * 100_003 + self.batches), max_len=task.seq_len,
                       sampling=SamplingParams(temperature=config.temperature, max_new_tokens=task.answer_len,
                                               eos_ids=(task.eos,)))
        rewards = [task.reward(p, out.tokens[row, :out.lengths[row]]) for row, p in enumerate(prompts)]
        tag = self.batches
        self.batches += 1
        return to_rollout_records(out, rollout_ids=[f"b{tag}-{row}" for row in range(len(prompts))],
                                  group_ids=[f"b{tag}-g{row // config.group_size}" for row in range(len(prompts))],
                                  rewards=rewards, weight_versions=self.version)


def run_async_rl(params, model_config: ModelConfig, train_config: TrainConfig, optim_config: OptimConfig,
                 rl_config: RLStepConfig, config: AsyncRLConfig, task: SortTask,
                 log: Callable[[dict], None] = lambda row: None) -> list[dict]:
    """RL from `params` with a lagging worker; returns (and passes to `log`) one metrics row per trainer step."""
    config.validate()
    task.validate(model_config.vocab_size)
    rl_config = as_rl_step_config(rl_config)
    if train_config.mode != "rl" or train_config.batch_size != config.batch_size \
            or train_config.seq_len != task.seq_len:
        raise ConfigError(f"train={train_config!r} is invalid here: needs mode 'rl', batch_size = "
                          f"prompts_per_step * group_size = {config.batch_size}, seq_len = {task.seq_len}")
    optimizer = make_optimizer(rl_optim_config(optim_config, rl_config), params)
    step = make_train_step(model_config, train_config, optimizer, rl_config=rl_config)
    state = init_train_state(_copy(params), optimizer)
    worker = RolloutWorker(params, 0, model_config, task, config)
    eval_prompts = task.prompts(np.random.default_rng(config.seed + 3), config.eval_prompts)
    queue: collections.deque = collections.deque()
    dropped = {"dropped_stale": 0, "dropped_groups": 0, "dropped_group_samples": 0}
    lower, upper = 1.0 - rl_config.objective.eps_low, 1.0 + rl_config.objective.eps_high
    rows, start = [], time.perf_counter()
    for trainer_step in range(config.steps):
        version = int(state.step)
        while True:
            while len(queue) <= config.queue_depth:
                queue.append(worker.rollout())
            records = queue.popleft()
            batch, counts = rl_batch(records, model_config=model_config, seq_len=task.seq_len,
                                     rl_config=rl_config, current_version=version, group_size=config.group_size)
            for key in dropped:
                dropped[key] += counts[key]
            if batch is not None:
                break
        staleness = version - min(records[0].weight_versions)
        batch = {k: jnp.asarray(v) for k, v in batch.items()}
        mask = np.asarray(batch["loss_mask"]) > 0
        current = np.asarray(_current_logprobs(state.params, batch, config=model_config,
                                               vocab_chunk=train_config.vocab_chunk))
        ratio = np.exp(np.clip(current - np.asarray(batch["rollout_logprobs"]), -20, 20))[mask]
        if not config.importance_correction:
            batch["rollout_logprobs"] = jnp.where(batch["loss_mask"] > 0, current, 0.0)
        state, metrics = step(state, batch)
        metrics = {k: float(v) for k, v in jax.device_get(metrics).items() if np.ndim(v) == 0}
        row = {
            "step": trainer_step + 1,
            "staleness": staleness,
            "reward_mean": metrics["reward_mean"],
            "masked_frac": metrics.get("masked_below_frac", 0.0) + metrics.get("masked_above_frac", 0.0),
            "would_mask_frac": float(np.mean((ratio <= lower) | (ratio >= upper))),
            "offpolicy_ratio_min": float(ratio.min()),
            "offpolicy_ratio_max": float(ratio.max()),
            "mismatch_k3_kl": metrics["mismatch_k3_kl"],
            "loss": metrics["loss"],
            "grad_norm": metrics["grad_norm"],
            **dropped,
            "wall_s": round(time.perf_counter() - start, 2),
        }
        if (trainer_step + 1) % config.eval_every == 0 or trainer_step == 0:
            row["greedy_accuracy"] = greedy_accuracy(state.params, model_config, task, eval_prompts)
        if int(state.step) % config.push_every == 0:
            worker.push(state.params, int(state.step))
        rows.append(row)
        log(row)
    return rows
