"""Configuration loading, overrides and validation errors that name field, value and the valid range."""

import dataclasses
from pathlib import Path

import pytest

from glm5_jax.config import ConfigError, ModelConfig, apply_overrides, load_model_config, parse_overrides
from glm5_jax.config.experiment import experiment_from_dict, experiment_to_dict, load_experiment
from glm5_jax.config.mesh import mesh_values
from glm5_jax.config.rl import RLStepConfig
from glm5_jax.model.param_count import count_params


def test_released_config_parameter_counts():
    counts = count_params(load_model_config("configs/glm5_744b.yaml"))
    assert counts["total"] == 753_864_139_008
    assert counts["total"] - counts["mtp"] - 75 * 256 == 743_911_199_232  # HF's count: no MTP, no biases
    assert round(counts["without_mtp"] / 1e9, 1) == 743.9
    assert 38e9 < counts["active_per_token"] < 43e9  # "about 40B active"


def test_yaml_overrides_are_typed():
    config = load_model_config("configs/tiny.yaml", ["model.index_topk=16", "attention_backend=dense",
                                                     "indexer_types=[full, shared, full]"])
    assert config.index_topk == 16 and config.attention_backend == "dense"
    assert config.indexer_types == ("full", "shared", "full")


@pytest.mark.parametrize("change, field, hint", [
    (dict(num_attention_heads=0), "num_attention_heads", "positive"),
    (dict(topk_group=8, n_group=4), "topk_group", "<= n_group"),
    (dict(n_routed_experts=10, n_group=4, topk_group=1), "n_group", "divide"),
    (dict(qk_rope_head_dim=32, index_head_dim=16), "qk_rope_head_dim", "index_head_dim"),
    (dict(num_experts_per_tok=9), "num_experts_per_tok", "n_routed_experts"),
    (dict(attention_backend="flash"), "attention_backend", "dense"),
    (dict(indexer_types=("shared", "full", "full")), "indexer_types", "first layer"),
    (dict(indexer_types=("full",)), "indexer_types", "one entry per layer"),
    (dict(qk_rope_head_dim=7), "qk_rope_head_dim", "even"),
    (dict(moe_kernel_vmem_mib=8), "moe_kernel_vmem_mib", "from 16 to 128"),
    (dict(moe_kernel_vmem_mib=True), "moe_kernel_vmem_mib", "0 (the chip's default)"),
])
def test_invalid_configs_name_field_value_and_range(change, field, hint):
    base = load_model_config("configs/tiny.yaml")
    with pytest.raises(ConfigError, match=field) as err:
        dataclasses.replace(base, **change).validate()
    assert hint in str(err.value)


def test_unknown_and_malformed_keys():
    with pytest.raises(ConfigError, match="model.num_heads.*unknown key"):
        load_model_config("configs/tiny.yaml", ["num_heads=4"])
    with pytest.raises(ConfigError, match="hidden_size.*integer"):
        load_model_config("configs/tiny.yaml", ["hidden_size=big"])
    with pytest.raises(ConfigError, match="key=value"):
        apply_overrides({}, ["index_topk"])
    with pytest.raises(ConfigError, match="file not found"):
        load_model_config("configs/missing.yaml")


def test_defaults_are_glm5():
    config = ModelConfig().validate()
    assert (config.hidden_size, config.num_hidden_layers, config.index_topk) == (6144, 78, 2048)
    assert config.qk_head_dim == 256 and config.latent_dim == 576


def test_yaml_syntax_errors_name_file_line_and_column(tmp_path):
    path = tmp_path / "broken.yaml"
    path.write_text("model:\n  hidden_size: [32\n")
    with pytest.raises(ConfigError, match=r"broken.yaml:3:1: YAML syntax error.*opened at line 2, column 16"):
        load_model_config(path)


def test_empty_and_non_mapping_files_are_refused(tmp_path):
    empty = tmp_path / "empty.yaml"
    empty.write_text("# nothing but a comment\n")
    with pytest.raises(ConfigError, match="empty.yaml: the config file is empty"):
        load_model_config(empty)
    listed = tmp_path / "list.yaml"
    listed.write_text("- 1\n- 2\n")
    with pytest.raises(ConfigError, match="list.yaml: the top level must be a mapping"):
        load_model_config(listed)


@pytest.mark.parametrize("override, field", [
    ("rope_theta=nan", "rope_theta"), ("rope_theta=.inf", "rope_theta"), ("rms_norm_eps=nan", "rms_norm_eps"),
    ("initializer_range=-1", "initializer_range"), ("initializer_range=0", "initializer_range"),
    ("routed_scaling_factor=-inf", "routed_scaling_factor"), ("moe_capacity_factor=nan", "moe_capacity_factor"),
])
def test_non_finite_and_out_of_range_floats_are_refused(override, field):
    with pytest.raises(ConfigError, match=f"{field}=.* is invalid: must be"):
        load_model_config("configs/tiny.yaml", [override])


