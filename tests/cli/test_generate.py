"""`glm5 generate` through the command line: the library's decode loop at the same seed, MTP speculative
decoding's greedy tokens, HF `generate` from a Hugging Face checkpoint directory, and two-device meshes. The
commands run in the test process (`run_cli`), except the two-device one (a device count needs a new process)."""

import json
import os
import subprocess
import sys
from pathlib import Path

import jax
import numpy as np
import pytest
import torch
from cli_in_process import run_cli
from xla_env import REPO, subprocess_env

from glm5_jax.commands.source import load_source, stop_ids
from glm5_jax.generation import SamplingParams, generate

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "convert"))
from hf_checkpoints import write_sharded_checkpoint  # noqa: E402

# Two prompts of different lengths, batched together.
PROMPTS = [{"id": "a", "prompt": "def main(argv):\n    "}, {"id": "b", "prompt": "import os"}]


def _write_prompts(path: Path, records) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


def _records(stdout: str) -> list[dict]:
    return [json.loads(line) for line in stdout.splitlines() if line.startswith("{")]


@pytest.mark.slow
def test_generate_gives_the_library_decode_loop_tokens_at_the_same_seed(trained_run, tmp_path):
    run_dir, _ = trained_run
    prompts = _write_prompts(tmp_path / "p.jsonl", PROMPTS)
    done = run_cli("generate", str(run_dir), "--prompts", str(prompts), "--json", "--max-new-tokens", "6",
                   "--temperature", "1", "--seed", "3")
    assert done.returncode == 0, done.stderr[-3000:]
    records = _records(done.stdout)
    assert [r["id"] for r in records] == ["a", "b"]

    source = load_source(run_dir)
    ids = [source.tokenizer.encode(p["prompt"]) for p in PROMPTS]
    assert [r["prompt_ids"] for r in records] == ids
    sampling = SamplingParams(temperature=1.0, max_new_tokens=6, eos_ids=stop_ids(source))
    expected = generate(source.params, ids, config=source.config, sampling=sampling,
                        rng=jax.random.fold_in(jax.random.key(3), 0))
    for row, record in enumerate(records):
        n = int(expected.lengths[row])
        assert record["tokens"] == expected.tokens[row, :n].tolist()
        np.testing.assert_allclose(record["logprobs"], expected.logprobs[row, :n], atol=1e-6)
        shown = [t for t in record["tokens"] if t < source.tokenizer.vocab_size and t not in stop_ids(source)]
        assert record["text"] == source.tokenizer.decode(shown)


@pytest.mark.slow
def test_speculative_greedy_tokens_equal_plain_greedy_tokens(trained_run, tmp_path):
    run_dir, _ = trained_run
    prompts = _write_prompts(tmp_path / "p.jsonl", PROMPTS)
    # The plain run has the shapes of the other tests' runs on PROMPTS (6 new tokens): compiled once for all.
    common = ("generate", str(run_dir), "--prompts", str(prompts), "--json", "--max-new-tokens", "6",
              "--temperature", "0")
    plain = run_cli(*common)
    drafted = run_cli(*common, "--speculative", "2")
    assert plain.returncode == 0 and drafted.returncode == 0, (plain.stderr + drafted.stderr)[-3000:]
    assert [r["tokens"] for r in _records(drafted.stdout)] == [r["tokens"] for r in _records(plain.stdout)]
    assert "tokens per verify forward" in drafted.stderr and "of 2 drafts accepted" in drafted.stderr


@pytest.mark.slow
def test_a_single_prompt_is_streamed_as_text(trained_run):
    run_dir, _ = trained_run
    relative = os.path.relpath(run_dir, REPO)  # as a user types it (the command runs in REPO)
    done = run_cli("generate", relative, "--prompt", "class ", "--max-new-tokens", "5", "--temperature", "0")
    assert done.returncode == 0, done.stderr[-3000:]
    source = load_source(run_dir)
    sampling = SamplingParams(temperature=0.0, max_new_tokens=5, eos_ids=stop_ids(source))
    out = generate(source.params, [source.tokenizer.encode("class ")], config=source.config, sampling=sampling)
    tokens = out.tokens[0, :out.lengths[0]]
    text = source.tokenizer.decode([t for t in tokens if t < 256])
    assert done.stdout == text + "\n"


@pytest.mark.slow
def test_greedy_from_a_hugging_face_checkpoint_equals_hf_generate(tmp_path):
    model, _, _ = write_sharded_checkpoint(tmp_path / "hf", dtype=torch.float32)
    rng = np.random.RandomState(5)
    prompts = [rng.randint(0, 160, 14).tolist(), rng.randint(0, 160, 9).tolist()]  # longer than index_topk 8
    file = _write_prompts(tmp_path / "p.jsonl", [{"prompt_ids": p} for p in prompts])
    done = run_cli("generate", str(tmp_path / "hf"), "--prompts", str(file), "--json", "--max-new-tokens", "6",
                   "--temperature", "0")
    assert done.returncode == 0, done.stderr[-3000:]
    model.generation_config.eos_token_id = None  # the byte tokenizer's stop ids are outside this vocabulary
    for prompt, record in zip(prompts, _records(done.stdout)):
        with torch.no_grad():
            hf = model.generate(torch.tensor([prompt]), max_new_tokens=6, do_sample=False, pad_token_id=0)
        assert record["tokens"] == hf[0, len(prompt):].tolist()


@pytest.mark.slow
def test_generate_on_a_two_device_mesh_gives_the_one_device_tokens(trained_run, tmp_path):
    """The batch split over `fsdp`, and each prompt and the cache split over `context`."""
    run_dir, _ = trained_run
    prompts = _write_prompts(tmp_path / "p.jsonl", PROMPTS)
    args = [sys.executable, "-m", "glm5_jax.cli", "generate", str(run_dir), "--prompts", str(prompts), "--json",
            "--max-new-tokens", "6", "--temperature", "0"]
    one = run_cli(*args[3:])
    assert one.returncode == 0, one.stderr[-3000:]
    for mesh in ("mesh.fsdp=2", "mesh.context=2"):
        two = subprocess.run([*args, mesh], capture_output=True, text=True, env=subprocess_env(devices=2), cwd=REPO,
                             timeout=600)
        assert two.returncode == 0, f"{mesh}: {two.stderr[-3000:]}"
        assert [r["tokens"] for r in _records(two.stdout)] == [r["tokens"] for r in _records(one.stdout)], mesh
