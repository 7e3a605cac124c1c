"""RL losses and advantages against hand computations on tiny arrays."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from glm5_jax.config import ConfigError
from glm5_jax.config.rl import RLConfig
from glm5_jax.data.advantages import group_mean_advantages, group_mean_std_advantages, sample_advantages
from glm5_jax.train.rl import RL_LOSSES, double_sided_is, get_rl_loss, icepop_grpo, tis

CLIP = 20.0


def _edge_batch():
    """Row 0: in band, exactly at the lower edge, exactly at the upper edge, masked out (NaN rollout).
    Row 1: far below the band (A > 0), far above (A < 0), in band (A < 0), on-policy (A > 0)."""
    logp = np.log(np.array([[0.5, 0.4, 0.3, 0.2], [0.6, 0.3, 0.5, 0.25]], np.float32))
    log_ratio = np.array([[0.05, np.log(0.8), np.log(1.28), 0.0], [-1.0, 1.0, -0.1, 0.0]], np.float32)
    rollout = (logp - log_ratio).astype(np.float32)
    rollout[0, 3] = np.nan
    advantages = np.array([[1.5, 2.0, -1.0, 3.0], [0.7, -0.4, -1.2, 0.9]], np.float32)
    loss_mask = np.array([[1, 1, 1, 0], [1, 1, 1, 1]], np.float32)
    # The band edges are set to the very ratios the loss computes, so tokens [0,1] and [0,2] sit exactly on
    # them (1 - eps_low and 1 + eps_high are then exact in float64 and float32).
    ratio = np.asarray(jnp.exp(jnp.clip(jnp.asarray(logp) - jnp.asarray(np.nan_to_num(rollout)), -CLIP, CLIP)))
    config = RLConfig(loss="double_sided_is", eps_low=1.0 - float(ratio[0, 1]), eps_high=float(ratio[0, 2]) - 1.0)
    batch = {"loss_mask": loss_mask, "rollout_logprobs": rollout, "advantages": advantages}
    return logp, batch, config


def test_double_sided_is_matches_hand_computation_with_edge_tokens_excluded():
    logp, batch, config = _edge_batch()
    weighted_sum, denominator, metrics = double_sided_is(jnp.asarray(logp), batch, config)
    keep = np.array([[1, 0, 0, 0], [0, 0, 1, 1]], bool)
    lp, ro, adv = (np.asarray(x, np.float64) for x in (logp, batch["rollout_logprobs"], batch["advantages"]))
    ratio = np.exp(lp - ro)
    want = sum(-ratio[i, j] * adv[i, j] * lp[i, j] for i, j in zip(*np.nonzero(keep)))
    np.testing.assert_allclose(weighted_sum, want, rtol=1e-5)
    assert float(denominator) == 7.0
    # Below the band: the lower edge (A > 0) and the far-below token (A > 0); above: the upper edge (A < 0)
    # and the far-above token (A < 0).
    np.testing.assert_allclose(metrics["masked_below_frac"], 2 / 7, rtol=1e-6)
    np.testing.assert_allclose(metrics["masked_below_pos_adv_frac"], 2 / 7, rtol=1e-6)
    np.testing.assert_allclose(metrics["masked_below_neg_adv_frac"], 0.0)
    np.testing.assert_allclose(metrics["masked_above_frac"], 2 / 7, rtol=1e-6)
    np.testing.assert_allclose(metrics["masked_above_neg_adv_frac"], 2 / 7, rtol=1e-6)
    on_loss = batch["loss_mask"] > 0
    np.testing.assert_allclose(metrics["ratio_min"], np.exp(-1.0), rtol=1e-5)
    np.testing.assert_allclose(metrics["ratio_max"], np.exp(1.0), rtol=1e-5)
    np.testing.assert_allclose(metrics["ratio_mean"], ratio[on_loss].mean(), rtol=1e-5)
    d = (ro - lp)[on_loss]
    np.testing.assert_allclose(metrics["mismatch_k3_kl"], np.mean(np.exp(d) - d - 1), rtol=1e-5)
    np.testing.assert_allclose(metrics["advantage_mean"], adv[on_loss].mean(), rtol=1e-5)
    np.testing.assert_allclose(metrics["advantage_std"], adv[on_loss].std(), rtol=1e-5)
    assert float(metrics["nonfinite_rollout_logprobs"]) == 0.0  # the NaN sits outside the loss mask


def test_out_of_band_gradient_is_exactly_zero_for_either_advantage_sign():
    logp, batch, config = _edge_batch()
    for sign in (1.0, -1.0):
        signed = dict(batch, advantages=sign * batch["advantages"])
        grad = jax.grad(lambda lp: double_sided_is(lp, signed, config)[0])(jnp.asarray(logp))
        out_of_band = np.array([[0, 1, 1, 1], [1, 1, 0, 0]], bool)  # [0,3] is outside the loss mask
        assert np.all(np.asarray(grad)[out_of_band] == 0.0)
        assert np.all(np.asarray(grad)[~out_of_band] != 0.0)
        assert np.all(np.isfinite(grad))


def test_denominator_counts_band_masked_tokens():
    logp, batch, config = _edge_batch()
    far_off = dict(batch, rollout_logprobs=batch["rollout_logprobs"] + 5.0)  # every ratio now far below
    weighted_sum, denominator, metrics = double_sided_is(jnp.asarray(logp), far_off, config)
    assert float(denominator) == float(double_sided_is(jnp.asarray(logp), batch, config)[1]) == 7.0
    assert float(weighted_sum) == 0.0
    np.testing.assert_allclose(metrics["masked_below_frac"], 1.0)


def _softmax_case():
    rng = np.random.default_rng(0)
    logits = rng.normal(size=(1, 3, 5)).astype(np.float32)
    actions = np.array([[1, 4, 0]])
    pi = np.asarray(jax.nn.softmax(logits))[0, np.arange(3), actions[0]]
    return jnp.asarray(logits), actions, pi


def _action_logp(logits, actions):
    return jnp.take_along_axis(jax.nn.log_softmax(logits), actions[..., None], -1)[..., 0]


def test_in_band_gradient_is_advantage_times_grad_pi_over_pi_rollout():
    logits, actions, pi = _softmax_case()
    pi_rollout = (pi / np.array([1.1, 0.9, 1.05])).astype(np.float32)  # ratios 1.1, 0.9, 1.05: in band
    advantages = np.array([[0.8, -1.3, 2.0]], np.float32)
    batch = {"loss_mask": np.ones((1, 3), np.float32), "rollout_logprobs": np.log(pi_rollout)[None],
             "advantages": advantages}
    config = RLConfig(eps_low=0.2, eps_high=0.28)
    grad = jax.grad(lambda z: double_sided_is(_action_logp(z, actions), batch, config)[0])(logits)
    for s in range(3):
        grad_pi = jax.grad(lambda z: jax.nn.softmax(z)[actions[0, s]])(logits[0, s])
        np.testing.assert_allclose(grad[0, s], -advantages[0, s] * grad_pi / pi_rollout[s], rtol=1e-4, atol=1e-7)


def test_on_policy_double_sided_is_is_the_policy_gradient():
    logits, actions, _ = _softmax_case()
    logp = _action_logp(logits, actions)
    advantages = np.array([[0.8, -1.3, 2.0]], np.float32)
    batch = {"loss_mask": np.ones((1, 3), np.float32), "rollout_logprobs": np.asarray(logp),
             "advantages": advantages}
    config = RLConfig(eps_low=0.2, eps_high=0.28)

    def loss(z):
        weighted_sum, denominator, _ = double_sided_is(_action_logp(z, actions), batch, config)
        return weighted_sum / denominator

    reinforce = jax.grad(lambda z: -jnp.mean(advantages * _action_logp(z, actions)))(logits)
    np.testing.assert_allclose(jax.grad(loss)(logits), reinforce, rtol=1e-5, atol=1e-7)
    np.testing.assert_allclose(loss(logits), -np.mean(advantages * np.asarray(logp)), rtol=1e-6)


def _grpo_batch():
    logp = np.log(np.array([[0.5, 0.4, 0.3], [0.6, 0.3, 0.5]], np.float32))
    old = (logp - np.array([[0.1, -0.5, 0.4], [0.0, 0.3, -0.2]], np.float32)).astype(np.float32)
    advantages = np.array([[1.0, 1.0, -1.0], [-1.0, 0.5, 0.5]], np.float32)
    loss_mask = np.array([[1, 1, 1], [1, 1, 0]], np.float32)
    return logp, old, advantages, loss_mask


def _hand_grpo(logp, old, advantages, mask, eps_low, eps_high):
    ratio = jnp.exp(logp - old)
    surrogate = jnp.minimum(ratio * advantages, jnp.clip(ratio, 1 - eps_low, 1 + eps_high) * advantages)
    return -jnp.sum(surrogate * mask) / jnp.sum(mask)


@pytest.mark.parametrize("store_old", [False, True])
def test_icepop_reduces_to_grpo_when_old_equals_rollout(store_old):
    logp, old, advantages, mask = _grpo_batch()
    batch = {"loss_mask": mask, "rollout_logprobs": old, "advantages": advantages}
    if store_old:
        batch["old_logprobs"] = old
    config = RLConfig(loss="icepop_grpo", eps_low=0.2, eps_high=0.28)

    def loss(lp):
        weighted_sum, denominator, _ = icepop_grpo(lp, batch, config)
        return weighted_sum / denominator

    hand = lambda lp: _hand_grpo(lp, old, advantages, mask, 0.2, 0.28)  # noqa: E731
    np.testing.assert_allclose(loss(jnp.asarray(logp)), hand(jnp.asarray(logp)), rtol=1e-6)
    np.testing.assert_allclose(jax.grad(loss)(jnp.asarray(logp)), jax.grad(hand)(jnp.asarray(logp)), rtol=1e-6)


def test_icepop_pop_weights_by_rho_inside_and_zeroes_outside():
    logp, old, advantages, mask = _grpo_batch()
    log_rho = np.array([[np.log(1.5), np.log(3.0), 0.0], [np.log(0.4), np.log(0.6), 0.0]], np.float32)
    rollout = (old - log_rho).astype(np.float32)
    batch = {"loss_mask": mask, "rollout_logprobs": rollout, "old_logprobs": old, "advantages": advantages}
    config = RLConfig(loss="icepop_grpo", eps_low=0.2, eps_high=0.28, beta=2.0)
    weighted_sum, denominator, metrics = icepop_grpo(jnp.asarray(logp), batch, config)
    ratio = np.exp(logp.astype(np.float64) - old)
    surrogate = np.minimum(ratio * advantages, np.clip(ratio, 0.8, 1.28) * advantages)
    pop = np.array([[1.5, 0.0, 1.0], [0.0, 0.6, 1.0]])  # rho 3 > beta and 0.4 < 1/beta are dropped
    np.testing.assert_allclose(weighted_sum, -np.sum(pop * surrogate * mask), rtol=1e-5)
    assert float(denominator) == 5.0
    np.testing.assert_allclose(metrics["popped_above_frac"], 1 / 5, rtol=1e-6)
    np.testing.assert_allclose(metrics["popped_below_frac"], 1 / 5, rtol=1e-6)


def test_tis_truncates_the_ratio():
    logp = np.log(np.array([[0.5, 0.4, 0.3]], np.float32))
    rollout = (logp - np.array([[np.log(3.0), np.log(0.5), 0.2]], np.float32)).astype(np.float32)
    advantages = np.array([[1.0, -2.0, 0.5]], np.float32)
    batch = {"loss_mask": np.ones((1, 3), np.float32), "rollout_logprobs": rollout, "advantages": advantages}
    config = RLConfig(loss="tis", tis_cap=2.0)
    weighted_sum, denominator, metrics = tis(jnp.asarray(logp), batch, config)
    weight = np.array([2.0, 0.5, np.exp(0.2)])
    np.testing.assert_allclose(weighted_sum, -np.sum(weight * advantages[0] * logp[0]), rtol=1e-5)
    grad = jax.grad(lambda lp: tis(lp, batch, config)[0])(jnp.asarray(logp))
    np.testing.assert_allclose(grad[0], -weight * advantages[0], rtol=1e-5)
    assert float(denominator) == 3.0
    np.testing.assert_allclose(metrics["truncated_frac"], 1 / 3, rtol=1e-6)


def test_group_advantages_by_hand():
    rewards = [1.0, 0.0, 0.0, 1.0, 1.0, 5.0]
    groups = ["a", "a", "a", "a", "b", "c"]
    np.testing.assert_allclose(group_mean_advantages(rewards, groups, RLConfig()),
                               [0.5, -0.5, -0.5, 0.5, 0.0, 0.0])
    config = RLConfig(advantage="group_mean_std", advantage_eps=1e-6)
    # Group a: mean 0.5, population std 0.5; singleton groups have std 0 and advantage 0.
    np.testing.assert_allclose(group_mean_std_advantages(rewards, groups, config),
                               [1.0, -1.0, -1.0, 1.0, 0.0, 0.0], rtol=1e-5)
    np.testing.assert_allclose(sample_advantages(rewards, groups, config), [1.0, -1.0, -1.0, 1.0, 0.0, 0.0],
                               rtol=1e-5)
    distill = RLConfig(advantage="on_policy_distillation")
    np.testing.assert_array_equal(sample_advantages(rewards, groups, distill), np.zeros(6))


def test_on_policy_distillation_advantage_is_stop_gradient_teacher_minus_policy():
    logp = np.log(np.array([[0.5, 0.4, 0.3]], np.float32))
    teacher = np.log(np.array([[0.7, 0.1, 0.3]], np.float32))
    mask = np.array([[1, 1, 0]], np.float32)
    batch = {"loss_mask": mask, "rollout_logprobs": logp, "teacher_logprobs": teacher}
    config = RLConfig(eps_low=0.2, eps_high=0.28, advantage="on_policy_distillation")
    weighted_sum, _, metrics = double_sided_is(jnp.asarray(logp), batch, config)
    advantage = (teacher - logp)[0]
    np.testing.assert_allclose(weighted_sum, -np.sum(advantage * logp[0] * mask[0]), rtol=1e-5)
    grad = jax.grad(lambda lp: double_sided_is(lp, batch, config)[0])(jnp.asarray(logp))
    np.testing.assert_allclose(grad[0], -advantage * mask[0], rtol=1e-5)  # no gradient through the advantage
    np.testing.assert_allclose(metrics["advantage_mean"], advantage[:2].mean(), rtol=1e-5)


def test_metrics_count_nonfinite_and_report_entropy():
    logp = np.array([[-0.5, np.nan, -1.0]], np.float32)
    rollout = np.array([[-0.5, -0.3, np.inf]], np.float32)
    batch = {"loss_mask": np.ones((1, 3), np.float32), "rollout_logprobs": rollout,
             "advantages": np.ones((1, 3), np.float32)}
    entropy = np.array([[1.0, 2.0, 4.0]], np.float32)
    _, _, metrics = double_sided_is(jnp.asarray(logp), batch, RLConfig(eps_low=0.2, eps_high=0.2), entropy)
    assert float(metrics["nonfinite_logp"]) == 1.0
    assert float(metrics["nonfinite_rollout_logprobs"]) == 1.0
    np.testing.assert_allclose(metrics["entropy_mean"], 7 / 3, rtol=1e-6)


def test_losses_are_registered_and_jit():
    assert set(RL_LOSSES) == {"double_sided_is", "icepop_grpo", "tis"}
    logp, batch, _ = _edge_batch()
    for name in RL_LOSSES:
        config = RLConfig(loss=name, eps_low=0.2, eps_high=0.28)
        loss = get_rl_loss(name)
        got = jax.jit(lambda lp, b: loss(lp, b, config)[:2])(logp, batch)
        want = loss(jnp.asarray(logp), batch, config)[:2]
        np.testing.assert_allclose(got, want, rtol=1e-6)


@pytest.mark.parametrize("config, field", [
    (RLConfig(loss="double_sided_is", eps_high=0.2), "RLConfig.eps_low=None"),
    (RLConfig(loss="icepop_grpo", eps_low=0.2), "RLConfig.eps_high=None"),
    (RLConfig(loss="ppo", eps_low=0.2, eps_high=0.2), "RLConfig.loss='ppo'"),
    (RLConfig(eps_low=1.5, eps_high=0.2), "RLConfig.eps_low=1.5"),
    (RLConfig(loss="tis", beta=0.5), "RLConfig.beta=0.5"),
    (RLConfig(loss="tis", advantage="rloo"), "RLConfig.advantage='rloo'"),
    (RLConfig(loss="tis", max_staleness=-1), "RLConfig.max_staleness=-1"),
])
def test_config_errors_name_the_field(config, field):
    with pytest.raises(ConfigError, match=field.replace(".", r"\.").replace("(", r"\(")):
        config.validate()


def test_missing_or_misshapen_batch_fields_are_named():
    logp, batch, config = _edge_batch()
    with pytest.raises(ValueError, match="'advantages'"):
        double_sided_is(jnp.asarray(logp), {k: v for k, v in batch.items() if k != "advantages"}, config)
    with pytest.raises(ValueError, match=r"batch\['loss_mask'\] has shape"):
        double_sided_is(jnp.asarray(logp), dict(batch, loss_mask=np.ones((2, 5))), config)
    with pytest.raises(ValueError, match="'teacher_logprobs'"):
        double_sided_is(jnp.asarray(logp), batch, RLConfig(eps_low=0.2, eps_high=0.2,
                                                           advantage="on_policy_distillation"))
    with pytest.raises(ValueError, match="'grpo' is unknown"):
        get_rl_loss("grpo")