def test_directly_built_configs_refuse_nan_too():
    from glm5_jax.config import TrainConfig

    with pytest.raises(ConfigError, match="rms_norm_eps=nan"):
        dataclasses.replace(load_model_config("configs/tiny.yaml"), rms_norm_eps=float("nan")).validate()
    with pytest.raises(ConfigError, match="train.mtp_loss_weight=nan"):
        TrainConfig(mtp_loss_weight=float("nan")).validate()
    with pytest.raises(ConfigError, match="train.non_finite='ignore'"):
        TrainConfig(non_finite="ignore").validate()


def test_a_query_chunk_that_does_not_divide_the_sequence_is_refused():
    from glm5_jax.config.experiment import load_experiment

    base = ["train.seq_len=128"]
    for ok in ("0", "32", "128", "256"):  # off, dividing, or one block of every query
        assert load_experiment("configs/tiny.yaml", base + [f"model.index_query_chunk={ok}"])
    with pytest.raises(ConfigError, match=r"model.index_query_chunk=48 is invalid: must divide train.seq_len=128"):
        load_experiment("configs/tiny.yaml", base + ["model.index_query_chunk=48"])


def test_every_subcommand_parses_overrides_with_one_parser():
    assert parse_overrides(["train.steps=5", "model.indexer_types=[full, shared]", "mesh.fsdp=-1"]) == {
        "train": {"steps": 5}, "model": {"indexer_types": ["full", "shared"]}, "mesh": {"fsdp": -1}}
    assert mesh_values(["mesh.fsdp=8", "mesh.expert=2"]) == {"fsdp": 8, "expert": 2}
    for item in ("fsdp=2", "mesh=2", "mesh.fsdp"):  # outside the mesh section, or no value
        with pytest.raises(ConfigError, match=rf"argument '{item}' is invalid: expected mesh.<axis>=<size>"):
            mesh_values([item])
    with pytest.raises(ConfigError, match="'steps' is not a section"):
        parse_overrides(["train.steps=5", "train.steps.x=1"])


def test_the_rl_section_is_parsed_when_the_file_is_loaded(tmp_path):
    path = tmp_path / "rl.yaml"
    path.write_text("base: " + str(Path("configs/tiny.yaml").resolve()) + "\ntrain: {mode: rl}\n"
                    "rl: {loss: icepop_grpo, eps_low: 0.2, eps_high: 0.28, replay_routing: false}\n")
    experiment = load_experiment(path)
    assert isinstance(experiment.rl, RLStepConfig) and experiment.rl.objective.loss == "icepop_grpo"
    assert not experiment.rl.replay_routing
    # Written back in the file's flat layout, and read back to the same config.
    saved = experiment_to_dict(experiment)
    assert saved["rl"]["loss"] == "icepop_grpo" and saved["rl"]["replay_routing"] is False
    assert experiment_from_dict(saved) == experiment
    with pytest.raises(ConfigError, match=r"rl.yaml: rl.clip=0.2 is invalid: unknown key"):
        load_experiment(path, ["rl.clip=0.2"])
    with pytest.raises(ConfigError, match=r"eps_high=None is invalid: loss 'icepop_grpo' needs it"):
        load_experiment(path, ["rl.eps_high=null"])
    with pytest.raises(ConfigError, match=r"rl=None is invalid: train.mode=rl needs an rl: section"):
        load_experiment(path, ["rl={}"])


def test_every_glm5_pod_recipe_loads_and_its_mesh_fills_its_pod():
    """configs/glm5_744b_<pod>[_<length>].yaml: valid, the mesh uses exactly the pod's chips, and Pallas kernels
    are built for the pod's kind of chip (a GPU recipe based on a TPU one must not inherit the Mosaic kernels)."""
    from glm5_jax.config.experiment import load_experiment
    from glm5_jax.parallel.topology import CHIPS, get_topology

    recipes = sorted(Path("configs").glob("glm5_744b_*.yaml"))
    assert {"glm5_744b_v5p-512_128k.yaml", "glm5_744b_v5p-512_200k.yaml", "glm5_744b_v6e-256.yaml"} <= {
        path.name for path in recipes}
    for path in recipes:
        cfg = load_experiment(path)
        pod = path.stem.split("_")[2]
        mesh = cfg.mesh.resolve(get_topology(pod).num_chips)
        assert mesh.num_devices == get_topology(pod).num_chips, (path.name, mesh)
        chip_platform = {"tpu": "tpu", "cuda": "gpu"}[CHIPS[pod.split("-")[0]].platform]
        if cfg.model.attention_backend == "pallas":
            assert cfg.model.pallas_platform in ("auto", chip_platform), (path.name, cfg.model.pallas_platform)
        if path.stem.endswith(("_128k", "_200k")):
            assert mesh.context > 1 and cfg.train.seq_len >= 131072 and cfg.train.mode == "sft", path.name
