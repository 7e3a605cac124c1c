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

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from glm5_jax.config import ConfigError

LOSS_MASK = "loss_mask"
ROLLOUT_LOGPROBS = "rollout_logprobs"
ADVANTAGES = "advantages"
OLD_LOGPROBS = "old_logprobs"
TEACHER_LOGPROBS = "teacher_logprobs"


# ---------------------------------------------------------------------------------------------
# Advantage estimators.
# Sample estimators run on the host when a batch is built (a group must be seen whole, and a micro-batch
# may hold only part of it); token estimators need the current policy and run inside the loss.
# ---------------------------------------------------------------------------------------------

def _group_stats(rewards, group_ids):
    rewards = np.asarray(rewards, np.float64)
    _, group_index = np.unique(np.asarray(group_ids), return_inverse=True)
    counts = np.bincount(group_index)
    means = np.bincount(group_index, weights=rewards) / counts
    centred = rewards - means[group_index]
    stds = np.sqrt(np.bincount(group_index, weights=centred**2) / counts)
    return centred, stds[group_index]


def group_mean_advantages(rewards, group_ids, config: "RLConfig") -> np.ndarray:
    """reward - mean of its group's rewards (GLM-5 agentic RL)."""
    centred, _ = _group_stats(rewards, group_ids)
    return centred.astype(np.float32)


def group_mean_std_advantages(rewards, group_ids, config: "RLConfig") -> np.ndarray:
    """(reward - group mean) / (group std + advantage_eps) (GRPO); population std, so a group of one gives 0."""
    centred, stds = _group_stats(rewards, group_ids)
    return (centred / (stds + config.advantage_eps)).astype(np.float32)


def on_policy_distillation_advantages(logp, batch):
    """Per token sg(logp_teacher - logp_theta): the reverse-KL reward of on-policy distillation."""
    return jax.lax.stop_gradient(batch[TEACHER_LOGPROBS] - logp)


SAMPLE_ADVANTAGE_ESTIMATORS = {
    "group_mean": group_mean_advantages,
    "group_mean_std": group_mean_std_advantages,
}
TOKEN_ADVANTAGE_ESTIMATORS = {
    "on_policy_distillation": on_policy_distillation_advantages,
}
ADVANTAGE_ESTIMATORS = (*SAMPLE_ADVANTAGE_ESTIMATORS, *TOKEN_ADVANTAGE_ESTIMATORS)


def sample_advantages(rewards, group_ids, config: "RLConfig") -> np.ndarray:
    """One advantage per sample for the configured estimator; zeros for a token-level estimator."""
    estimator = SAMPLE_ADVANTAGE_ESTIMATORS.get(config.advantage)
    if estimator is None:
        return np.zeros(len(rewards), np.float32)
    return estimator(rewards, group_ids, config)


def token_advantages(logp, batch, config: "RLConfig"):
    """[B, S] advantages: the batch's stored ones, or the configured token estimator's."""
    estimator = TOKEN_ADVANTAGE_ESTIMATORS.get(config.advantage)
    return batch[ADVANTAGES] if estimator is None else estimator(logp, batch)


# ---------------------------------------------------------------------------------------------
# Configuration.
# ---------------------------------------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class RLConfig:
    """RL objective. eps_low / eps_high have no default: double_sided_is and icepop_grpo refuse to run
    without them (GLM-5 gives no values for agentic RL; 0.2 / 0.28 for reasoning RL)."""

    loss: str = "double_sided_is"
    eps_low: float | None = None
    eps_high: float | None = None
    # icepop_grpo keeps tokens with pi_old / pi_rollout in [1/beta, beta].
    beta: float = 2.0
    # tis truncates pi_theta / pi_rollout at this value.
    tis_cap: float = 2.0
    advantage: str = "group_mean"
    advantage_eps: float = 1e-6
    # The log-ratio is clamped before exp so a missing or wild logprob cannot overflow.
    log_ratio_clip: float = 20.0
    # Samples generated with weights more than this many versions behind the trainer are dropped (None: keep).
    max_staleness: int | None = None

    def validate(self) -> "RLConfig":
        def fail(field, valid):
            raise ConfigError(f"RLConfig.{field}={getattr(self, field)!r} is invalid: {valid}")

        if self.loss not in RL_LOSSES:
            fail("loss", f"must be one of {sorted(RL_LOSSES)}")
        if self.advantage not in ADVANTAGE_ESTIMATORS:
            fail("advantage", f"must be one of {list(ADVANTAGE_ESTIMATORS)}")
        if self.loss in ("double_sided_is", "icepop_grpo"):
            for field in ("eps_low", "eps_high"):
                if getattr(self, field) is None:
                    fail(field, f"loss {self.loss!r} needs it set explicitly (no default), e.g. 0.2")
        if self.eps_low is not None and not 0 < self.eps_low < 1:
            fail("eps_low", "must be in (0, 1)")
        if self.eps_high is not None and not self.eps_high > 0:
            fail("eps_high", "must be > 0")
        if not self.beta > 1:
            fail("beta", "must be > 1 (the kept band is [1/beta, beta])")
        if not self.tis_cap > 0:
            fail("tis_cap", "must be > 0")
        if not self.advantage_eps > 0:
            fail("advantage_eps", "must be > 0")
        if not self.log_ratio_clip > 0:
            fail("log_ratio_clip", "must be > 0")
        if self.max_staleness is not None and (isinstance(self.max_staleness, bool)
                                               or not isinstance(self.max_staleness, int)
                                               or self.max_staleness < 0):
            fail("max_staleness", "must be None or a non-negative integer")
        return self


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
