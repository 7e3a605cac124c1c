"""Never apply a non-finite step: the loss and every gradient are checked inside the jitted step before the
update is applied, and the state the step returns after; a step whose loss or gradients are not finite keeps the
previous parameters and optimizer state.

A gradient counts as finite when its sum of squares is (the same sums give `grad_norm`, so the check reads no
gradient twice): a finite gradient whose square overflows (|g| above ~1.8e19, which would turn Adam's second
moments to inf) is refused with the rest. The update is applied under that check, which XLA fuses into the
optimizer's own update of each leaf: checking the new state first and selecting between it and the old one took
a pass over the whole state on its own (the v6e-256 step: 35 GB of HBM traffic per chip). What remains possible,
an update that overflows from finite gradients (a learning rate of 1e30), leaves a state that is not finite
(`non_finite_state` 1): the old one was updated in place, so the runner stops and never saves it.

The step reports `non_finite` (0/1), `non_finite_state` (0/1) and `non_finite_leaf`, the index of the first bad
leaf in `checked_leaf_names` order, and the runner turns that into an error (or a skipped step) naming the leaf.
"""

from __future__ import annotations

import operator

import jax
import jax.numpy as jnp

from glm5_jax.tree_paths import path_string


def _checked(loss, grads, opt_state, params) -> dict:
    return {"loss": loss, "grads": grads, "opt_state": opt_state, "params": params}


def _inexact_leaves(tree) -> list[tuple[str, object]]:
    flat = jax.tree_util.tree_flatten_with_path(tree)[0]
    return [(path_string(path), leaf) for path, leaf in flat if jnp.issubdtype(jnp.result_type(leaf), jnp.inexact)]


def checked_leaf_names(params, opt_state) -> list[str]:
    """Names of the checked leaves, in the order `non_finite_leaf` indexes (gradients mirror the params)."""
    return [name for name, _ in _inexact_leaves(_checked(jnp.float32(0), params, opt_state, params))]


def _first_bad(finite: jax.Array) -> tuple[jax.Array, jax.Array]:
    """(all finite, index of the first False or 0). `finite.all()` would be simplified into a chain of scalar
    `and`s, one per checked leaf, that XLA then fuses into every leaf's select: the tests' 2-layer step grew from
    31K to 120K lines of optimized HLO and compiled ~3x slower (AdamW, CPU: 12-17 s instead of 4-6 s). Read
    through the argmin, the flag is one value computed once."""
    first = jnp.argmin(finite)
    return finite[first], first


def keep_state_unless_finite(old_params, old_opt_state, new_params, new_opt_state, grads, metrics: dict):
    """(params, opt_state, metrics): the new state when the loss and the gradients are finite, else the old one;
    metrics gain `grad_norm` and the flags of the module docstring."""
    squares = jax.tree.map(lambda g: jnp.sum(jnp.square(g)), grads)  # as optax.tree.norm sums them
    metrics = {**metrics, "grad_norm": jnp.sqrt(jax.tree.reduce(operator.add, squares, initializer=0))}
    inputs = [leaf for _, leaf in _inexact_leaves({"loss": metrics["loss"], "grads": squares})]
    inputs_ok, first_bad_input = _first_bad(jnp.stack([jnp.isfinite(leaf).all() for leaf in inputs]))
    keep = lambda new, old: jnp.where(inputs_ok, new, old)  # noqa: E731  (fused into the update, in place)
    params, opt_state = jax.tree.map(keep, new_params, old_params), jax.tree.map(keep, new_opt_state, old_opt_state)
    state = [leaf for _, leaf in _inexact_leaves({"opt_state": opt_state, "params": params})]
    state_ok, first_bad_state = _first_bad(jnp.stack([jnp.isfinite(leaf).all() for leaf in state]))
    metrics = {**metrics, "non_finite": (~(inputs_ok & state_ok)).astype(jnp.int32),
               "non_finite_state": (~state_ok).astype(jnp.int32),
               "non_finite_leaf": jnp.where(inputs_ok, jnp.where(state_ok, -1, len(inputs) + first_bad_state),
                                            first_bad_input).astype(jnp.int32)}
    return params, opt_state, metrics


def largest_parameter(params) -> tuple[str, float]:
    """The parameter leaf with the largest |value|, and that value (a blow-up shows here before it is inf)."""
    leaves = _inexact_leaves(params)
    peaks = jax.device_get([jnp.abs(leaf).max() for _, leaf in leaves])
    index = max(range(len(leaves)), key=lambda i: float(peaks[i]))
    return leaves[index][0], float(peaks[index])


# Settings that most often make a run diverge; named in the error with their values.
LIKELY_CAUSES = ("optim.lr", "optim.grad_clip_norm", "optim.warmup_steps", "train.mtp_loss_weight",
                 "train.balance_loss_weight", "train.indexer_kl_weight", "model.initializer_range")
DIVERGING_PARAMETER = 1e4  # trained weights sit near 1; far above it the run was already blowing up


def describe_non_finite(step: int, host: dict, leaf_names: list[str], settings: dict, params,
                        last_checkpoint: int | None, config_changes: list[str]) -> str:
    """The message for a non-finite step: the first bad leaf, the state kept, and the likely cause."""
    index = int(host["non_finite_leaf"])
    leaf = leaf_names[index] if 0 <= index < len(leaf_names) else f"leaf #{index}"
    if host.get("non_finite_state"):
        lines = [f"step {step} is not finite: {leaf} is the first non-finite value (loss={host.get('loss')}, "
                 f"grad_norm={host.get('grad_norm')}): the update overflowed from finite gradients; the state "
                 "it replaced in place is gone and this one is never saved"]
        when = "after"
    else:
        lines = [f"step {step} is not finite: {leaf} is the first non-finite value (loss={host.get('loss')}, "
                 f"grad_norm={host.get('grad_norm')}); the step was not applied and is not saved"]
        when = "before"
    name, peak = largest_parameter(params)
    lines.append(f"largest |parameter| {when} this step: {peak:.3g} in params/{name}")
    if peak > DIVERGING_PARAMETER:
        lines.append(f"the parameters were already diverging, so the last checkpoint (step {last_checkpoint}) "
                     "may hold them too: resume from an earlier step or start over with a smaller optim.lr")
    if config_changes:
        lines.append("likely cause, the settings changed since the checkpoint this run resumed from: "
                     + "; ".join(config_changes))
    lines.append("settings that usually cause this: " + ", ".join(f"{k}={settings.get(k)}" for k in LIKELY_CAUSES))
    if settings.get("optim.grad_clip_norm") == 0:
        lines.append("gradient clipping is off (optim.grad_clip_norm=0): an inf gradient reaches the optimizer")
    return "\n  ".join(lines)
