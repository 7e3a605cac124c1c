"""`glm5 train`: resumable runs (2N == N + resume + N), metrics files, and clear failures."""

import dataclasses
import json
import shutil
from pathlib import Path

import jax
import numpy as np
import pytest

from glm5_jax.checkpoint import Checkpointer, NonFiniteStateError
from glm5_jax.config import ConfigError, ModelConfig
from glm5_jax.config.experiment import experiment_from_dict
from glm5_jax.model.transformer import init
from glm5_jax.runner import TrainingError, run
from glm5_jax.train.tensorboard import read_scalars
from fixtures.run_before_issue28.make_fixture import leaf_digests
from xla_env import cpu_code_flags

MODEL = dict(vocab_size=288, hidden_size=32, intermediate_size=48, moe_intermediate_size=16, num_hidden_layers=2,
             num_attention_heads=2, q_lora_rank=16, kv_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=4,
             v_head_dim=8, n_routed_experts=4, num_experts_per_tok=2, first_k_dense_replace=1, index_n_heads=2,
             index_head_dim=8, index_topk=8, mtp_num_steps=1, compute_dtype="float32")
NO_EVAL = {"validation_fraction": 0.0}


def _config(run_dir, steps, data=None, **train):
    # The model, optimizer and shapes of test_run_safety.py's runs: one compiled step (persistent cache) for both.
    return experiment_from_dict({
        "model": MODEL,
        "optim": {"name": "adamw", "lr": 1e-3, "min_lr": 1e-4, "warmup_steps": 1, "total_steps": 8,
                  "grad_clip_norm": 0.0},
        "train": {"steps": steps, "batch_size": 2, "seq_len": 32, "log_every": 2, "vocab_chunk": 128,
                  "run_dir": str(run_dir), "eval_batches": 1, **train},
        "data": {"source": "stdlib", "max_files": 6, **(data or {})},
        "checkpoint": {"every": 2, "keep": 2},
    })


