"""Resume rules: the saved experiment config must match outside the allow-list; metrics after the restored step
are dropped."""

import json

import pytest

from glm5_jax.config import ConfigError
from glm5_jax.config.rl import rl_step_config_as_dict, rl_step_config_from_dict
from glm5_jax.train.resume import (check_resume_config, config_changes, default_experiment_dict,
                                  drop_metrics_after)

SAVED = {"model": {"hidden_size": 32}, "train": {"steps": 10, "batch_size": 2, "log_every": 5},
         "checkpoint": {"every": 2}, "optim": {"lr": 1e-3}}


def _with(**changes):
    data = json.loads(json.dumps(SAVED))
    for key, value in changes.items():
        section, field = key.split("__")
        data[section][field] = value
    return data


def test_steps_logging_and_cadence_may_change():
    current = _with(train__steps=20, train__log_every=1, checkpoint__every=5)
    assert check_resume_config(SAVED, current, step=4, allow_change=False) == []


def test_other_changes_are_refused_naming_every_field():
    current = _with(train__batch_size=4, model__hidden_size=64, train__steps=20)
    with pytest.raises(ConfigError) as err:
        check_resume_config(SAVED, current, step=4, allow_change=False)
    message = str(err.value)
    assert "refusing to resume from step 4" in message and "2 field(s)" in message
    assert "model.hidden_size: 32 -> 64" in message and "train.batch_size: 2 -> 4" in message
    assert "train.steps" not in message and "--allow-config-change" in message
    assert check_resume_config(SAVED, current, step=4, allow_change=True) == [
        "model.hidden_size: 32 -> 64", "train.batch_size: 2 -> 4"]


def test_a_field_newer_than_the_checkpoint_counts_only_when_not_default():
    current = _with()
    current["train"]["non_finite_new"] = "stop"
    assert config_changes(SAVED, current, {"train": {"non_finite_new": "stop"}}) == []
    current["train"]["non_finite_new"] = "skip"
    assert config_changes(SAVED, current, {"train": {"non_finite_new": "stop"}}) == [
        ("train.non_finite_new", "<absent>", "skip")]


def test_metrics_after_the_restored_step_are_dropped(tmp_path):
    path = tmp_path / "metrics.jsonl"
    path.write_text("".join(json.dumps({"step": s, "loss": s}) + "\n" for s in (1, 2, 3, 3, 4)) + '{"step": 5, "lo')
    assert drop_metrics_after(path, 3) == 2
    assert [json.loads(line)["step"] for line in path.read_text().splitlines()] == [1, 2, 3, 3]
    assert drop_metrics_after(path, 3) == 0
    assert drop_metrics_after(tmp_path / "none.jsonl", 0) == 0


def test_an_rl_section_saved_as_the_file_gave_it_resumes_with_the_parsed_section():
    """Checkpoints written before the rl: section was parsed on load hold only the fields the file gave."""
    given = {"loss": "double_sided_is", "eps_low": 0.2, "eps_high": 0.28, "max_staleness": 4}
    saved = {**SAVED, "rl": given}
    current = {**SAVED, "rl": rl_step_config_as_dict(rl_step_config_from_dict(given))}
    assert check_resume_config(saved, current, step=4, allow_change=False, defaults=default_experiment_dict()) == []
    changed = {**SAVED, "rl": rl_step_config_as_dict(rl_step_config_from_dict({**given, "eps_high": 0.3}))}
    with pytest.raises(ConfigError, match=r"rl.eps_high: 0.28 -> 0.3"):
        check_resume_config(saved, changed, step=4, allow_change=False, defaults=default_experiment_dict())
