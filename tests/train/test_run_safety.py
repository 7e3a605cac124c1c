"""`glm5 train` as a user meets it: bad configs and data refused by name (exit 2, no traceback), resumes that
must match the run they continue, non-finite steps never applied nor saved, one live run per run directory.

Everything goes through the CLI entry `glm5_jax.cli.main` (in-process, so the compiled step is shared through
the session's compilation cache) except the lock tests, which need a second process. One trained run
(2 steps) is shared by the resume tests, each working on its own copy.
"""

import json
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import jax
import numpy as np
import pytest
import yaml
from xla_env import subprocess_env

from glm5_jax.checkpoint import Checkpointer
from glm5_jax.cli import main

ROOT = Path(__file__).resolve().parents[2]
MODEL = dict(vocab_size=288, hidden_size=32, intermediate_size=48, moe_intermediate_size=16, num_hidden_layers=2,
             num_attention_heads=2, q_lora_rank=16, kv_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=4,
             v_head_dim=8, n_routed_experts=4, num_experts_per_tok=2, first_k_dense_replace=1, index_n_heads=2,
             index_head_dim=8, index_topk=8, mtp_num_steps=1, compute_dtype="float32")


def _experiment(run_dir, steps=2):
    return {"model": MODEL,
            "optim": {"name": "adamw", "lr": 1e-3, "min_lr": 1e-4, "warmup_steps": 1, "total_steps": 8,
                      "grad_clip_norm": 0.0},
            "train": {"steps": steps, "batch_size": 2, "seq_len": 32, "log_every": 1, "vocab_chunk": 128,
                      "run_dir": str(run_dir)},
            "data": {"source": "stdlib", "max_files": 4, "validation_fraction": 0.0},
            "checkpoint": {"every": 1, "keep": 10}}


def _write(path: Path, data) -> Path:
    path.write_text(data if isinstance(data, str) else yaml.safe_dump(data))
    return path


def _train(capsys, *argv) -> tuple[int, str, str]:
    code = main(["train", *map(str, argv)])
    out, err = capsys.readouterr()
    assert "Traceback" not in err
    return code, out, err


