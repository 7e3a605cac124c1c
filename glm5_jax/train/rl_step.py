"""Mode `rl` of the training step: its objective (`RLObjective`) and the host-side pieces a run needs around it
(the optimizer with the frozen indexer, records -> validated, filtered batch).

The objective runs the model without logits or MTP, replays the rollout engine's routing when the batch
carries it and the run enables replay, computes fp32 logprobs of the targets at each sample's rollout
temperature (`token_logprobs`, vocabulary chunks), and applies the registered loss (`glm5_jax.train.rl`).
Its value is `weighted_sum(microbatch) / loss tokens(whole step)`, so accumulated microbatches give the
exact step objective. Metrics come back as sums over microbatches too: token means are weighted by each
microbatch's share of the step's loss tokens (exact); ratio_min / ratio_max / advantage_std are the mean
of the per-microbatch values; counts (loss_tokens, non-finite counts) are plain sums.

Routing replay. A batch from `make_batch` holds `expert_choices` [B, L_moe, S, A] and `indexer_topk`
[B, L, S, N] when the records carry them; `forward` takes them layer-major, so they are transposed here.
With replay the router's correction bias plays no part in the trainer's routing: the tokens are scored by
the very experts (and attend to the very keys) that produced them at generation time.

Router bias. Replayed routing does not depend on the bias, and the rollout engine's routing does; the RL
recipes therefore set `train.bias_update_rate: 0` (the bias stays as pre-training left it). The step still
applies the update when the rate is > 0, from the replayed expert counts.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import jax.numpy as jnp

from glm5_jax.config import ModelConfig, TrainConfig
from glm5_jax.config.optim import OptimConfig
from glm5_jax.config.rl import RLConfig, require_rl_step_config
from glm5_jax.data.rollouts import RolloutRecord, filter_and_pad, make_batch, validate_records
from glm5_jax.model.token_logprobs import token_logprobs
from glm5_jax.model.transformer import forward
from glm5_jax.train.rl import (ADVANTAGES, LOSS_MASK, ROLLOUT_LOGPROBS, TEACHER_LOGPROBS,
                               TOKEN_ADVANTAGE_ESTIMATORS, get_rl_loss)

_SEQUENCE_KEYS = ("tokens", "targets", "positions", "segment_ids", LOSS_MASK, ROLLOUT_LOGPROBS)
# Summed as they are; averaged over microbatches; everything else is a token mean weighted by its share.
_COUNT_METRICS = ("loss_tokens", "nonfinite_logp", "nonfinite_rollout_logprobs")
_PER_MICROBATCH_METRICS = ("ratio_min", "ratio_max", "advantage_std")


def rl_optim_config(optim_config: OptimConfig, rl_config) -> OptimConfig:
    """The optimizer settings for RL: `trainable: all` becomes `non_indexer` unless rl.train_indexer is set,
    so the DSA indexer is frozen by default (no update, no weight decay, no optimizer state)."""
    step_config = require_rl_step_config(rl_config)
    if step_config.train_indexer or optim_config.trainable != "all":
        return optim_config
    return dataclasses.replace(optim_config, trainable="non_indexer")


def required_batch_keys(config: RLConfig) -> tuple[str, ...]:
    """[B, S] fields the loss reads (the per-sample `temperature` [B] is needed too)."""
    advantage = TEACHER_LOGPROBS if config.advantage in TOKEN_ADVANTAGE_ESTIMATORS else ADVANTAGES
    return (*_SEQUENCE_KEYS, advantage)


def _routing_inputs(mb: dict, replay: bool) -> dict:
    if not replay:
        return {}
    inputs = {}
    if "expert_choices" in mb:
        inputs["expert_choices"] = jnp.swapaxes(mb["expert_choices"], 0, 1)  # [B, L_moe, S, A] -> layer-major
    if "indexer_topk" in mb:
        inputs["topk_indices"] = jnp.swapaxes(mb["indexer_topk"], 0, 1)
    return inputs


class RLObjective:
    """The objective of mode "rl" (interface in glm5_jax.train.objective); `.config` is the resolved
    RLStepConfig."""

    updates_router_bias = True  # from the replayed expert counts, when train.bias_update_rate > 0

    def __init__(self, model_config: ModelConfig, train_config: TrainConfig, rl_config, mesh=None):
        self.model_config, self.train_config, self.mesh = model_config, train_config, mesh
        self.config = require_rl_step_config(rl_config)
        self.loss_fn = get_rl_loss(self.config.objective.loss)
        self.required_keys = required_batch_keys(self.config.objective)

    def denominators(self, batch: dict) -> dict:
        loss_tokens = jnp.sum(jnp.asarray(batch[LOSS_MASK], jnp.float32))
        rows = jnp.sum(jnp.any(batch["segment_ids"] > 0, axis=-1))
        return {"loss_tokens": jnp.maximum(loss_tokens, 1.0), "rows": jnp.maximum(rows, 1).astype(jnp.float32)}

    def __call__(self, params, mb: dict, dens: dict):
        if "temperature" not in mb:
            raise ValueError("batch has no 'temperature' field: the RL step needs each sample's rollout "
                             "temperature [B] (make_batch writes it)")
        out = forward(params, mb["tokens"], config=self.model_config, positions=mb["positions"],
                      segment_ids=mb["segment_ids"], return_logits=False, mtp_steps=0, mesh=self.mesh,
                      **_routing_inputs(mb, self.config.replay_routing))
        logp, entropy = token_logprobs(out.hidden, params["lm_head"]["kernel"], mb["targets"],
                                       temperature=mb["temperature"], vocab_chunk=self.train_config.vocab_chunk,
                                       compute_entropy=True, mesh=self.mesh)
        weighted_sum, _, metrics = self.loss_fn(logp, mb, self.config.objective, entropy)
        value = weighted_sum / dens["loss_tokens"]
        share = metrics["loss_tokens"] / dens["loss_tokens"]
        sums = {"loss": value}
        for name, metric in metrics.items():
            if name in _COUNT_METRICS:
                sums[name] = metric
            elif name in _PER_MICROBATCH_METRICS:
                sums[name] = metric / self.train_config.microbatches
            else:
                sums[name] = metric * share
        if "rewards" in mb:
            real_rows = jnp.any(mb["segment_ids"] > 0, axis=-1)
            sums["reward_mean"] = jnp.sum(jnp.where(real_rows, mb["rewards"], 0.0)) / dens["rows"]
        return value, (sums, {"main": out.aux.get("expert_counts")})

    def metrics(self, sums: dict, dens: dict, counts: dict) -> dict:
        """The sums are the metrics already (each microbatch's share of the step was taken in `__call__`)."""
        return dict(sums)


def rl_batch(records: Sequence[RolloutRecord], *, model_config: ModelConfig, seq_len: int, rl_config,
             current_version: int, batch_size: int | None = None,
             group_size: int | None = None) -> tuple[dict | None, dict[str, int]]:
    """Records -> (batch for the RL step, filter counts): validate every record (errors name the rollout),
    drop environment failures and samples staler than rl.max_staleness versions, repair or drop groups,
    then build the fixed-shape batch with advantages over the kept groups (None when nothing is left)."""
    loss_config = require_rl_step_config(rl_config).objective
    validate_records(records, vocab_size=model_config.vocab_size)
    kept, counts = filter_and_pad(records, current_version=current_version,
                                  max_staleness=loss_config.max_staleness, group_size=group_size)
    if not kept:
        return None, counts
    return make_batch(kept, seq_len=seq_len, config=loss_config, batch_size=batch_size), counts
