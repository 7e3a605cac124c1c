"""What a training step minimises, chosen once from `train.mode`: `make_objective(...)` returns an object with

- `required_keys`: the [B, S] batch fields it reads;
- `denominators(batch)`: every loss's denominator, from the whole step's masks (before any gradient), so
  that microbatches accumulate to the exact step objective;
- `__call__(params, microbatch, dens) -> (value, (sums, counts))`: the value to differentiate, the summed
  loss terms and the per-layer expert counts (summed over microbatches by the step);
- `metrics(sums, dens, counts)`: the step's losses from the summed terms;
- `updates_router_bias`: whether the step applies the aux-loss-free bias update.

`LMObjective` serves pretrain / sft (next-token + MTP + balance losses; SFT differs only by its loss mask),
dsa_warmup (dense attention, indexer-only KL to the main attention) and dsa_sparse (top-k attention, LM loss
for the model + KL over the selected set for the detached indexer); `RLObjective` (glm5_jax.train.rl_step)
serves rl. The losses are weighted in one place (`LMObjective.loss_weights`), for the gradient and for the
reported loss alike.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from glm5_jax.config import ModelConfig, TrainConfig
from glm5_jax.model.transformer import forward
from glm5_jax.train import losses
from glm5_jax.train.rl_step import RLObjective

INDEXER_MODE = {"dsa_warmup": "dense_warmup", "dsa_sparse": "sparse"}
LM_BATCH_KEYS = ("tokens", "segment_ids", "positions", "loss_mask")
_METRIC_NAMES = {"lm": "lm_loss", "mtp": "mtp_loss", "balance": "balance_loss", "indexer_kl": "indexer_kl"}
# Reported separately (its weight is tiny), so `loss` stays comparable across balance settings.
_NOT_IN_REPORTED_LOSS = ("balance",)


def mtp_steps_of(model_config: ModelConfig) -> int:
    return model_config.mtp_num_steps if model_config.num_nextn_predict_layers else 0


class LMObjective:
    """Language-model objective of modes pretrain, sft, dsa_warmup and dsa_sparse."""

    required_keys = LM_BATCH_KEYS

    def __init__(self, model_config: ModelConfig, train_config: TrainConfig, mesh=None):
        self.model_config, self.train_config, self.mesh = model_config, train_config, mesh
        self.mtp_steps = mtp_steps_of(model_config)
        self.indexer_mode = INDEXER_MODE.get(train_config.mode)
        # The DSA warm-up trains the indexer alone: no LM gradient, the routing bias frozen too.
        self.trains_model = train_config.mode != "dsa_warmup"
        self.updates_router_bias = self.trains_model
        # Only with dense attention is the share of attention inside the top-k known.
        self.reports_topk_mass = train_config.mode == "dsa_warmup"

    def denominators(self, batch: dict) -> dict:
        """Global loss denominators from the masks alone (they do not depend on parameters)."""
        tokens, seg, mask = batch["tokens"], batch["segment_ids"], batch["loss_mask"]
        _, weight = losses.next_token_targets(tokens, seg, mask)
        mtp = sum(losses.next_token_targets(tokens, seg, mask, shift=k + 2)[1].sum() for k in range(self.mtp_steps))
        mtp = jnp.float32(mtp)
        real = (seg > 0).sum()
        kl_layers = self.model_config.num_hidden_layers + self.mtp_steps
        return {
            "lm": jnp.maximum(weight.sum(), 1.0),
            "mtp": jnp.maximum(mtp, 1.0),
            "balance": jnp.float32(tokens.shape[0]),
            "indexer_kl": jnp.maximum(real * kl_layers, 1).astype(jnp.float32),
        }

    def loss_weights(self, sums: dict) -> dict:
        """The weight of each loss in the objective, for the losses present (the model's only when the model
        trains): the one place the terms are weighted, for the gradient and the reported loss alike."""
        train = self.train_config
        weights = {"lm": 1.0, "mtp": train.mtp_loss_weight, "balance": train.balance_loss_weight} \
            if self.trains_model else {}
        weights["indexer_kl"] = train.indexer_kl_weight
        return {name: weight for name, weight in weights.items() if name in sums}

    def __call__(self, params, mb: dict, dens: dict):
        out = forward(params, mb["tokens"], config=self.model_config, positions=mb["positions"],
                      segment_ids=mb["segment_ids"], return_logits=False, mtp_steps=self.mtp_steps,
                      indexer_mode=self.indexer_mode, mesh=self.mesh)
        detach = (lambda x: x) if self.trains_model else jax.lax.stop_gradient
        kernel, chunk = params["lm_head"]["kernel"], self.train_config.vocab_chunk
        targets = (mb["tokens"], mb["segment_ids"], mb["loss_mask"])
        sums = {"lm": losses.cross_entropy(detach(out.hidden), kernel, *targets, chunk, self.mesh)[0]}
        moe_aux = {k: v for k, v in out.aux.items() if k != "mtp"}
        if out.mtp_hidden is not None:
            sums["mtp"] = losses.mtp_cross_entropy(detach(out.mtp_hidden), kernel, *targets, chunk, self.mesh)[0]
        if "balance_terms" in moe_aux:
            sums["balance"] = losses.balance_loss(moe_aux)[0]
        if self.indexer_mode is not None:
            kl_sum, mass = losses.indexer_kl(moe_aux)[0], moe_aux["topk_mass_sum"].sum()
            if "mtp" in out.aux:
                kl_sum += out.aux["mtp"]["indexer_kl_sum"].sum()
                mass += out.aux["mtp"]["topk_mass_sum"].sum()
            sums["indexer_kl"], sums["topk_mass"] = kl_sum, mass
        counts = {"main": moe_aux.get("expert_counts")}
        if "mtp" in out.aux:
            counts["mtp"] = out.aux["mtp"]["expert_counts"].sum(0)
        value = sum(weight * sums[name] / dens[name] for name, weight in self.loss_weights(sums).items())
        return value, (sums, counts)

    def metrics(self, sums: dict, dens: dict, counts: dict) -> dict:
        metrics = {_METRIC_NAMES[name]: sums[name] / dens[name] for name in _METRIC_NAMES if name in sums}
        if self.reports_topk_mass:
            metrics["topk_attention_mass"] = sums["topk_mass"] / dens["indexer_kl"]
        metrics["loss"] = sum(weight * metrics[_METRIC_NAMES[name]] for name, weight in self.loss_weights(sums).items()
                              if name not in _NOT_IN_REPORTED_LOSS)
        if counts.get("main") is not None:
            load = counts["main"].astype(jnp.float32)
            mean = jnp.maximum(load.mean(-1), 1e-9)
            metrics["expert_load_max"] = load.max(-1) / mean  # per MoE layer, relative to a perfectly even load
            metrics["expert_load_min"] = load.min(-1) / mean
            metrics["expert_load_mean"] = load.mean(-1)
        return metrics


def make_objective(model_config: ModelConfig, train_config: TrainConfig, rl_config=None, mesh=None):
    """The objective of `train_config.mode` (mode rl needs `rl_config`, see glm5_jax.config.rl)."""
    if train_config.mode == "rl":
        return RLObjective(model_config, train_config, rl_config, mesh)
    return LMObjective(model_config, train_config, mesh)
