"""Off-policy RL losses against stored rollout logprobs, advantage estimators and mismatch metrics.

Every loss is a pure function `loss(logp, batch, config, entropy=None) -> (weighted_sum, denominator,
metrics)`, registered by name in `RL_LOSSES`. `logp` [B, S] are the trainer's fp32 logprobs of the target
tokens (`token_logprobs`, at the rollout temperature); `batch` holds [B, S] arrays aligned the same way
(position t scores token t + 1, see `glm5_jax.data.rollouts.make_batch`):

  loss_mask         1 on model-generated target tokens, 0 elsewhere (tool output, prompt, padding)
  rollout_logprobs  logprobs recorded by the rollout engine (the behaviour policy)
  advantages        per-token advantages (from a sample estimator, broadcast over the response)
  old_logprobs      optional pi_old logprobs (icepop_grpo)
  teacher_logprobs  optional teacher logprobs (on-policy distillation)

The loss is `weighted_sum / denominator`; both are returned so gradient accumulation and cross-host
reduction stay exact (sum both, divide once). The denominator counts every loss-mask token, including tokens
whose gradient a band removed: dividing by the kept tokens would up-weight the survivors.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from glm5_jax.config.rl import RL_LOSS_NAMES, TOKEN_ADVANTAGE_NAMES, RLConfig

LOSS_MASK = "loss_mask"
ROLLOUT_LOGPROBS = "rollout_logprobs"
ADVANTAGES = "advantages"
OLD_LOGPROBS = "old_logprobs"
TEACHER_LOGPROBS = "teacher_logprobs"


# ---------------------------------------------------------------------------------------------
# Token advantage estimators: they need the current policy and run inside the loss (the sample estimators
# run on the host when a batch is built: `glm5_jax.data.advantages`).
# ---------------------------------------------------------------------------------------------

def on_policy_distillation_advantages(logp, batch):
    """Per token sg(logp_teacher - logp_theta): the reverse-KL reward of on-policy distillation."""
    return jax.lax.stop_gradient(batch[TEACHER_LOGPROBS] - logp)


TOKEN_ADVANTAGE_ESTIMATORS = {
    "on_policy_distillation": on_policy_distillation_advantages,
}


def token_advantages(logp, batch, config: RLConfig):
    """[B, S] advantages: the batch's stored ones, or the configured token estimator's."""
    estimator = TOKEN_ADVANTAGE_ESTIMATORS.get(config.advantage)
    return batch[ADVANTAGES] if estimator is None else estimator(logp, batch)


# ---------------------------------------------------------------------------------------------
# Shared pieces.
# ---------------------------------------------------------------------------------------------

def _check_batch(logp, batch, config: RLConfig, required: tuple[str, ...]):
    config.validate()
    needed = (LOSS_MASK, ROLLOUT_LOGPROBS, *required)
    if config.advantage in TOKEN_ADVANTAGE_ESTIMATORS:
        needed += (TEACHER_LOGPROBS,)
    else:
        needed += (ADVANTAGES,)
    for key in needed:
        if key not in batch:
            raise ValueError(f"batch has no {key!r} field; loss {config.loss!r} with advantage "
                             f"{config.advantage!r} needs {list(needed)}")
    for key in (*needed, OLD_LOGPROBS):
        if key in batch and jnp.shape(batch[key]) != jnp.shape(logp):
            raise ValueError(f"batch[{key!r}] has shape {jnp.shape(batch[key])}; expected logp's shape "
                             f"{jnp.shape(logp)}")


def _inputs(logp, batch, config: RLConfig):
    """Loss weights, a bool loss mask and masked-to-zero copies of the inputs: the zeros keep NaN or garbage
    outside the mask from reaching the loss or its gradient."""
    weight = jnp.asarray(batch[LOSS_MASK], jnp.float32)
    mask = weight > 0
    logp = jnp.where(mask, logp, 0.0)
    rollout = jnp.where(mask, batch[ROLLOUT_LOGPROBS], 0.0)
    clean = {key: jnp.where(mask, value, 0.0) for key, value in batch.items()
             if key in (OLD_LOGPROBS, TEACHER_LOGPROBS)}
    advantages = jnp.where(mask, token_advantages(logp, {**batch, **clean}, config), 0.0)
    return weight, mask, logp, rollout, advantages, clean


def _ratio(log_numerator, log_denominator, config: RLConfig):
    clip = config.log_ratio_clip
    return jnp.exp(jnp.clip(log_numerator - log_denominator, -clip, clip))


def _masked_mean(values, mask, count):
    return jnp.sum(jnp.where(mask, values, 0.0)) / jnp.maximum(count, 1.0)


def _common_metrics(logp, batch, config: RLConfig, entropy, mask, advantages):
    """Policy-vs-rollout mismatch and advantage statistics over loss tokens (no gradient); `logp` is
    already zero outside the mask."""
    logp = jax.lax.stop_gradient(logp)
    count = jnp.sum(mask)
    rollout = jnp.where(mask, batch[ROLLOUT_LOGPROBS], 0.0)
    ratio = _ratio(logp, rollout, config)
    delta = jnp.clip(rollout - logp, -config.log_ratio_clip, config.log_ratio_clip)
    advantage_mean = _masked_mean(advantages, mask, count)
    has_tokens = count > 0
    metrics = {
        "loss_tokens": count.astype(jnp.float32),
        "ratio_mean": _masked_mean(ratio, mask, count),
        "ratio_min": jnp.where(has_tokens, jnp.min(jnp.where(mask, ratio, jnp.inf)), 0.0),
        "ratio_max": jnp.where(has_tokens, jnp.max(jnp.where(mask, ratio, -jnp.inf)), 0.0),
        "mismatch_k3_kl": _masked_mean(jnp.exp(delta) - delta - 1.0, mask, count),
        "advantage_mean": advantage_mean,
        "advantage_std": jnp.sqrt(_masked_mean((advantages - advantage_mean) ** 2, mask, count)),
        "nonfinite_logp": jnp.sum(mask & ~jnp.isfinite(logp)).astype(jnp.float32),
        "nonfinite_rollout_logprobs": jnp.sum(mask & ~jnp.isfinite(batch[ROLLOUT_LOGPROBS])).astype(jnp.float32),
    }
    if entropy is not None:
        metrics["entropy_mean"] = _masked_mean(jax.lax.stop_gradient(entropy), mask, count)
    return metrics


def _fractions(prefix, outside, mask, advantages, count):
    """Fraction of loss tokens flagged by `outside`, overall and split by the advantage's sign."""
    outside = outside & mask
    return {
        f"{prefix}_frac": jnp.sum(outside) / jnp.maximum(count, 1.0),
        f"{prefix}_pos_adv_frac": jnp.sum(outside & (advantages > 0)) / jnp.maximum(count, 1.0),
        f"{prefix}_neg_adv_frac": jnp.sum(outside & (advantages < 0)) / jnp.maximum(count, 1.0),
    }


