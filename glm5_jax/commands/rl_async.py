"""`glm5 rl-async CONFIG [section.key=value ...]`: asynchronous off-policy RL on a task given as code.

A rollout worker samples groups with weights that lag the trainer, the trainer runs the RL step on what the
worker recorded (token ids, logprobs, routing) and pushes its weights every `async.push_every` steps; samples
older than `rl.max_staleness` versions are dropped (glm5_jax.rollout.async_rl).

CONFIG holds the sections of `glm5 train` the driver uses: `model:` (or none with `train.init_from=RUN`),
`optim:`, `train:` (mode rl, batch_size = async.prompts_per_step * async.group_size, seq_len = the task's,
run_dir), `rl:` and `mesh:`; plus `async:` (steps, prompts per step, group size, weight pushes, queue depth,
sampling temperature, held-out evaluation, seed) and `task:`, whose `factory` names the task as
`module:function` (e.g. glm5_jax.examples.sort_task:SortTask); the task section's other fields are the
factory's keyword arguments. A task has `prompts(rng, n)`, `reward(prompt, response)`, `validate(vocab_size)`,
`seq_len`, `answer_len` and `eos`. Every section is parsed, the task built and checked against the model
before anything compiles; an error names the field, the value and what is valid.

Starting weights: the latest checkpoint of `train.init_from=RUN` (a `glm5 train` run or a `glm5 import-hf`
import, whose model the config takes), else fresh from `async.seed`, which also draws the worker's prompts
and sampling keys and the held-out prompts. Writes RUN_DIR/metrics.jsonl (one JSON line per trainer step:
staleness, sampled reward, masked fraction, off-policy ratios, drops, greedy accuracy every
`async.eval_every` steps), RUN_DIR/summary.json, RUN_DIR/config.yaml (the model, optimizer, train and rl
sections, as `glm5 train` writes it) and the final parameters and optimizer state in RUN_DIR/checkpoints/:
the run directory is a SOURCE of `glm5 generate / eval / rollout` and a `train.init_from` of later runs.
"""

from __future__ import annotations

import dataclasses
import inspect
import json
from pathlib import Path
from typing import Any, Callable

import jax
import numpy as np
import yaml

from glm5_jax.commands.importable import load_callable
from glm5_jax.commands.source import CommandError
from glm5_jax.config import ConfigError, _fail, from_dict
from glm5_jax.config.async_rl import AsyncRLConfig
from glm5_jax.config.experiment import ExperimentConfig, experiment_from_dict, experiment_to_dict, parse_config_file
from glm5_jax.model.transformer import init
from glm5_jax.rollout.async_rl import require_train_fits, run_async_rl
from glm5_jax.runner import load_params

TASK_EXAMPLE = "glm5_jax.examples.sort_task:SortTask"
TASK_ATTRIBUTES = ("prompts", "reward", "validate", "seq_len", "answer_len", "eos")
SECTIONS = ("model", "optim", "train", "rl", "mesh", "async", "task")
STEPS_FILE, SUMMARY_FILE, CONFIG_FILE, CHECKPOINTS = "metrics.jsonl", "summary.json", "config.yaml", "checkpoints"


@dataclasses.dataclass(frozen=True)
class RLAsyncConfig:
    experiment: ExperimentConfig  # model, optim, train, rl, mesh
    async_config: AsyncRLConfig
    task: Any


def _factory_arguments(factory: Callable, spec: str, arguments: dict) -> None:
    """Refuse a `task:` field the factory does not take (unless it takes **kwargs)."""
    try:
        parameters = inspect.signature(factory).parameters
    except (TypeError, ValueError):  # a builtin without a signature: let the call decide
        return
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in parameters.values()):
        return
    for name, value in arguments.items():
        if name not in parameters:
            _fail(f"task.{name}", value, f"{spec} takes no such argument; it takes {sorted(parameters)}")


def build_task(section: dict | None, vocab_size: int):
    """The task `section["factory"]` builds from the section's other fields, checked against the model."""
    arguments = dict(section or {})
    spec = arguments.pop("factory", None)
    if spec is None:
        _fail("task.factory", spec, f"name the task as module:function, e.g. task.factory={TASK_EXAMPLE}")
    try:
        factory = load_callable(spec, field="task.factory", example=TASK_EXAMPLE)
    except CommandError as err:
        raise ConfigError(str(err)) from None
    if dataclasses.is_dataclass(factory):  # its fields' types are known: values are coerced and checked
        task = from_dict(factory, arguments, prefix="task.")
    else:
        _factory_arguments(factory, spec, arguments)
        try:
            task = factory(**arguments)
        except TypeError as err:  # e.g. a required argument the task: section does not give
            _fail("task.factory", spec, f"calling it with the task: section's other fields {arguments} failed: {err}")
    missing = [name for name in TASK_ATTRIBUTES if not hasattr(task, name)]
    if missing:
        _fail("task.factory", spec, f"it returned a {type(task).__name__} without {missing}; a task has "
              f"{list(TASK_ATTRIBUTES)}")
    task.validate(vocab_size)
    return task


