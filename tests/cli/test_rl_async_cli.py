"""`glm5 rl-async CONFIG`: a tiny config runs a few trainer steps through the command line and writes its
per-step JSONL, summary and final checkpoint; a bad task path or field is refused by name before anything
compiles; the starting weights come from train.init_from when it is given."""

import json

import jax
import numpy as np
import pytest
import yaml

from glm5_jax.cli import main
from glm5_jax.commands.rl_async import load_rl_async, starting_params
from glm5_jax.config.mesh import MeshConfig
from glm5_jax.convert.run_dir import restore_run_params
from glm5_jax.distributed.mesh import make_mesh
from glm5_jax.model.transformer import init

TASK = "glm5_jax.examples.sort_task:SortTask"
# One dense layer keeps the compile short; sort 3 digits: prompt 5 tokens, answer 4, sequence 9.
CONFIG = {
    "model": {"vocab_size": 16, "hidden_size": 16, "intermediate_size": 32, "moe_intermediate_size": 8,
              "num_hidden_layers": 1, "first_k_dense_replace": 1, "num_attention_heads": 2, "q_lora_rank": 8,
              "kv_lora_rank": 8, "qk_nope_head_dim": 4, "qk_rope_head_dim": 4, "v_head_dim": 4,
              "n_routed_experts": 4, "num_experts_per_tok": 2, "n_group": 1, "topk_group": 1, "index_n_heads": 2,
              "index_head_dim": 4, "index_topk": 8, "num_nextn_predict_layers": 0, "mtp_num_steps": 0,
              "compute_dtype": "float32"},
    "optim": {"name": "adamw", "lr": 1e-3, "warmup_steps": 0, "total_steps": 10, "schedule": "constant"},
    "train": {"mode": "rl", "batch_size": 4, "seq_len": 9, "bias_update_rate": 0.0},
    "rl": {"loss": "double_sided_is", "eps_low": 0.2, "eps_high": 0.2, "max_staleness": 1},
    "async": {"steps": 3, "prompts_per_step": 2, "group_size": 2, "push_every": 2, "queue_depth": 1,
              "eval_every": 100, "eval_prompts": 4, "sft_steps": 0},
    "task": {"factory": TASK, "num_digits": 3},
}


@pytest.fixture
def config_file(tmp_path):
    path = tmp_path / "rl_async.yaml"
    path.write_text(yaml.safe_dump(CONFIG))
    return path


@pytest.mark.slow
def test_a_tiny_config_runs_three_steps_and_writes_its_steps_and_summary(config_file, tmp_path, capsys):
    run_dir = tmp_path / "run"
    assert main(["rl-async", str(config_file), f"train.run_dir={run_dir}"]) == 0
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [row["step"] for row in rows] == [1, 2, 3]
    # The first batch is sampled by the starting weights themselves: on-policy, ratio 1.
    assert rows[0]["staleness"] == 0
    np.testing.assert_allclose([rows[0]["offpolicy_ratio_min"], rows[0]["offpolicy_ratio_max"]], 1.0, atol=1e-4)
    assert all(0.0 <= row["reward_mean"] <= 1.0 and np.isfinite(row["loss"]) for row in rows)
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["steps"] == 3 and summary["run_dir"] == str(run_dir)
    assert summary["greedy_accuracy"][0][0] == 1  # evaluated at step 1 (eval_every is beyond the run)
    out = capsys.readouterr().out
    assert json.loads(out.split("summary: ", 1)[1]) == summary
    # The run directory holds the trained weights, as a SOURCE / train.init_from of later commands.
    trained, model = restore_run_params(run_dir.absolute(), make_mesh(MeshConfig().resolve(1)))
    fresh = init(load_rl_async(config_file).experiment.model, jax.random.key(0))  # async.seed 0
    assert model == load_rl_async(config_file).experiment.model
    assert jax.tree.structure(trained) == jax.tree.structure(fresh)
    assert any(not np.array_equal(a, b) for a, b in zip(jax.tree.leaves(trained), jax.tree.leaves(fresh)))
    # An earlier run's results are never overwritten.
    assert main(["rl-async", str(config_file), f"train.run_dir={run_dir}"]) == 2
    assert f"train.run_dir='{run_dir}' is invalid: it already holds metrics.jsonl" in capsys.readouterr().err