# ---------------------------------------------------------------------------------------------
# Losses.
# ---------------------------------------------------------------------------------------------

def double_sided_is(logp, batch, config: RLConfig, entropy=None):
    """GLM-5 agentic RL: -sg(r * [1 - eps_low < r < 1 + eps_high]) * A * logp with r = pi_theta / pi_rollout.

    Inside the open band the gradient is A * grad(pi) / pi_rollout; outside (edges included) it is zero.
    """
    _check_batch(logp, batch, config, ())
    weight, mask, logp, rollout, advantages, _ = _inputs(logp, batch, config)
    ratio = _ratio(logp, rollout, config)
    lower, upper = 1.0 - config.eps_low, 1.0 + config.eps_high
    keep = (ratio > lower) & (ratio < upper)
    coefficient = jax.lax.stop_gradient(jnp.where(keep, ratio, 0.0))
    weighted_sum = jnp.sum(-coefficient * advantages * logp * weight)
    denominator = jnp.sum(weight)
    count = jnp.sum(mask)
    metrics = _common_metrics(logp, batch, config, entropy, mask, advantages)
    ratio = jax.lax.stop_gradient(ratio)
    metrics.update(_fractions("masked_below", ratio <= lower, mask, advantages, count))
    metrics.update(_fractions("masked_above", ratio >= upper, mask, advantages, count))
    return weighted_sum, denominator, metrics