def _metric_steps(run_dir: Path) -> list[int]:
    return [json.loads(line)["step"] for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """A finished 2-step run (checkpoints at steps 1 and 2) and its config file."""
    root = tmp_path_factory.mktemp("trained")
    config = _write(root / "exp.yaml", _experiment(root / "run"))
    assert main(["train", str(config)]) == 0
    return root / "run", config


def _copy(trained, tmp_path) -> tuple[Path, Path]:
    run_dir, _ = trained
    copy = tmp_path / "run"
    shutil.copytree(run_dir, copy)
    return copy, _write(tmp_path / "exp.yaml", _experiment(copy))


# ---- configuration ----------------------------------------------------------------------------

@pytest.mark.parametrize("text, expected", [
    ("model:\n  hidden_size: [32\n", r"exp.yaml:3:1: YAML syntax error.*opened at line 2, column 16"),
    ("model: 5\n", r"exp.yaml: model=5 is invalid: the model: section must be a mapping"),
    ("", r"exp.yaml: the config file is empty"),
    ("- model\n", r"exp.yaml: the top level must be a mapping"),
])
def test_config_file_errors_name_the_file(tmp_path, capsys, text, expected):

    code, _, err = _train(capsys, _write(tmp_path / "exp.yaml", text))
    assert code == 2 and re.search(expected, err), err
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize("override, field", [
    ("model.rope_theta=nan", "model.rope_theta=nan"),
    ("optim.lr=inf", "optim.lr=inf"),
    ("model.rms_norm_eps=nan", "model.rms_norm_eps=nan"),
    ("train.mtp_loss_weight=nan", "train.mtp_loss_weight=nan"),
    ("train.balance_loss_weight=-inf", "train.balance_loss_weight=-inf"),
    ("model.initializer_range=-1", "model.initializer_range=-1.0"),
    ("model.rms_norm_eps=2", "model.rms_norm_eps=2.0"),
    ("train.non_finite=ignore", "train.non_finite='ignore'"),
])
def test_bad_float_settings_are_refused_before_any_work(tmp_path, capsys, override, field):
    config = _write(tmp_path / "exp.yaml", _experiment(tmp_path / "run"))
    code, out, err = _train(capsys, config, override)
    assert code == 2 and f"{field} is invalid" in err, err
    assert "must be" in err and out == ""  # nothing tokenized, nothing allocated
    assert not (tmp_path / "run").exists()


# ---- data -----------------------------------------------------------------------------------

def _data_config(tmp_path, source, path, **train):
    data = _experiment(tmp_path / "run")
    data["data"] = {"source": source, "paths": [str(path)]}
    data["train"].update(train)
    if source == "rollouts":
        data["train"]["mode"] = "rl"
        data["rl"] = {"loss": "double_sided_is", "eps_low": 0.2, "eps_high": 0.28}
    return _write(tmp_path / "exp.yaml", data)


def test_sft_data_with_every_record_dropped_lists_each_reason(tmp_path, capsys):
    chats = tmp_path / "chats.jsonl"
    chats.write_text('{"messages": [{"role": "bot", "content": "hi"}]}\n\n{"prompt": "no messages"}\n')
    code, _, err = _train(capsys, _data_config(tmp_path, "chat_jsonl", chats, mode="sft"))
    assert code == 2 and "the SFT dataset is empty" in err
    assert "dropped 2 (empty=1, unknown_role=1)" in err
    assert f"{chats}:1': message 0 has unknown role 'bot'" in err
    assert f"{chats}:3': 'messages' must be a non-empty list, got None" in err


def _rollout_line(rid, **extra):
    return json.dumps({"rollout_id": rid, "group_id": "g", "prompt_ids": [1, 2], "response_ids": [3, 4],
                       "rollout_logprobs": [-0.5, -0.5], "loss_mask": [1, 1], "reward": 1.0, "temperature": 1.0,
                       "weight_versions": [0], **extra})


def test_malformed_rollout_line_names_file_and_line(tmp_path, capsys):
    rollouts = tmp_path / "rollouts.jsonl"
    rollouts.write_text(_rollout_line("a") + "\n\n" + '{"rollout_id": "b", }\n')
    code, _, err = _train(capsys, _data_config(tmp_path, "rollouts", rollouts))
    assert code == 2 and f"{rollouts}:3: not valid JSON (Expecting property name" in err, err


def test_rollout_with_a_bad_field_names_file_line_and_field(tmp_path, capsys):
    rollouts = tmp_path / "rollouts.jsonl"
    rollouts.write_text(_rollout_line("a") + "\n" + _rollout_line("b", reward="high") + "\n")
    code, _, err = _train(capsys, _data_config(tmp_path, "rollouts", rollouts))
    assert code == 2 and f"{rollouts}:2: rollout 'b': field 'reward' is 'high'" in err, err


def test_all_rollouts_failed_reports_the_filter_counts(tmp_path, capsys):
    rollouts = tmp_path / "rollouts.jsonl"
    rollouts.write_text("".join(_rollout_line(f"r{i}", env_failed=True) + "\n" for i in range(4)))
    code, _, err = _train(capsys, _data_config(tmp_path, "rollouts", rollouts))
    assert code == 2 and "no rollout left to train on after filtering" in err
    assert "input=4, dropped_env_failed=4" in err and "dropped_groups=1" in err


# ---- resume ---------------------------------------------------------------------------------

@pytest.mark.slow
def test_resume_drops_metrics_logged_after_the_restored_step(trained, tmp_path, capsys):
    run_dir, config = _copy(trained, tmp_path)
    with Checkpointer(run_dir / "checkpoints") as ckpt:
        ckpt._manager.delete(2)  # as if killed while saving step 2: its metrics line is written, its save is not
    with open(run_dir / "metrics.jsonl", "a") as handle:
        handle.write('{"step": 3, "loss": 1.0}\n{"step": 4, "lo')  # and a line cut by the kill
    code, out, _ = _train(capsys, config, "train.steps=3")
    assert code == 0 and "resumed from step 1" in out
    assert _metric_steps(run_dir) == [1, 2, 3]
    original = [json.loads(line) for line in (trained[0] / "metrics.jsonl").read_text().splitlines()]
    assert json.loads((run_dir / "metrics.jsonl").read_text().splitlines()[1])["loss"] == original[1]["loss"]


@pytest.mark.slow
def test_resume_with_another_config_is_refused_and_leaves_config_yaml(trained, tmp_path, capsys):
    run_dir, config = _copy(trained, tmp_path)
    saved = (run_dir / "config.yaml").read_text()
    code, _, err = _train(capsys, config, "train.steps=4", "train.batch_size=4", "optim.lr=0.01")
    assert code == 2 and "refusing to resume from step 2" in err
    assert "train.batch_size: 2 -> 4" in err and "optim.lr: 0.001 -> 0.01" in err
    assert "train.steps" not in err and "--allow-config-change" in err
    assert (run_dir / "config.yaml").read_text() == saved
    assert _metric_steps(run_dir) == [1, 2]


# ---- non-finite steps -----------------------------------------------------------------------

def _all_finite(run_dir: Path, like_params, like_opt_state) -> list[int]:
    with Checkpointer(run_dir / "checkpoints") as ckpt:
        steps = ckpt.all_steps()
        for step in steps:
            restored = ckpt.restore(like_params, like_opt_state, step=step)
            for name, tree in (("params", restored.params), ("opt_state", restored.opt_state)):
                for path, leaf in jax.tree_util.tree_flatten_with_path(tree)[0]:
                    if np.issubdtype(np.asarray(leaf).dtype, np.inexact):
                        assert np.isfinite(leaf).all(), (step, name, jax.tree_util.keystr(path))
    return steps


def _like(run_dir):
    """Restore targets of the run's params and optimizer state: shapes, dtypes and one device, nothing
    computed (initialising them would compile init and the optimizer's init only to be overwritten)."""
    from glm5_jax.config.experiment import load_experiment
    from glm5_jax.model.transformer import init
    from glm5_jax.train.optim import make_optimizer

    cfg = load_experiment(run_dir.parent / "exp.yaml")
    params = jax.eval_shape(lambda: init(cfg.model, jax.random.key(0)))
    opt_state = jax.eval_shape(make_optimizer(cfg.optim, params, config=cfg.model).init, params)
    device = jax.sharding.SingleDeviceSharding(jax.devices()[0])
    on_device = lambda tree: jax.tree.map(  # noqa: E731
        lambda leaf: jax.ShapeDtypeStruct(leaf.shape, leaf.dtype, sharding=device), tree)
    return on_device(params), on_device(opt_state)


@pytest.mark.slow
def test_inf_gradients_with_finite_loss_are_never_applied_nor_saved(trained, tmp_path, capsys):

    run_dir, config = _copy(trained, tmp_path)
    # lambda = 1e20 keeps the loss finite (~1e21) while the squared gradients overflow: grad_norm and then
    # Adam's second moments turn inf. Clipping is off in _experiment, so nothing rescales them.
    blow_up = ["train.steps=6", "train.mtp_loss_weight=1e20"]
    code, out, err = _train(capsys, config, *blow_up, "--allow-config-change")
    bad = re.search(r"step (\d+) is not finite: (\S+) is the first non-finite value \(loss=([^,]+), "
                    r"grad_norm=inf\); the step was not applied and is not saved", err)
    assert code == 2 and bad, err
    step, leaf, loss = int(bad[1]), bad[2], float(bad[3])
    assert np.isfinite(loss) and leaf.startswith(("opt_state/", "grads/"))
    assert "train.mtp_loss_weight: 0.3 -> 1e+20" in err  # the likely cause: what changed since the checkpoint
    assert "gradient clipping is off" in err and f"the last good checkpoint (step {step - 1}) is kept" in err
    assert _all_finite(run_dir, *_like(run_dir)) == list(range(1, step))
    assert _metric_steps(run_dir) == list(range(1, step))

    code, out, err = _train(capsys, config, *blow_up, "train.non_finite=skip", "--allow-config-change")
    assert code == 0, err
    metrics = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in metrics] == list(range(1, 7))
    skipped = [m["step"] for m in metrics if m.get("skipped")]
    assert step in skipped and out.count("skipped (train.non_finite=skip): step") == len(skipped)
    saved = _all_finite(run_dir, *_like(run_dir))  # every checkpoint finite, params and optimizer state
    assert not set(saved) & set(skipped) and saved[-1] == max(set(range(1, 7)) - set(skipped))


