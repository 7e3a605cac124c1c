"""Sample advantage estimators of off-policy RL: one advantage per rollout from the rewards of its group.

They run on the host when a batch is built (a group must be seen whole, and a micro-batch may hold only part
of it); the token-level estimators need the current policy and live with the losses (`glm5_jax.train.rl`).
"""

from __future__ import annotations

import numpy as np

from glm5_jax.config.rl import SAMPLE_ADVANTAGE_NAMES, RLConfig


def _group_stats(rewards, group_ids):
    rewards = np.asarray(rewards, np.float64)
    _, group_index = np.unique(np.asarray(group_ids), return_inverse=True)
    counts = np.bincount(group_index)
    means = np.bincount(group_index, weights=rewards) / counts
    centred = rewards - means[group_index]
    stds = np.sqrt(np.bincount(group_index, weights=centred**2) / counts)
    return centred, stds[group_index]


def group_mean_advantages(rewards, group_ids, config: RLConfig) -> np.ndarray:
    """reward - mean of its group's rewards (GLM-5 agentic RL)."""
    centred, _ = _group_stats(rewards, group_ids)
    return centred.astype(np.float32)


def group_mean_std_advantages(rewards, group_ids, config: RLConfig) -> np.ndarray:
    """(reward - group mean) / (group std + advantage_eps) (GRPO); population std, so a group of one gives 0."""
    centred, stds = _group_stats(rewards, group_ids)
    return (centred / (stds + config.advantage_eps)).astype(np.float32)


SAMPLE_ADVANTAGE_ESTIMATORS = {
    "group_mean": group_mean_advantages,
    "group_mean_std": group_mean_std_advantages,
}


def sample_advantages(rewards, group_ids, config: RLConfig) -> np.ndarray:
    """One advantage per sample for the configured estimator; zeros for a token-level estimator."""
    estimator = SAMPLE_ADVANTAGE_ESTIMATORS.get(config.advantage)
    if estimator is None:
        return np.zeros(len(rewards), np.float32)
    return estimator(rewards, group_ids, config)


if tuple(SAMPLE_ADVANTAGE_ESTIMATORS) != SAMPLE_ADVANTAGE_NAMES:
    raise ImportError(f"glm5_jax.config.rl lists sample advantage estimators {SAMPLE_ADVANTAGE_NAMES}, the registry "
                      f"holds {list(SAMPLE_ADVANTAGE_ESTIMATORS)}")