def icepop_grpo(logp, batch, config: RLConfig, entropy=None):
    """GLM-5 reasoning RL: PPO clip on pi_theta / pi_old times pop(pi_old / pi_rollout).

    pop(rho) = rho inside [1/beta, beta] and 0 outside (IcePop); pi_old is the batch's `old_logprobs` when
    present, else the rollout logprobs (then pop is 1 and this is plain GRPO with token-level averaging).
    """
    _check_batch(logp, batch, config, ())
    weight, mask, logp, rollout, advantages, clean = _inputs(logp, batch, config)
    old = clean.get(OLD_LOGPROBS, rollout)
    ratio = _ratio(logp, old, config)
    clipped = jnp.clip(ratio, 1.0 - config.eps_low, 1.0 + config.eps_high)
    surrogate = jnp.minimum(ratio * advantages, clipped * advantages)
    rho = _ratio(old, rollout, config)
    in_band = (rho >= 1.0 / config.beta) & (rho <= config.beta)
    pop = jnp.where(in_band, rho, 0.0)
    weighted_sum = jnp.sum(-pop * surrogate * weight)
    denominator = jnp.sum(weight)
    count = jnp.sum(mask)
    metrics = _common_metrics(logp, batch, config, entropy, mask, advantages)
    ratio = jax.lax.stop_gradient(ratio)
    metrics["policy_ratio_mean"] = _masked_mean(ratio, mask, count)
    metrics["clip_frac"] = _masked_mean((clipped * advantages < ratio * advantages).astype(jnp.float32),
                                        mask, count)
    metrics.update(_fractions("popped_below", rho < 1.0 / config.beta, mask, advantages, count))
    metrics.update(_fractions("popped_above", rho > config.beta, mask, advantages, count))
    return weighted_sum, denominator, metrics


def tis(logp, batch, config: RLConfig, entropy=None):
    """Truncated importance sampling: -sg(min(pi_theta / pi_rollout, tis_cap)) * A * logp."""
    _check_batch(logp, batch, config, ())
    weight, mask, logp, rollout, advantages, _ = _inputs(logp, batch, config)
    ratio = _ratio(logp, rollout, config)
    coefficient = jax.lax.stop_gradient(jnp.minimum(ratio, config.tis_cap))
    weighted_sum = jnp.sum(-coefficient * advantages * logp * weight)
    denominator = jnp.sum(weight)
    count = jnp.sum(mask)
    metrics = _common_metrics(logp, batch, config, entropy, mask, advantages)
    metrics.update(_fractions("truncated", jax.lax.stop_gradient(ratio) > config.tis_cap, mask, advantages,
                              count))
    return weighted_sum, denominator, metrics


RL_LOSSES = {
    "double_sided_is": double_sided_is,
    "icepop_grpo": icepop_grpo,
    "tis": tis,
}


def get_rl_loss(name: str):
    """The registered loss called `name`."""
    if name not in RL_LOSSES:
        raise ValueError(f"RL loss {name!r} is unknown; registered losses are {sorted(RL_LOSSES)}")
    return RL_LOSSES[name]

if tuple(RL_LOSSES) != RL_LOSS_NAMES or tuple(TOKEN_ADVANTAGE_ESTIMATORS) != TOKEN_ADVANTAGE_NAMES:
    raise ImportError("glm5_jax.config.rl lists RL losses / token advantage estimators that differ from the "
                      f"registered ones: {list(RL_LOSSES)} / {list(TOKEN_ADVANTAGE_ESTIMATORS)}")