def rl_async_from_dict(data: dict) -> RLAsyncConfig:
    """Every section parsed and checked, the task built: nothing is compiled or read from a run yet."""
    unknown = sorted(set(data) - set(SECTIONS))
    if unknown:
        _fail(unknown[0], data[unknown[0]], f"unknown section of glm5 rl-async; known sections are {list(SECTIONS)}")
    for name in ("async", "task"):
        if data.get(name) is not None and not isinstance(data[name], dict):
            _fail(name, data[name], f"the {name}: section must be a mapping of field: value lines")
    train = data.get("train") if isinstance(data.get("train"), dict) else {}  # a bad section: refused below
    for name in ("steps", "seed"):  # the driver's own; train's would be silently ignored
        if name in train:
            _fail(f"train.{name}", train[name], f"glm5 rl-async takes async.{name} instead; leave "
                  f"train.{name} out")
    experiment = experiment_from_dict({name: value for name, value in data.items() if name not in ("async", "task")})
    async_config = from_dict(AsyncRLConfig, data.get("async") or {}, prefix="async.").validate()
    task = build_task(data.get("task"), experiment.model.vocab_size)
    require_train_fits(experiment.train, async_config, task)
    return RLAsyncConfig(experiment=experiment, async_config=async_config, task=task)


def load_rl_async(path: str | Path, overrides: list[str] | None = None) -> RLAsyncConfig:
    """CONFIG with `section.key=value` overrides applied (the parser every subcommand uses)."""
    return parse_config_file(path, overrides, rl_async_from_dict)


def starting_params(config: RLAsyncConfig):
    """Fresh weights from async.seed, or the latest checkpoint of train.init_from."""
    params = init(config.experiment.model, jax.random.key(config.async_config.seed))
    if config.experiment.train.init_from:
        params = load_params(config.experiment.train.init_from, params)
    return params


def run_rl_async(config: RLAsyncConfig, params, steps_path: Path, log: Callable[[dict], None] = lambda row: None,
                 checkpoint_dir: Path | None = None) -> list[dict]:
    """RL from `params`: one JSON line per trainer step written (and flushed) to `steps_path` and passed to
    `log`, the final state saved to `checkpoint_dir` when given; returns the rows."""
    experiment = config.experiment
    with Path(steps_path).open("w") as sink:
        def record(row: dict) -> None:
            sink.write(json.dumps(row) + "\n")
            sink.flush()
            log(row)

        return run_async_rl(params, experiment.model, experiment.train, experiment.optim, experiment.rl,
                            config.async_config, config.task, log=record, mesh=experiment.mesh,
                            checkpoint_dir=checkpoint_dir)


def summarize(rows: list[dict], window: int = 10) -> dict:
    """Sampled reward over the first and last `window` steps, the greedy accuracies, masking and drops."""
    evals = [(r["step"], r["greedy_accuracy"]) for r in rows if "greedy_accuracy" in r]
    return {
        "sampled_reward_first": float(np.mean([r["reward_mean"] for r in rows[:window]])),
        "sampled_reward_last": float(np.mean([r["reward_mean"] for r in rows[-window:]])),
        "greedy_accuracy": evals,
        "masked_frac_mean": float(np.mean([r["masked_frac"] for r in rows])),
        "would_mask_frac_mean": float(np.mean([r["would_mask_frac"] for r in rows])),
        "staleness_seen": sorted({r["staleness"] for r in rows}),
        "dropped_stale": rows[-1]["dropped_stale"],
        "wall_s": rows[-1]["wall_s"],
    }


def check_run_dir(run_dir: Path) -> None:
    """An earlier run's results are never overwritten."""
    for name in (STEPS_FILE, SUMMARY_FILE, CHECKPOINTS, CONFIG_FILE):
        if (run_dir / name).exists():
            _fail("train.run_dir", str(run_dir), f"it already holds {name} of an earlier run: choose another "
                  "train.run_dir or move that one away")


def run_in_run_dir(config: RLAsyncConfig, log: Callable[[dict], None] = lambda row: None) -> dict:
    """What `glm5 rl-async` runs: RL into train.run_dir (refused if it holds an earlier run's results), which
    ends as a run directory `glm5 generate / eval / rollout` and `train.init_from` read (config.yaml with the
    model, the final checkpoint); returns the summary it writes."""
    run_dir = Path(config.experiment.train.run_dir)
    check_run_dir(run_dir)
    params = starting_params(config)
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / CONFIG_FILE).write_text(yaml.safe_dump(json.loads(json.dumps(experiment_to_dict(config.experiment))),
                                                      sort_keys=False))
    rows = run_rl_async(config, params, run_dir / STEPS_FILE, log=log, checkpoint_dir=run_dir / CHECKPOINTS)
    summary = {"run_dir": str(run_dir), "steps": len(rows), **summarize(rows)}
    (run_dir / SUMMARY_FILE).write_text(json.dumps(summary, indent=1) + "\n")
    return summary