def _losses(run_dir):
    return [json.loads(line)["loss"] for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def _params(run_dir, like):
    with Checkpointer(run_dir / "checkpoints") as ckpt:
        return ckpt.restore(like).params


@pytest.mark.slow
def test_train_2n_equals_n_then_resume_n(tmp_path):
    straight = tmp_path / "straight"
    summary = run(_config(straight, 4, NO_EVAL), log=lambda _: None)
    assert summary["final_loss"] < summary["first_loss"]
    split = tmp_path / "split"
    run(_config(split, 2, NO_EVAL), log=lambda _: None)
    resumed = run(_config(split, 4, NO_EVAL), log=lambda _: None)
    assert resumed["resumed_from"] == 2
    np.testing.assert_array_equal(_losses(split), _losses(straight))
    like = init(ModelConfig(**MODEL), jax.random.key(0))
    for (path, x), y in zip(jax.tree_util.tree_flatten_with_path(_params(straight, like))[0],
                            jax.tree.leaves(_params(split, like))):
        np.testing.assert_array_equal(x, y, err_msg=jax.tree_util.keystr(path))
    tags = {tag for _, tag, _ in read_scalars(straight / "tb")}
    assert {"loss", "lm_loss", "tokens_per_s", "grad_norm"} <= tags


FIXTURE = Path(__file__).parents[1] / "fixtures" / "run_before_issue28"


@pytest.mark.slow
def test_a_run_written_before_the_refactor_resumes(tmp_path, monkeypatch):
    """A 2-step Muon run (with MTP) written by d073238, the code before issue 28's refactor, resumes under this
    code: its checkpoint format (o_proj kernels and their momenta saved [L, H, P, D], restored [L, D, H, P]), its
    data position, and the losses of steps 3-4 that d073238 computes from it (`expected.json`; the same on every
    CPU recorded there). Until 2026-12-05 the step-4 parameters matched d073238's bit for bit as well; keeping
    o_proj [D, H, P] and q_b_proj's rope columns de-interleaved on the weight (HBM traffic on TPU,
    benchmarks/BENCHMARKS.md) reorders the sums of two contractions, so their bits can no longer match: the
    losses are held to float32 rounding instead."""
    spec = json.loads((FIXTURE / "experiment.json").read_text())
    expected = json.loads((FIXTURE / "expected.json").read_text())
    assert cpu_code_flags() == expected["xla_flags"], (
        "the suite's XLA flags changed since the fixture was made, and bits depend on them: rerun make_fixture.py")
    shutil.copytree(FIXTURE, tmp_path, dirs_exist_ok=True)
    monkeypatch.chdir(tmp_path)  # the experiment's paths are relative
    summary = run(experiment_from_dict(spec), log=lambda _: None)
    assert summary["resumed_from"] == 2
    losses = _losses(tmp_path / "run")
    assert losses[:2] == expected["outcomes"][0]["losses"][:2]  # the stored run's own steps, read back
    for outcome in expected["outcomes"]:
        np.testing.assert_allclose(losses, outcome["losses"], rtol=1e-6, err_msg=outcome["cpu"])
    like = init(ModelConfig(**spec["model"]), jax.random.key(0))
    params = _params(tmp_path / "run", like)
    assert all(np.isfinite(np.asarray(leaf)).all() for leaf in jax.tree.leaves(params))
    assert set(leaf_digests(params)) == set(expected["outcomes"][0]["params_sha256"])  # every leaf, as saved


@pytest.mark.slow
def test_non_finite_loss_stops_without_overwriting_the_last_good_checkpoint(tmp_path):
    cfg = _config(tmp_path / "nan", 4, NO_EVAL)
    # A learning rate this large overflows the parameters within a few steps.
    cfg = dataclasses.replace(cfg, optim=dataclasses.replace(cfg.optim, lr=1e30, min_lr=0.0, grad_clip_norm=0.0))
    # Either the loss or (first) the parameters turn non-finite; both stop the run before a save.
    with pytest.raises((TrainingError, NonFiniteStateError), match="not finite|non-finite"):
        run(cfg, log=lambda _: None)
    with Checkpointer(tmp_path / "nan" / "checkpoints") as ckpt:
        steps = ckpt.all_steps()
    losses = _losses(tmp_path / "nan")
    assert all(np.isfinite(losses[s - 1]) for s in steps)  # only finite steps were ever saved


def test_bad_experiment_configs_name_the_problem(tmp_path):
    with pytest.raises(ConfigError, match="train.mode"):
        _config(tmp_path, 2, mode="finetune")
    with pytest.raises(ConfigError, match="data.paths.*file not found"):
        experiment_from_dict({"model": MODEL, "data": {"source": "jsonl", "paths": [str(tmp_path / "none.jsonl")]}})
    with pytest.raises(ConfigError, match="optim.trainable"):
        _config(tmp_path, 2, mode="dsa_warmup")
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"text": "ok"}\n{"text": broken\n')
    cfg = experiment_from_dict({"model": MODEL, "data": {"source": "jsonl", "paths": [str(bad)]},
                                "train": {"run_dir": str(tmp_path / "r"), "batch_size": 2, "seq_len": 16}})
    with pytest.raises(ValueError, match="bad.jsonl:2"):
        run(cfg, log=lambda _: None)


@pytest.mark.slow
def test_rl_mode_trains_from_stored_rollouts(tmp_path):
    from glm5_jax.data.rollouts import RolloutRecord, write_rollouts

    rng = np.random.RandomState(0)
    records = []
    for group in range(3):
        for member in range(2):
            response = rng.randint(0, 200, 6)
            records.append(RolloutRecord(
                rollout_id=f"g{group}m{member}", group_id=f"g{group}", prompt_ids=rng.randint(0, 200, 5),
                response_ids=response, rollout_logprobs=-rng.rand(6).astype(np.float32) - 0.1,
                loss_mask=np.ones(6, np.int32), reward=float(member), temperature=1.0, weight_versions=(3,)))
    path = tmp_path / "rollouts.jsonl"
    write_rollouts(path, records)
    cfg = experiment_from_dict({
        "model": MODEL, "optim": {"name": "adamw", "lr": 1e-3, "min_lr": 0.0, "warmup_steps": 1, "total_steps": 2},
        "train": {"mode": "rl", "steps": 2, "batch_size": 2, "seq_len": 16, "log_every": 1, "vocab_chunk": 128,
                  "bias_update_rate": 0.0, "run_dir": str(tmp_path / "rl")},
        "data": {"source": "rollouts", "paths": [str(path)]},
        "rl": {"loss": "double_sided_is", "eps_low": 0.2, "eps_high": 0.28},
    })
    lines = []
    summary = run(cfg, log=lines.append)
    assert np.isfinite(summary["final_loss"])
    assert any('"kept": 6' in line for line in lines)  # the filter report is printed, nothing dropped
    metrics = [json.loads(line) for line in (tmp_path / "rl" / "metrics.jsonl").read_text().splitlines()]
    assert {"ratio_mean", "reward_mean"} <= set(metrics[-1])
