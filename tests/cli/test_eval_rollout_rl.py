"""`glm5 eval` and `glm5 rollout` through the command line, and `glm5 train` in RL mode on the rollouts with
the model taken from train.init_from (configs/rl_grpo_icepop.yaml has no model section). The commands run in
the test process (`run_cli`): none of them needs a fresh one."""

import json

import jax.numpy as jnp
import numpy as np
import pytest
from cli_in_process import run_cli
from xla_env import REPO

from glm5_jax.commands.source import load_source
from glm5_jax.config.rl import RLConfig
from glm5_jax.data.rollouts import make_batch, read_rollouts, validate_records
from glm5_jax.model.token_logprobs import token_logprobs
from glm5_jax.model.transformer import forward

# Prompts of one length (21 bytes) rolled out one prompt per batch with the same sampling options: every batch
# of both rollout tests has the same shapes, so generation compiles once for the file.
PROMPTS = [{"id": "first", "prompt": "def f(x):\n    return "}, {"id": "second", "prompt": "import os.path as osp"},
           {"id": "third", "prompt": "x = [1, 2, 3, 4, 5, 6"}]
SAMPLING = ("--samples", "2", "--max-new-tokens", "6", "--batch-prompts", "1", "--routing")
REWARD = "glm5_jax.examples.rewards:python_line"


@pytest.mark.slow
def test_eval_loss_equals_the_training_runs_held_out_loss(trained_run):
    run_dir, summary = trained_run
    done = run_cli("eval", str(run_dir), str(run_dir / "config.yaml"))
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(done.stdout.splitlines()[-1])
    assert result["split"] == "validation" and result["batches"] == 2
    np.testing.assert_allclose(result["loss"], summary["eval_loss"], rtol=1e-6)
    np.testing.assert_allclose(result["bits_per_byte"], result["loss"] / np.log(2))
    assert "batch 2/2" in done.stderr


def _recomputed_logprobs(run_dir, records):
    source = load_source(run_dir)
    seq_len = max(r.num_tokens for r in records)
    batch = make_batch(records, seq_len=seq_len, config=RLConfig(eps_low=0.2, eps_high=0.2))
    out = forward(source.params, jnp.asarray(batch["tokens"]), config=source.config,
                  segment_ids=jnp.asarray(batch["segment_ids"]), mtp_steps=0)
    logp, _ = token_logprobs(out.hidden, source.params["lm_head"]["kernel"], jnp.asarray(batch["targets"]),
                             temperature=jnp.asarray(batch["temperature"]))
    mask = batch["loss_mask"] > 0
    return np.asarray(logp)[mask], batch["rollout_logprobs"][mask]


@pytest.mark.slow
def test_rollouts_are_on_policy_continue_without_duplicates_and_train_rl(trained_run, tmp_path):
    run_dir, _ = trained_run
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps(p) + "\n" for p in PROMPTS[:2]))
    out = tmp_path / "rollouts.jsonl"
    common = ("--reward", REWARD, *SAMPLING, "--out", str(out))
    first = run_cli("rollout", str(run_dir), str(prompts), *common)
    assert first.returncode == 0, first.stderr[-3000:]
    records = read_rollouts(out)
    validate_records(records, vocab_size=288)
    assert [r.rollout_id for r in records] == ["first/0", "first/1", "second/0", "second/1"]
    assert all(r.expert_choices is not None and r.indexer_topk is not None for r in records)
    assert {r.weight_versions for r in records} == {(4,)}

    # Continuing: the prompts already rolled out are skipped, a new one is added; without --append: refused.
    prompts.write_text("".join(json.dumps(p) + "\n" for p in PROMPTS))
    refused = run_cli("rollout", str(run_dir), str(prompts), *common)
    assert refused.returncode == 2 and "exists: pass --append" in refused.stderr
    more = run_cli("rollout", str(run_dir), str(prompts), *common, "--append")
    assert more.returncode == 0, more.stderr[-3000:]
    assert "2 of 3 prompts already in" in more.stderr
    records = read_rollouts(out)
    assert [r.rollout_id for r in records][4:] == ["third/0", "third/1"]
    recomputed, recorded = _recomputed_logprobs(run_dir, records)
    np.testing.assert_allclose(recomputed, recorded, atol=1e-5)

    rl = run_cli("train", str(REPO / "configs" / "rl_grpo_icepop.yaml"), "data.source=rollouts",
                 f"data.paths=[{out}]", f"train.init_from={run_dir}", f"train.run_dir={tmp_path / 'rl'}",
                 "train.batch_size=6", "train.seq_len=64", "train.microbatches=1", "train.steps=1")
    assert rl.returncode == 0, rl.stderr[-3000:]
    step = json.loads((tmp_path / "rl" / "metrics.jsonl").read_text().splitlines()[0])
    assert step["loss_tokens"] == sum(len(r.response_ids) for r in records)
    for name in ("ratio_min", "ratio_max", "ratio_mean"):
        assert abs(step[name] - 1.0) < 1e-5, (name, step[name])


@pytest.mark.slow
def test_a_failing_reward_names_its_record_and_leaves_only_whole_batches(trained_run, tmp_path):
    run_dir, _ = trained_run
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps(p) + "\n" for p in PROMPTS))
    out = tmp_path / "rollouts.jsonl"
    done = run_cli("rollout", str(run_dir), str(prompts), "--out", str(out), *SAMPLING,
                   "--reward", "tests.cli.reward_functions:fails_on_second_prompt")
    assert done.returncode == 2
    assert f"raised KeyError: 'answer' for prompt 'second' ({prompts}:2), sample 0" in done.stderr
    assert [r.rollout_id for r in read_rollouts(out)] == ["first/0", "first/1"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["prompts.jsonl", "rollouts.jsonl"]


@pytest.mark.slow
def test_eval_sft_mode_scores_only_the_assistant_tokens(trained_run, tmp_path):
    run_dir, _ = trained_run
    chat = tmp_path / "chat.jsonl"
    record = {"messages": [{"role": "user", "content": "name a module /nothink"},
                           {"role": "assistant", "content": "os"}]}
    chat.write_text(json.dumps(record) + "\n")
    plain = tmp_path / "plain.jsonl"
    plain.write_text(json.dumps({"text": "name a module: os"}) + "\n")
    runs = {mode: run_cli("eval", str(run_dir), str(path), "--mode", mode, "--batches", "1",
                          "train.seq_len=64", "train.batch_size=2")
            for mode, path in (("sft", chat), ("pretrain", plain))}
    for done in runs.values():
        assert done.returncode == 0, done.stderr[-3000:]
    sft, pretrain = (json.loads(runs[m].stdout.splitlines()[-1]) for m in ("sft", "pretrain"))
    assert sft["data"]["source"] == "chat_jsonl" and pretrain["data"]["source"] == "jsonl"
    # The conversation renders to 31 tokens of which 3 are trained ("os" and the closing <|endoftext|>); the
    # data repeat, so each row of 64 packs two copies: 2 rows x 2 copies x 3 tokens.
    assert sft["scored_tokens"] == 12
    assert pretrain["scored_tokens"] > 2 * sft["scored_tokens"]
