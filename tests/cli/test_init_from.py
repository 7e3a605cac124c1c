"""`train.init_from=RUN` supplies the model: a config without a model section takes the run's, one whose model
section disagrees is refused naming each field; execution choices (backends, dtypes of compute) may differ."""

import shutil

import pytest
import yaml
from xla_env import REPO

from glm5_jax.config import ConfigError, load_model_config
from glm5_jax.config.experiment import experiment_from_dict, load_experiment

CONFIGS = REPO / "configs"


@pytest.fixture
def imported_run(tmp_path):
    """A run directory as `glm5 import-hf` leaves it (model.yaml + checkpoints/), holding the README model."""
    run = tmp_path / "imported"
    (run / "checkpoints").mkdir(parents=True)
    model = yaml.safe_load((CONFIGS / "train_tiny_stdlib.yaml").read_text())["model"]
    (run / "model.yaml").write_text(yaml.safe_dump({"model": model}))
    return run


def test_a_config_without_a_model_section_takes_the_runs_model(imported_run):
    cfg = load_experiment(CONFIGS / "rl_grpo_icepop.yaml", [f"train.init_from={imported_run}"])
    assert cfg.model == load_model_config(CONFIGS / "train_tiny_stdlib.yaml")


def test_a_training_runs_config_yaml_supplies_the_model_too(imported_run, tmp_path):
    run = tmp_path / "trained"
    shutil.copytree(imported_run / "checkpoints", run / "checkpoints")
    (run / "config.yaml").write_text((CONFIGS / "train_tiny_stdlib.yaml").read_text())
    cfg = experiment_from_dict({"train": {"init_from": str(run)}, "model": {"attention_backend": "dense",
                                                                           "compute_dtype": "bfloat16"}})
    assert cfg.model.hidden_size == 128 and cfg.model.attention_backend == "dense"
    assert cfg.model.compute_dtype == "bfloat16"


def test_a_disagreeing_model_section_is_refused_by_field(imported_run):
    with pytest.raises(ConfigError) as err:
        load_experiment(CONFIGS / "tiny.yaml", [f"train.init_from={imported_run}"])
    message = str(err.value)
    assert f"disagrees with train.init_from='{imported_run}' ({imported_run / 'model.yaml'})" in message
    assert "model.vocab_size=512 but 288 there" in message and "model.hidden_size=64 but 128 there" in message
    assert "model.compute_dtype" not in message  # an execution choice, equal anyway


def test_no_model_section_and_no_init_from_is_refused():
    with pytest.raises(ConfigError, match="the config has no model: section; give one, or set train.init_from"):
        load_experiment(CONFIGS / "rl_grpo_icepop.yaml")


def test_init_from_without_a_model_file_is_refused(tmp_path):
    (tmp_path / "run" / "checkpoints").mkdir(parents=True)
    with pytest.raises(ConfigError, match="has neither model.yaml .* nor config.yaml"):
        experiment_from_dict({"train": {"init_from": str(tmp_path / "run")}})
