"""The jitted training step: `make_train_step(...)` returns a pure `(state, batch) -> (state, metrics)`.

What the step minimises is an objective (glm5_jax.train.objective) chosen once from `train.mode`; the step
itself only accumulates microbatches, applies the optimizer and the router-bias update, and refuses a
non-finite update. Microbatches are accumulated exactly: every loss is a weighted sum over the whole step
divided by a denominator computed from the batch's masks before any gradient is taken.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax
from einops import rearrange

from glm5_jax.config import ModelConfig, TrainConfig
from glm5_jax.train.balancing import update_correction_biases
from glm5_jax.train.finite_guard import keep_state_unless_finite
from glm5_jax.train.objective import LM_BATCH_KEYS, make_objective

# The name scope of the optimizer's update in the step's HLO metadata (op_name "jit(step)/optimizer/..."): `glm5
# compile` reports those FLOPs apart from the model's forward and backward (Muon's Newton-Schulz products).
OPTIMIZER_SCOPE = "optimizer"


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


def _split_microbatches(batch: dict, n: int) -> dict:
    """[B, ...] -> [n, B/n, ...], microbatch m holding rows m, m+n, ...: strided, so that every device keeps
    its own rows in every microbatch when the batch is sharded in contiguous blocks."""
    return jax.tree.map(lambda a: rearrange(a, "(b n) ... -> n b ...", n=n), batch)


def _accumulated_gradients(objective, params, batch: dict, dens: dict, microbatches: int):
    """(grads, sums, counts) of `objective` summed over the batch's microbatches. One microbatch is one
    gradient with no shape pass (tracing the model twice costs compile time, not step time)."""
    grad_fn = jax.value_and_grad(objective, has_aux=True)
    micro = _split_microbatches(batch, microbatches)
    if microbatches == 1:
        # Still inside a loop of one trip: XLA:CPU fuses the backward differently outside one (1-ulp changes in
        # ~4% of the weights per step), and runs resumed from earlier checkpoints would no longer be bit-exact.
        def one(_, mb):
            (_, (sums, counts)), grads = grad_fn(params, mb, dens)
            return None, (grads, sums, counts)
        _, out = jax.lax.scan(one, None, micro)
        return jax.tree.map(lambda a: a[0], out)

    def accumulate(carry, mb):
        (_, sums_and_counts), grads = grad_fn(params, mb, dens)
        return jax.tree.map(lambda a, b: a + b, carry, (grads, *sums_and_counts)), None

    first = jax.tree.map(lambda a: a[0], micro)
    sums_shape, counts_shape = jax.eval_shape(objective, params, first, dens)[1]
    zeros = lambda tree: jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), tree)  # noqa: E731
    init = (jax.tree.map(jnp.zeros_like, params), zeros(sums_shape), zeros(counts_shape))
    (grads, sums, counts), _ = jax.lax.scan(accumulate, init, micro)
    return grads, sums, counts


def make_train_step(model_config: ModelConfig, train_config: TrainConfig, optimizer: optax.GradientTransformation,
                    *, objective=None, lr_schedule=None, rl_config=None, mesh=None, jit: bool = True,
                    state_shardings=None, batch_sharding=None):
    """Build the step that minimises `objective` (default: `make_objective` for `train_config.mode`, with
    `rl_config` in mode rl). The returned function validates the batch, then runs jitted.

    With `state_shardings` (a TrainState of shardings) and `batch_sharding` (one sharding for every batch key)
    the step is jitted with explicit in and out shardings: the state keeps its layout from step to step (one
    executable for the whole run) and metrics come back replicated."""
    model_config.validate()
    train_config.validate()
    if objective is None:
        objective = make_objective(model_config, train_config, rl_config, mesh)
    required = objective.required_keys

    def step(state: TrainState, batch: dict):
        params = state.params
        dens = objective.denominators(batch)
        grads, sums, counts = _accumulated_gradients(objective, params, batch, dens, train_config.microbatches)

        with jax.named_scope(OPTIMIZER_SCOPE):  # `glm5 compile` counts the optimizer's FLOPs apart by this name
            updates, opt_state = optimizer.update(grads, state.opt_state, params)
            new_params = optax.apply_updates(params, updates)
        if objective.updates_router_bias:
            new_params = update_correction_biases(new_params, counts, train_config.bias_update_rate,
                                                  config=model_config)
        metrics = {"tokens": (batch["segment_ids"] > 0).sum(), **objective.metrics(sums, dens, counts)}
        if lr_schedule is not None:
            metrics["lr"] = lr_schedule(state.step)
        # Adds grad_norm: its sums of squares are the gradients' finiteness check.
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
