"""The seed each experiment's run.sh varies reaches both the initial weights and the order of the data: two
seeds give different weights and different first batches (and the same seed, the same ones)."""

import re
from pathlib import Path

import jax
import numpy as np
import pytest

from experiments.chat_sft.prepare_data import prepare
from experiments.chat_sft.synthetic_chat import generate_records, write_jsonl
from experiments.rl_async.run import HERE as RL_ASYNC, _sections, initial_params
from experiments.rl_async.sort_task import sft_batches
from glm5_jax.config import apply_overrides, load_yaml
from glm5_jax.config.experiment import load_experiment
from glm5_jax.model.transformer import init
from glm5_jax.runner import build_tokenizer, sharded_batches

ROOT = Path(__file__).resolve().parents[2]
EXPERIMENTS = ROOT / "experiments"


def _differs(tree_a, tree_b) -> bool:
    return any(not np.array_equal(a, b) for a, b in zip(jax.tree.leaves(tree_a), jax.tree.leaves(tree_b)))


def _rl_async_sections(seed: int):
    """(model, task, async config) as run.py builds them with run.sh's override async.seed=<seed>."""
    model, task, *_, async_config = _sections(apply_overrides(load_yaml(RL_ASYNC / "config.yaml"),
                                                              [f"async.seed={seed}"]))
    return model, task, async_config


def test_rl_async_seed_reaches_initial_weights_and_sft_batches():
    model, task, seed0 = _rl_async_sections(0)
    seed1 = _rl_async_sections(1)[2]
    assert seed1.seed == 1
    assert _differs(initial_params(model, seed0), initial_params(model, seed1))
    assert not _differs(initial_params(model, seed0), initial_params(model, _rl_async_sections(0)[2]))
    first0, first1 = next(sft_batches(task, seed0)), next(sft_batches(task, seed1))
    assert not np.array_equal(first0["tokens"], first1["tokens"])
    assert np.array_equal(first0["tokens"], next(sft_batches(task, seed0))["tokens"])
    assert len(list(sft_batches(task, seed0))) == seed0.sft_steps


def _first_batch(config: Path, overrides: list[str]):
    cfg = load_experiment(config, overrides)
    batches, _ = sharded_batches(cfg, build_tokenizer(cfg))
    return cfg, next(iter(batches))["tokens"]


@pytest.mark.parametrize("config", [pytest.param("configs/pretrain_dense_long.yaml", marks=pytest.mark.slow),
                                    "configs/dsa_warmup.yaml",
                                    "configs/dsa_sparse.yaml",
                                    "experiments/dsa_continued_pretraining/dense_control.yaml"])
def test_dsa_seed_reaches_the_batch_order_of_every_stage(config):
    # The same pipeline over fewer stdlib files, to keep the test short; no earlier stage to start from here.
    small = ["data.max_files=30", "train.init_from=''"]
    cfg0, tokens0 = _first_batch(ROOT / config, small + ["train.seed=0"])
    cfg1, tokens1 = _first_batch(ROOT / config, small + ["train.seed=1"])
    assert cfg1.train.seed == 1
    assert not np.array_equal(tokens0, tokens1)
    assert np.array_equal(tokens0, _first_batch(ROOT / config, small + ["train.seed=0"])[1])
    if config.startswith("configs/pretrain"):  # the later stages start from its weights (train.init_from)
        assert _differs(init(cfg0.model, jax.random.key(cfg0.train.seed)), init(cfg1.model, jax.random.key(1)))


def test_chat_sft_seed_reaches_initial_weights_and_batch_order(tmp_path):
    records = tmp_path / "train.jsonl"
    write_jsonl(prepare(generate_records(40, seed=0), unmask_errors=False), records)
    data = [f"data.paths=[{records}]"]
    cfg0, tokens0 = _first_batch(ROOT / "configs/sft_chat.yaml", data + ["train.seed=0"])
    cfg1, tokens1 = _first_batch(ROOT / "configs/sft_chat.yaml", data + ["train.seed=1"])
    assert not np.array_equal(tokens0, tokens1)
    assert _differs(init(cfg0.model, jax.random.key(cfg0.train.seed)),
                    init(cfg1.model, jax.random.key(cfg1.train.seed)))


@pytest.mark.parametrize("experiment", ["dsa_continued_pretraining", "chat_sft"])
def test_every_training_command_of_run_sh_takes_the_seed(experiment):
    script = (EXPERIMENTS / experiment / "run.sh").read_text().replace("\\\n", " ")
    commands = [line for line in script.splitlines() if "glm5_jax.cli train" in line]
    assert len(commands) >= 2
    for command in commands:
        assert re.search(r'"?train\.seed=\$seed"?', command), command


def test_rl_async_run_sh_sets_the_seed_and_a_folder_per_seed():
    script = (EXPERIMENTS / "rl_async" / "run.sh").read_text()
    assert re.search(r'run\.py --out "\$RESULTS/seed_\$seed" .*"async\.seed=\$seed"', script)
