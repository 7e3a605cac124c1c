"""Rollout records: storage round trip, validation errors, the paper's filters, batch alignment, grain."""

import numpy as np
import pytest

from glm5_jax.data.rollouts import (RolloutError, RolloutRecord, filter_and_pad, make_batch, read_rollouts,
                                    rollout_dataset, validate_record, validate_records, write_rollouts)
from glm5_jax.train.rl import RLConfig


def _record(rollout_id="r0", group_id="g0", reward=1.0, versions=(5,), **changes):
    fields = dict(rollout_id=rollout_id, group_id=group_id, prompt_ids=[3, 4, 5], response_ids=[6, 7, 8, 9],
                  rollout_logprobs=[-0.1, -0.2, 0.0, -0.4], loss_mask=[1, 1, 0, 1], reward=reward,
                  temperature=0.8, weight_versions=versions)
    fields.update(changes)
    return RolloutRecord(**fields)


def _full_record():
    rng = np.random.default_rng(0)
    return _record(teacher_logprobs=[-1.0, -2.0, -3.0, -0.5], old_logprobs=[-0.15, -0.25, -0.1, -0.3],
                   expert_choices=rng.integers(0, 16, size=(2, 6, 3)),
                   indexer_topk=rng.integers(-1, 6, size=(2, 6, 4)), env_failed=True)


def _assert_same(a: RolloutRecord, b: RolloutRecord):
    for name in a.__dataclass_fields__:
        x, y = getattr(a, name), getattr(b, name)
        if isinstance(x, np.ndarray):
            assert x.dtype == y.dtype and x.shape == y.shape, name
            np.testing.assert_array_equal(x, y, err_msg=name)
        else:
            assert x == y, name


@pytest.mark.parametrize("suffix", [".array_record", ".jsonl"])
def test_write_read_round_trip(tmp_path, suffix):
    records = [_full_record(), _record("r1", reward=0.0, versions=(3, 4))]
    path = tmp_path / f"rollouts{suffix}"
    write_rollouts(path, records)
    back = read_rollouts(path)
    assert len(back) == 2 and not (tmp_path / f"rollouts{suffix}.tmp").exists()
    for a, b in zip(records, back):
        _assert_same(a, b)
    assert back[1].teacher_logprobs is None and back[1].weight_versions == (3, 4)


def test_read_missing_file_is_named(tmp_path):
    with pytest.raises(RolloutError, match="does not exist"):
        read_rollouts(tmp_path / "nope.jsonl")


@pytest.mark.parametrize("changes, field", [
    (dict(rollout_logprobs=[-0.1, 0.3, 0.0, -0.4]), "rollout_logprobs"),
    (dict(rollout_logprobs=[-0.1, -0.2, -0.3]), "rollout_logprobs"),
    (dict(rollout_logprobs=[-0.1, np.nan, 0.0, -0.4]), "rollout_logprobs"),
    (dict(loss_mask=[1, 1, 0]), "loss_mask"),
    (dict(loss_mask=[1, 2, 0, 1]), "loss_mask"),
    (dict(teacher_logprobs=[-1.0, np.inf * -1, -1.0, -1.0]), "teacher_logprobs"),
    (dict(temperature=0.0), "temperature"),
    (dict(group_id="stranger"), "group_id"),
    (dict(response_ids=[]), "response_ids"),
    (dict(prompt_ids=[3, -4, 5]), "prompt_ids"),
    (dict(response_ids=[6, 7, 8, 99]), "response_ids"),
    (dict(weight_versions=()), "weight_versions"),
    (dict(expert_choices=np.zeros((2, 7, 3), np.int32)), "expert_choices"),
    (dict(reward=float("nan")), "reward"),
])
def test_validation_errors_name_the_record_and_field(changes, field):
    record = _record("rollout-17", **changes)
    with pytest.raises(RolloutError, match=f"rollout 'rollout-17': field '{field}'"):
        validate_record(record, known_groups={"g0"}, vocab_size=32)


def test_valid_record_passes_and_non_loss_logprobs_are_not_checked():
    # Token 2 is a tool token (mask 0): its positive / NaN logprob is ignored.
    record = _record(rollout_logprobs=[-0.1, -0.2, np.nan, -0.4])
    assert validate_record(record, known_groups={"g0"}, vocab_size=32) is record
    with pytest.raises(RolloutError, match="field 'prompt_ids' has dtype float"):
        _record(prompt_ids=[1.5, 2.0])


def test_duplicate_rollout_ids_are_rejected():
    with pytest.raises(RolloutError, match="rollout 'r0': field 'rollout_id' appears twice"):
        validate_records([_record(), _record()])


