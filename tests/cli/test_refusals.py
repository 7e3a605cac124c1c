"""Bad input to `glm5 generate / eval / rollout` is refused by name (exit code 2) before anything compiles,
and nothing is written."""

import json

import pytest

from glm5_jax.cli import main

REWARD = "glm5_jax.examples.rewards:python_line"


def _error(capsys) -> str:
    return capsys.readouterr().err


def test_a_missing_or_empty_source_is_refused(tmp_path, capsys):
    assert main(["generate", str(tmp_path / "absent"), "--prompt", "x"]) == 2
    assert f"glm5 generate: SOURCE '{tmp_path / 'absent'}' does not exist" in _error(capsys)
    (tmp_path / "run" / "checkpoints").mkdir(parents=True)
    assert main(["eval", str(tmp_path / "run"), "configs/train_tiny_stdlib.yaml"]) == 2
    assert "has no checkpoint yet (checkpoints/ is missing or empty)" in _error(capsys)
    (tmp_path / "other").mkdir()
    assert main(["rollout", str(tmp_path / "other"), "p.jsonl", "--out", "o.jsonl", "--reward", REWARD]) == 2
    assert "is neither a run directory" in _error(capsys)


@pytest.mark.parametrize("spec, message", [
    ("glm5_jax.examples.rewards:no_such_function", "module 'glm5_jax.examples.rewards' has no function "
                                                   "'no_such_function'; it has ['contains_answer', 'python_line']"),
    ("no_such_module:reward", "cannot import module 'no_such_module'"),
    ("python_line", "expected module:function"),
])
def test_a_reward_that_does_not_exist_is_refused_before_the_model_is_read(spec, message, tmp_path, capsys):
    assert main(["rollout", str(tmp_path / "absent"), "p.jsonl", "--out", str(tmp_path / "o.jsonl"),
                 "--reward", spec]) == 2
    assert message in _error(capsys)
    assert not (tmp_path / "o.jsonl").exists()


@pytest.mark.slow
def test_bad_prompts_long_prompts_and_an_existing_out_are_refused(trained_run, tmp_path, capsys):
    run_dir, _ = trained_run
    prompts = tmp_path / "p.jsonl"
    prompts.write_text(json.dumps({"prompt": "ok"}) + "\n" + "{not json\n")
    assert main(["generate", str(run_dir), "--prompts", str(prompts)]) == 2
    assert f"{prompts}:2: not valid JSON" in _error(capsys)
    prompts.write_text(json.dumps({"prompt": "ok"}) + "\n" + json.dumps({"text": "no prompt field"}) + "\n")
    assert main(["generate", str(run_dir), "--prompts", str(prompts)]) == 2
    assert f"{prompts}:2: a prompt needs exactly one of ['prompt', 'prompt_ids', 'messages']" in _error(capsys)
    prompts.write_text(json.dumps({"prompt_ids": [5] * 4090}) + "\n")
    assert main(["generate", str(run_dir), "--prompts", str(prompts), "--max-new-tokens", "8"]) == 2
    assert (f"{prompts}:1: the prompt has 4090 tokens; with --max-new-tokens=8 it needs 4098 positions, more "
            "than the model's context (max_position_embeddings=4096)") in _error(capsys)
    prompts.write_text(json.dumps({"prompt_ids": [1, 300]}) + "\n")
    assert main(["generate", str(run_dir), "--prompts", str(prompts)]) == 2
    assert f"{prompts}:1: token id 300 is outside the model's vocabulary [0, 288)" in _error(capsys)

    out = tmp_path / "out.jsonl"
    out.write_text("")
    prompts.write_text(json.dumps({"prompt": "x"}) + "\n")
    assert main(["rollout", str(run_dir), str(prompts), "--out", str(out), "--reward", REWARD]) == 2
    assert f"--out '{out}' exists: pass --append" in _error(capsys)
    assert out.read_text() == ""
    assert main(["generate", str(run_dir), "--prompt", "x", "--speculative", "-1"]) == 2
    assert "--speculative=-1 is invalid" in _error(capsys)
