"""Asynchronous off-policy RL at small scale: a rollout worker samples with weights that lag the trainer,
the trainer runs the RL step on what the worker recorded (token ids, logprobs, routing), weights are pushed
to the worker every `push_every` trainer steps, and samples staler than `rl.max_staleness` are dropped.

The worker and the trainer are interleaved in one process (deterministic, and fair on a 2-core CPU): the
worker keeps `queue_depth` batches generated ahead of the trainer, so a batch the trainer consumes at
version v was sampled with weights of version w with v - w <= queue_depth + push_every - 1 (a dropped batch
is replaced by the next one in the queue and a fresh one is generated). GLM-5's rollout engine and trainer
overlap the same way, with the queue in the data buffer.

The task is any object with `prompts(rng, n)`, `reward(prompt, response)`, `validate(vocab_size)`,
`seq_len`, `answer_len` and `eos` (glm5_jax/examples/sort_task.py: sort a list of digits, reward 1 for the
exact sorted list followed by EOS). `glm5 rl-async` runs it from a config file (glm5_jax/commands/rl_async.py).

`importance_correction: false` is the comparison run without any correction: the trainer overwrites the
recorded rollout logprobs with its own current logprobs, so every ratio is 1 and the update is plain
policy gradient on stale samples. The fraction of tokens the double-sided band would have masked is still
reported (`would_mask_frac`).
"""

from __future__ import annotations

import collections
import functools
import time
from pathlib import Path
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np

from glm5_jax.checkpoint import Checkpointer
from glm5_jax.config import CheckpointConfig, ConfigError, DataConfig, ModelConfig, TrainConfig
from glm5_jax.config.async_rl import AsyncRLConfig
from glm5_jax.config.experiment import ExperimentConfig, experiment_to_dict
from glm5_jax.config.mesh import MeshConfig
from glm5_jax.config.optim import OptimConfig
from glm5_jax.config.rl import RLStepConfig, require_rl_step_config
from glm5_jax.generation import SamplingParams, generate, to_rollout_records
from glm5_jax.model.token_logprobs import token_logprobs
from glm5_jax.model.transformer import forward
from glm5_jax.parallel.trainer import build_trainer
from glm5_jax.train.rl_step import rl_batch


def copy_tree(tree):
    """A copy of every leaf: the worker must not see the trainer's later (donated) updates."""
    return jax.tree.map(jnp.copy, tree)


def require_train_fits(train_config: TrainConfig, config: AsyncRLConfig, task) -> None:
    """The trainer's batch is one worker batch: mode rl, `prompts_per_step * group_size` rows of the task's
    sequence length."""
    wanted = {"mode": "rl", "batch_size": config.batch_size, "seq_len": task.seq_len}
    for name, value in wanted.items():
        if getattr(train_config, name) != value:
            raise ConfigError(f"train.{name}={getattr(train_config, name)!r} is invalid here: the asynchronous RL "
                              f"driver needs train.mode 'rl', train.batch_size = prompts_per_step * group_size = "
                              f"{config.batch_size} (async: section) and train.seq_len = {task.seq_len} (the task's "
                              "prompt and answer)")


def greedy_accuracy(params, model_config: ModelConfig, task, prompts: np.ndarray) -> float:
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

    def __init__(self, params, version: int, model_config: ModelConfig, task, config: AsyncRLConfig):
        self.params, self.version = copy_tree(params), version
        self.model_config, self.task, self.config = model_config, task, config
        self.rng = np.random.default_rng(config.seed + 2)
        self.batches = 0

    def push(self, params, version: int) -> None:
        self.params, self.version = copy_tree(params), version

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
                 rl_config: RLStepConfig, config: AsyncRLConfig, task,
                 log: Callable[[dict], None] = lambda row: None, mesh: MeshConfig = MeshConfig(fsdp=-1),
                 checkpoint_dir: Path | None = None) -> list[dict]:
    """RL from `params` with a lagging worker on `mesh` (default: every device); returns (and passes to `log`)
    one metrics row per trainer step. With `checkpoint_dir` the final parameters and optimizer state are saved
    there (a checkpoint `glm5 train`'s Checkpointer reads)."""
    config.validate()
    task.validate(model_config.vocab_size)
    rl_config = require_rl_step_config(rl_config)
    require_train_fits(train_config, config, task)
    experiment = ExperimentConfig(model=model_config, optim=optim_config, train=train_config, data=DataConfig(),
                                  checkpoint=CheckpointConfig(), mesh=mesh, rl=rl_config)
    trainer = build_trainer(experiment)
    state = trainer.state_from(params)
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
        state, metrics = trainer.step(state, batch)
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
    if checkpoint_dir is not None:
        with Checkpointer(checkpoint_dir) as checkpointer:
            checkpointer.save_if_finite(int(state.step), loss=rows[-1]["loss"], params=state.params,
                                        opt_state=state.opt_state, config=experiment_to_dict(experiment), force=True)
    return rows
