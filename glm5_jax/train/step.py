"""The jitted training step: `make_train_step(...)` returns a pure `(state, batch) -> (state, metrics)`.

Modes: `pretrain` / `sft` (next-token + MTP + balance losses; SFT differs only by its loss mask),
`dsa_warmup` (dense attention, indexer-only KL to the main attention), `dsa_sparse` (top-k attention,
LM loss for the model + KL over the selected set for the detached indexer), `rl` (see `glm5_jax.train.rl`).
Microbatches are accumulated exactly: every loss is a weighted sum over the whole step divided by a
denominator computed from the batch's masks before any gradient is taken.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax
from einops import rearrange

from glm5_jax.config import ModelConfig, TrainConfig
from glm5_jax.model.transformer import forward
from glm5_jax.train import losses
from glm5_jax.train.balancing import update_correction_biases
from glm5_jax.train.finite_guard import keep_state_unless_finite
from glm5_jax.train.rl_step import rl_objective

INDEXER_MODE = {"dsa_warmup": "dense_warmup", "dsa_sparse": "sparse"}
LM_BATCH_KEYS = ("tokens", "segment_ids", "positions", "loss_mask")


class TrainState(NamedTuple):
    step: jax.Array
    params: Any
    opt_state: Any


def init_train_state(params, optimizer: optax.GradientTransformation) -> TrainState:
    return TrainState(step=jnp.zeros((), jnp.int32), params=params, opt_state=optimizer.init(params))


def validate_batch(batch: dict, model_config: ModelConfig, train_config: TrainConfig,
                   required: tuple[str, ...] = LM_BATCH_KEYS) -> None:
    """Shapes and dtypes before compiling; token range when the values are concrete."""
    missing = [k for k in required if k not in batch]
    if missing:
        raise ValueError(f"batch is missing {missing}; a training batch needs {list(required)}")
    shape = batch["tokens"].shape
    if len(shape) != 2 or shape[0] % train_config.microbatches:
        raise ValueError(f"batch['tokens'] has shape {shape}: needs [batch, seq] with batch divisible by "
                         f"train.microbatches={train_config.microbatches}")
    for key in required:
        if batch[key].shape[:2] != shape:
            raise ValueError(f"batch[{key!r}] has shape {batch[key].shape}, tokens have {shape}")
    tokens = batch["tokens"]
    if isinstance(tokens, jax.core.Tracer):
        return
    if isinstance(tokens, jax.Array) and not tokens.is_fully_addressable:
        # A global batch spanning other processes: each checks the rows it holds.
        tokens = np.concatenate([np.asarray(shard.data).reshape(-1) for shard in tokens.addressable_shards])
    else:
        tokens = np.asarray(jax.device_get(tokens))
    if tokens.size:
        if tokens.min() < 0 or tokens.max() >= model_config.vocab_size:
            raise ValueError(f"batch['tokens'] holds ids in [{tokens.min()}, {tokens.max()}], outside the "
                             f"vocabulary [0, {model_config.vocab_size})")


def _denominators(batch: dict, model_config: ModelConfig, mtp_steps: int) -> dict:
    """Global loss denominators from the masks alone (they do not depend on parameters)."""
    tokens, seg, mask = batch["tokens"], batch["segment_ids"], batch["loss_mask"]
    _, weight = losses.next_token_targets(tokens, seg, mask)
    mtp = sum(losses.next_token_targets(tokens, seg, mask, shift=k + 2)[1].sum() for k in range(mtp_steps))
    mtp = jnp.float32(mtp)
    real = (seg > 0).sum()
    kl_layers = model_config.num_hidden_layers + mtp_steps
    return {
        "lm": jnp.maximum(weight.sum(), 1.0),
        "mtp": jnp.maximum(mtp, 1.0),
        "balance": jnp.float32(tokens.shape[0]),
        "indexer_kl": jnp.maximum(real * kl_layers, 1).astype(jnp.float32),
    }


def _split_microbatches(batch: dict, n: int) -> dict:
    """[B, ...] -> [n, B/n, ...], microbatch m holding rows m, m+n, ...: strided, so that every device keeps
    its own rows in every microbatch when the batch is sharded in contiguous blocks."""
    return jax.tree.map(lambda a: rearrange(a, "(b n) ... -> n b ...", n=n), batch)


def _lm_objective(params, mb: dict, dens: dict, model_config: ModelConfig, train_config: TrainConfig,
                  mtp_steps: int, mesh):
    mode = train_config.mode
    indexer_mode = INDEXER_MODE.get(mode)
    out = forward(params, mb["tokens"], config=model_config, positions=mb["positions"],
                  segment_ids=mb["segment_ids"], return_logits=False, mtp_steps=mtp_steps,
                  indexer_mode=indexer_mode, mesh=mesh)
    kernel = params["lm_head"]["kernel"]
    chunk = train_config.vocab_chunk
    hidden = out.hidden if mode != "dsa_warmup" else jax.lax.stop_gradient(out.hidden)
    lm_sum, _ = losses.cross_entropy(hidden, kernel, mb["tokens"], mb["segment_ids"], mb["loss_mask"], chunk)
    sums = {"lm": lm_sum}
    objective = 0.0 if mode == "dsa_warmup" else lm_sum / dens["lm"]
    moe_aux = {k: v for k, v in out.aux.items() if k != "mtp"}
    if out.mtp_hidden is not None:
        mtp_hidden = out.mtp_hidden if mode != "dsa_warmup" else jax.lax.stop_gradient(out.mtp_hidden)
        sums["mtp"], _ = losses.mtp_cross_entropy(mtp_hidden, kernel, mb["tokens"], mb["segment_ids"],
                                                  mb["loss_mask"], chunk)
        if mode != "dsa_warmup":
            objective += train_config.mtp_loss_weight * sums["mtp"] / dens["mtp"]
    if "balance_terms" in moe_aux:
        sums["balance"], _ = losses.balance_loss(moe_aux)
        if mode != "dsa_warmup":
            objective += train_config.balance_loss_weight * sums["balance"] / dens["balance"]
    if indexer_mode is not None:
        kl_sum, _ = losses.indexer_kl(moe_aux)
        mass = moe_aux["topk_mass_sum"].sum()
        if "mtp" in out.aux:
            kl_sum += out.aux["mtp"]["indexer_kl_sum"].sum()
            mass += out.aux["mtp"]["topk_mass_sum"].sum()
        sums["indexer_kl"], sums["topk_mass"] = kl_sum, mass
        objective += train_config.indexer_kl_weight * kl_sum / dens["indexer_kl"]
    counts = {"main": moe_aux.get("expert_counts")}
    if "mtp" in out.aux:
        counts["mtp"] = out.aux["mtp"]["expert_counts"].sum(0)
    return objective, (sums, counts)


def make_train_step(model_config: ModelConfig, train_config: TrainConfig, optimizer: optax.GradientTransformation,
                    *, lr_schedule=None, rl_config=None, mesh=None, jit: bool = True, state_shardings=None,
                    batch_sharding=None):
    """Build the step for `train_config.mode`. The returned function validates the batch, then runs jitted.

    With `state_shardings` (a TrainState of shardings) and `batch_sharding` (one sharding for every batch key)
    the step is jitted with explicit in and out shardings: the state keeps its layout from step to step (one
    executable for the whole run) and metrics come back replicated."""
    model_config.validate()
    train_config.validate()
    mode = train_config.mode
    mtp_steps = model_config.mtp_num_steps if model_config.num_nextn_predict_layers else 0
    if mode == "rl":
        objective_fn = rl_objective(model_config, train_config, rl_config, mesh)
        required = objective_fn.required_keys
    else:
        required = LM_BATCH_KEYS

    def step(state: TrainState, batch: dict):
        params = state.params
        if mode == "rl":
            dens = objective_fn.denominators(batch)
        else:
            dens = _denominators(batch, model_config, mtp_steps)
        micro = _split_microbatches({k: batch[k] for k in batch}, train_config.microbatches)

        def accumulate(carry, mb):
            grads_acc, sums_acc, counts_acc = carry
            if mode == "rl":
                (_, (sums, counts)), grads = jax.value_and_grad(objective_fn, has_aux=True)(params, mb, dens)
            else:
                (_, (sums, counts)), grads = jax.value_and_grad(_lm_objective, has_aux=True)(
                    params, mb, dens, model_config, train_config, mtp_steps, mesh)
            add = lambda a, b: a + b  # noqa: E731
            return (jax.tree.map(add, grads_acc, grads), jax.tree.map(add, sums_acc, sums),
                    jax.tree.map(add, counts_acc, counts)), None

        first = jax.tree.map(lambda a: a[0], micro)
        shapes = jax.eval_shape(
            (lambda p, m: objective_fn(p, m, dens)) if mode == "rl" else
            (lambda p, m: _lm_objective(p, m, dens, model_config, train_config, mtp_steps, mesh)), params, first)
        zeros = lambda tree: jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), tree)  # noqa: E731
        init = (jax.tree.map(jnp.zeros_like, params), zeros(shapes[1][0]), zeros(shapes[1][1]))
        (grads, sums, counts), _ = jax.lax.scan(accumulate, init, micro)

        updates, opt_state = optimizer.update(grads, state.opt_state, params)
        new_params = optax.apply_updates(params, updates)
        if mode != "dsa_warmup":  # the warm-up freezes everything but the indexer, routing bias included
            new_params = update_correction_biases(new_params, counts, train_config.bias_update_rate,
                                                  config=model_config)
        metrics = _metrics(sums, dens, counts, grads, batch, train_config, mode)
        if lr_schedule is not None:
            metrics["lr"] = lr_schedule(state.step)
        new_params, opt_state, metrics = keep_state_unless_finite(params, state.opt_state, new_params, opt_state,
                                                                  grads, metrics)
        return TrainState(state.step + 1, new_params, opt_state), metrics

    if not jit:
        compiled = step
    elif state_shardings is None:
        compiled = jax.jit(step, donate_argnums=(0,))
    else:
        replicated = jax.sharding.NamedSharding(batch_sharding.mesh, jax.sharding.PartitionSpec())
        compiled = jax.jit(step, donate_argnums=(0,), in_shardings=(state_shardings, batch_sharding),
                           out_shardings=(state_shardings, replicated))

    def run(state: TrainState, batch: dict):
        validate_batch(batch, model_config, train_config, required)
        return compiled(state, batch)

    run.jitted = compiled
    run.required_keys = required
    return run


def _metrics(sums: dict, dens: dict, counts: dict, grads, batch: dict, train_config: TrainConfig, mode: str) -> dict:
    metrics = {"grad_norm": optax.tree.norm(grads), "tokens": (batch["segment_ids"] > 0).sum()}
    if mode == "rl":
        metrics.update(sums)
        return metrics
    metrics["lm_loss"] = sums["lm"] / dens["lm"]
    loss = 0.0 if mode == "dsa_warmup" else metrics["lm_loss"]
    if "mtp" in sums:
        metrics["mtp_loss"] = sums["mtp"] / dens["mtp"]
        loss = loss + (0.0 if mode == "dsa_warmup" else train_config.mtp_loss_weight * metrics["mtp_loss"])
    if "balance" in sums:
        metrics["balance_loss"] = sums["balance"] / dens["balance"]
    if "indexer_kl" in sums:
        metrics["indexer_kl"] = sums["indexer_kl"] / dens["indexer_kl"]
        if mode == "dsa_warmup":  # only there is the dense attention known, so only there is the share measured
            metrics["topk_attention_mass"] = sums["topk_mass"] / dens["indexer_kl"]
        loss = loss + train_config.indexer_kl_weight * metrics["indexer_kl"]
    metrics["loss"] = loss
    if counts.get("main") is not None:
        load = counts["main"].astype(jnp.float32)
        mean = jnp.maximum(load.mean(-1), 1e-9)
        metrics["expert_load_max"] = load.max(-1) / mean  # per MoE layer, relative to a perfectly even load
        metrics["expert_load_min"] = load.min(-1) / mean
        metrics["expert_load_mean"] = load.mean(-1)
    return metrics

