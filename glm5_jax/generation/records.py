"""Token-in-token-out: generation outputs become `RolloutRecord`s directly from token ids.

Nothing is detokenised or retokenised: the record's prompt_ids / response_ids are the exact ids the model
saw and produced, rollout_logprobs are the recorded logprobs, and the routing (when collected) is sliced
by absolute position to the record's layout ([layers, P + R - 1, k]: every position whose output is used).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from glm5_jax.data.rollouts import RolloutRecord
from glm5_jax.generation.decode import GenerationOutput
from glm5_jax.generation.sampling import GenerationError


def _per_row(name: str, value, batch: int) -> list:
    if isinstance(value, np.ndarray) and value.ndim:
        value = value.tolist()
    if isinstance(value, (str, bytes)) or not isinstance(value, Sequence):
        return [value] * batch
    if len(value) != batch:
        raise GenerationError(f"{name} has {len(value)} entries; expected one per generated row ({batch})")
    return list(value)


def to_rollout_records(output: GenerationOutput, *, rollout_ids: Sequence[str], group_ids: Sequence[str] | str,
                       rewards: Sequence[float], weight_versions: int | Sequence[int | Sequence[int]],
                       env_failed: bool | Sequence[bool] = False) -> list[RolloutRecord]:
    """One record per generated row. Every generated token is a model token (loss_mask 1).

    `weight_versions` is one version for all rows, or per row a version or a tuple of versions (weights
    swapped mid-rollout); `group_ids` and `env_failed` are one value for all rows or one per row. The
    temperature recorded is the one the logprobs are at (`output.temperature`)."""
    batch = output.tokens.shape[0]
    rollout_ids = _per_row("rollout_ids", rollout_ids, batch)
    if len({str(i) for i in rollout_ids}) != batch:
        raise GenerationError(f"rollout_ids={rollout_ids!r} must be {batch} distinct ids, one per row")
    group_ids = _per_row("group_ids", group_ids, batch)
    rewards = _per_row("rewards", rewards, batch)
    env_failed = _per_row("env_failed", env_failed, batch)
    if isinstance(weight_versions, (int, np.integer)):
        weight_versions = [weight_versions] * batch
    versions = _per_row("weight_versions", weight_versions, batch)
    records = []
    for row in range(batch):
        prompt_len, response_len = int(output.prompt_lengths[row]), int(output.lengths[row])
        fed = prompt_len + response_len - 1  # positions whose output is used
        records.append(RolloutRecord(
            rollout_id=rollout_ids[row],
            group_id=group_ids[row],
            prompt_ids=output.prompt_ids[row, :prompt_len],
            response_ids=output.tokens[row, :response_len],
            rollout_logprobs=output.logprobs[row, :response_len],
            loss_mask=np.ones(response_len, np.int32),
            reward=rewards[row],
            temperature=output.temperature,
            weight_versions=versions[row],
            env_failed=env_failed[row],
            expert_choices=None if output.expert_choices is None else output.expert_choices[row, :, :fed],
            indexer_topk=None if output.indexer_topk is None else output.indexer_topk[row, :, :fed],
        ))
    return records