@pytest.mark.parametrize("overrides, message", [
    (["task.factory=glm5_jax.examples.sort_task:NoSuchTask"],
     "task.factory='glm5_jax.examples.sort_task:NoSuchTask': module 'glm5_jax.examples.sort_task' has no "
     "function 'NoSuchTask'"),
    (["task.factory=no_such_module:Task"], "task.factory='no_such_module:Task': cannot import module "
                                            "'no_such_module'"),
    (["task.factory=SortTask"], "task.factory='SortTask' is invalid: expected module:function"),
    (["task.factory=builtins:dict"], "task.factory='builtins:dict' is invalid: it returned a dict without "
                                     "['prompts', 'reward', 'validate', 'seq_len', 'answer_len', 'eos']"),
    (["task.factory=glm5_jax.examples.rewards:python_line"],
     "task.num_digits=3 is invalid: glm5_jax.examples.rewards:python_line takes no such argument"),
    (["task.num_digitz=4"], "task.num_digitz=4 is invalid: unknown key"),
    (["task.eos=5"], "task.eos=5 is invalid: must be a non-digit id in [10, 16)"),
    (["async.push_evry=2"], "async.push_evry=2 is invalid: unknown key"),
    (["async.group_size=0"], "async.group_size=0 is invalid: must be a positive integer"),
    (["train.batch_size=8"], "train.batch_size=8 is invalid here: the asynchronous RL driver needs train.mode "
                             "'rl', train.batch_size = prompts_per_step * group_size = 4"),
    (["train.seq_len=12"], "train.seq_len=12 is invalid here"),
    (["train.mode=sft"], "train.mode='sft' is invalid here"),
    (["train.steps=50"], "train.steps=50 is invalid: glm5 rl-async takes async.steps instead"),
    (["rl.loss=ppo"], "loss='ppo' is invalid: must be one of ['double_sided_is', 'icepop_grpo', 'tis']"),
    (["data.source=stdlib"], "data={'source': 'stdlib'} is invalid: unknown section of glm5 rl-async; known "
                             "sections are ['model', 'optim', 'train', 'rl', 'mesh', 'async', 'task']"),
])
def test_a_bad_task_or_field_is_refused_by_name_before_anything_compiles(overrides, message, config_file,
                                                                         tmp_path, capsys):
    run_dir = tmp_path / "run"
    assert main(["rl-async", str(config_file), f"train.run_dir={run_dir}", *overrides]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"glm5 rl-async: {config_file}: ") and message in err, err
    assert not run_dir.exists()


def test_a_task_section_without_factory_is_refused(tmp_path, capsys):
    path = tmp_path / "no_factory.yaml"
    path.write_text(yaml.safe_dump({**CONFIG, "task": {"num_digits": 3}}))
    assert main(["rl-async", str(path)]) == 2
    assert "task.factory=None is invalid: name the task as module:function, e.g. task.factory=" + TASK \
        in capsys.readouterr().err


@pytest.mark.slow
def test_the_starting_weights_are_those_of_train_init_from(trained_run):
    """From the README model's run (byte vocabulary: the sort task's ids fit), the model and the weights are
    the run's; without init_from they are fresh from async.seed."""
    run_dir, _ = trained_run
    overrides = [f"train.init_from={run_dir}", "train.seq_len=13", "task.num_digits=5"]
    data = {name: section for name, section in CONFIG.items() if name != "model"}
    path = run_dir.parent / "rl_async_from_run.yaml"
    path.write_text(yaml.safe_dump(data))
    config = load_rl_async(path, overrides)
    want, model = restore_run_params(run_dir.absolute(), make_mesh(MeshConfig().resolve(1)))
    assert config.experiment.model.hidden_size == model.hidden_size
    got = starting_params(config)
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b, dtype=np.asarray(a).dtype))


def test_the_shipped_example_config_names_the_example_task():
    config = load_rl_async("glm5_jax/examples/rl_async_sort.yaml", ["async.steps=5"])
    assert type(config.task).__name__ == "SortTask" and config.task.seq_len == config.experiment.train.seq_len
    assert config.async_config.steps == 5
    assert config.experiment.train.batch_size == config.async_config.batch_size