def test_filters_count_drops_and_pad_groups():
    current = 10
    records = [
        # Group a (4): one env failure -> 3 of 4 remain (> half) -> padded back to 4.
        _record("a0", "a", versions=(9,)), _record("a1", "a", versions=(8,), env_failed=True),
        _record("a2", "a", versions=(10,)), _record("a3", "a", versions=(8, 10)),
        # Group b (4): two stale (oldest version 6 < 10 - 3) -> 2 of 4 remain (not > half) -> dropped.
        _record("b0", "b", versions=(6, 9)), _record("b1", "b", versions=(6,)),
        _record("b2", "b", versions=(7,)), _record("b3", "b", versions=(10,)),
        # Group c (2): intact.
        _record("c0", "c", versions=(10,)), _record("c1", "c", versions=(7,)),
    ]
    kept, counts = filter_and_pad(records, current_version=current, max_staleness=3)
    assert [r.rollout_id for r in kept] == ["a0", "a2", "a3", "a0#pad0", "c0", "c1"]
    assert counts == {"input": 10, "dropped_env_failed": 1, "dropped_stale": 2, "dropped_groups": 1,
                      "dropped_group_samples": 2, "padded": 1, "output": 6}
    # A declared group size counts samples lost before the file was written: 3 of 5 (> half) are padded by 2.
    kept, counts = filter_and_pad([_record(f"d{i}", "d") for i in range(3)], current_version=5,
                                  max_staleness=None, group_size=5)
    assert [r.rollout_id for r in kept] == ["d0", "d1", "d2", "d0#pad0", "d1#pad1"]
    assert counts["padded"] == 2 and counts["dropped_groups"] == 0


def test_make_batch_alignment_by_hand():
    config = RLConfig(advantage="group_mean")
    first = _record("x", "g", reward=1.0, old_logprobs=[-0.11, -0.21, -0.31, -0.41],
                    expert_choices=np.arange(2 * 6 * 3).reshape(2, 6, 3))
    second = _record("y", "g", reward=0.0, prompt_ids=[1, 2], response_ids=[7], rollout_logprobs=[-0.5],
                     loss_mask=[1], old_logprobs=[-0.6], expert_choices=np.full((2, 2, 3), 9))
    batch = make_batch([first, second], seq_len=9, config=config, batch_size=3)
    # Sample x: prompt 3,4,5 then response 6,7,8,9 (8 is a tool token). Advantages: 1 - 0.5, 0 - 0.5.
    np.testing.assert_array_equal(batch["tokens"][0], [3, 4, 5, 6, 7, 8, 9, 0, 0])
    np.testing.assert_array_equal(batch["targets"][0], [4, 5, 6, 7, 8, 9, 0, 0, 0])
    np.testing.assert_array_equal(batch["positions"][0], [0, 1, 2, 3, 4, 5, 6, 0, 0])
    np.testing.assert_array_equal(batch["segment_ids"][0], [1, 1, 1, 1, 1, 1, 1, 0, 0])
    np.testing.assert_array_equal(batch["loss_mask"][0], [0, 0, 1, 1, 0, 1, 0, 0, 0])
    np.testing.assert_allclose(batch["rollout_logprobs"][0], [0, 0, -0.1, -0.2, 0, -0.4, 0, 0, 0])
    np.testing.assert_allclose(batch["old_logprobs"][0], [0, 0, -0.11, -0.21, 0, -0.41, 0, 0, 0])
    np.testing.assert_allclose(batch["advantages"][0], [0, 0, 0.5, 0.5, 0, 0.5, 0, 0, 0])
    np.testing.assert_array_equal(batch["tokens"][1], [1, 2, 7, 0, 0, 0, 0, 0, 0])
    np.testing.assert_array_equal(batch["loss_mask"][1], [0, 1, 0, 0, 0, 0, 0, 0, 0])
    np.testing.assert_allclose(batch["advantages"][1], [0, -0.5, 0, 0, 0, 0, 0, 0, 0])
    np.testing.assert_allclose(batch["temperature"], [0.8, 0.8, 1.0])
    np.testing.assert_allclose(batch["rewards"], [1.0, 0.0, 0.0])
    assert batch["expert_choices"].shape == (3, 2, 9, 3)
    np.testing.assert_array_equal(batch["expert_choices"][0, :, :6], first.expert_choices)
    np.testing.assert_array_equal(batch["expert_choices"][0, :, 6:], 0)
    np.testing.assert_array_equal(batch["expert_choices"][1, :, :2], 9)
    assert not batch["loss_mask"][2].any() and "teacher_logprobs" not in batch


def test_make_batch_errors_name_the_record():
    config = RLConfig()
    with pytest.raises(RolloutError, match="rollout 'r0': field 'response_ids' makes 7 tokens"):
        make_batch([_record()], seq_len=6, config=config)
    with pytest.raises(RolloutError, match="rollout 'r1': field 'old_logprobs' is missing"):
        make_batch([_record(old_logprobs=[-1.0] * 4), _record("r1")], seq_len=8, config=config)


def test_grain_dataset_batches_with_global_group_advantages():
    records = [_record(f"r{i}", f"g{i // 3}", reward=float(i % 3)) for i in range(6)]
    dataset = rollout_dataset(records, batch_size=4, seq_len=8, config=RLConfig(advantage="group_mean"))
    batches = list(dataset)
    assert len(batches) == 2
    assert batches[0]["tokens"].shape == (4, 8) and batches[1]["tokens"].shape == (4, 8)
    # Rewards 0, 1, 2 in each group: advantages -1, 0, 1 even though group g1 is split across batches.
    np.testing.assert_allclose(batches[0]["advantages"][:, 2], [-1, 0, 1, -1])
    np.testing.assert_allclose(batches[1]["advantages"][:2, 2], [0, 1])
    assert not batches[1]["loss_mask"][2:].any()