# ---- one run per directory -------------------------------------------------------------------

def _spawn(config: Path, *overrides) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "glm5_jax.cli", "train", str(config), *overrides], cwd=ROOT,
                            env=subprocess_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def _wait_for(predicate, process, seconds=120):
    deadline = time.monotonic() + seconds
    while not predicate():
        assert process.poll() is None, process.communicate()
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.1)


@pytest.mark.slow
def test_second_run_on_a_directory_is_refused_while_the_first_finishes(tmp_path, capsys):
    run_dir = tmp_path / "run"
    config = _write(tmp_path / "exp.yaml", _experiment(run_dir, steps=3))
    first = _spawn(config)
    try:
        _wait_for(lambda: (run_dir / "run.lock").exists(), first)
        owner = json.loads((run_dir / "run.lock").read_text())
        assert owner["pid"] == first.pid
        code, _, err = _train(capsys, config)
        assert code == 2 and f"is in use by another run (pid {first.pid}" in err, err
        out, err = first.communicate(timeout=300)
    finally:
        first.kill()
    assert first.returncode == 0 and "Traceback" not in err, err
    assert _metric_steps(run_dir) == [1, 2, 3]
    with Checkpointer(run_dir / "checkpoints") as ckpt:
        assert ckpt.all_steps() == [1, 2, 3]
    assert not (run_dir / "run.lock").exists()


@pytest.mark.slow
def test_a_killed_runs_lock_is_taken_over(tmp_path, capsys):
    run_dir = tmp_path / "run"
    config = _write(tmp_path / "exp.yaml", _experiment(run_dir, steps=3))
    victim = _spawn(config)
    try:
        _wait_for(lambda: (run_dir / "run.lock").exists() and (run_dir / "run.lock").stat().st_size, victim)
    finally:
        victim.send_signal(signal.SIGKILL)
        victim.wait()
    assert (run_dir / "run.lock").exists()  # a kill -9 leaves the file behind
    code, out, _ = _train(capsys, config)
    assert code == 0 and f"took over the stale lock of {run_dir}: its owner (pid {victim.pid}" in out
    assert _metric_steps(run_dir) == [1, 2, 3]
