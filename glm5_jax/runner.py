"""What `glm5 train CONFIG [key=value ...]` runs: an experiment into its run directory.

The run directory gets the resolved config (config.yaml), metrics as JSON lines (metrics.jsonl) and TensorBoard
event files (tb/), and orbax checkpoints (checkpoints/). A run resumes from its latest checkpoint by default
(params, optimizer state, step and the data iterator's position) when the saved config agrees with the new one.
A step whose loss, gradients or optimizer state is not finite is never applied nor saved (train.non_finite: stop
or skip). One live run owns the directory (run.lock). README "When a run stops" has the whole story.
"""

from __future__ import annotations

import contextlib
import json
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import yaml

from glm5_jax.checkpoint import Checkpointer
from glm5_jax.config import ConfigError
from glm5_jax.config.experiment import ExperimentConfig, experiment_to_dict
from glm5_jax.data.chat import read_chat_jsonl, render_dataset
from glm5_jax.data.corpus import stdlib_corpus
from glm5_jax.data.pretrain import pretrain_dataset, read_jsonl
from glm5_jax.data.rollouts import (RolloutError, filter_and_pad, read_rollouts, require_kept, rollout_dataset,
                                    validate_records)
from glm5_jax.data.sft import sft_dataset
from glm5_jax.data.tokenizer import load_tokenizer
from glm5_jax.data.sharded import ShardedBatches, merge_states, owned_shards
from glm5_jax.model.flops import training_flops_per_token
from glm5_jax.distributed.runtime import allgather_json, initialize, is_primary
from glm5_jax.parallel.trainer import MeshLayout, Trainer, build_trainer
from glm5_jax.train.step import TrainState, validate_batch
from glm5_jax.train.held_out import batch_loss_fn
from glm5_jax.train.finite_guard import checked_leaf_names, describe_non_finite
from glm5_jax.train.metrics_log import MetricsLog, metrics_to_host
from glm5_jax.train.resume import check_resume_config, default_experiment_dict, drop_metrics_after
from glm5_jax.train.run_lock import RunLock


class TrainingError(RuntimeError):
    """The run cannot continue (non-finite loss, data exhausted, ...)."""


def build_tokenizer(cfg: ExperimentConfig):
    tokenizer = load_tokenizer(cfg.data.tokenizer)
    if tokenizer.vocab_size > cfg.model.vocab_size:
        raise ConfigError(f"model.vocab_size={cfg.model.vocab_size} is invalid: the tokenizer "
                          f"{cfg.data.tokenizer!r} has {tokenizer.vocab_size} ids")
    return tokenizer


def build_dataset(cfg: ExperimentConfig, tokenizer, split: str = "train", seed_offset: int = 0, *,
                  shard: int = 0, num_shards: int = 1):
    """(grain iterable of batches, stats dict) for the configured source: data shard `shard` of `num_shards`
    (every num_shards-th document, its own seed, batch_size / num_shards rows per batch)."""
    data, train = cfg.data, cfg.train
    seed = train.seed + seed_offset + 7919 * shard
    batch_size = train.batch_size // num_shards
    if data.source in ("stdlib", "jsonl"):
        if data.source == "stdlib":
            docs = stdlib_corpus(split, validation_fraction=data.validation_fraction,
                                 max_files=data.max_files or None)
        else:
            docs = read_jsonl(list(data.paths))
        docs = docs[shard::num_shards]
        dataset, stats = pretrain_dataset(docs, tokenizer, seq_len=train.seq_len, batch_size=batch_size,
                                          seed=seed, shuffle=data.shuffle, vocab_size=cfg.model.vocab_size)
        return dataset, stats.as_dict()
    if data.source == "chat_jsonl":
        records = [r for path in data.paths for r in read_chat_jsonl(path, location_ids=True)][shard::num_shards]
        rendered = render_dataset(records, tokenizer, max_length=train.seq_len, clear_thinking=data.clear_thinking)
        rendered.require_examples(", ".join(data.paths))
        stats = {"records": len(records), "kept": len(rendered.examples), "dropped": rendered.drop_counts}
        return sft_dataset(rendered.examples, seq_len=train.seq_len, batch_size=batch_size, seed=seed,
                           shuffle=data.shuffle), stats
    if data.source == "rollouts":
        if num_shards != 1:
            raise ConfigError(f"data.shards={num_shards} is invalid for data.source='rollouts': rollout groups "
                              "are read whole by one stream (use data.shards=1 on one process)")
        return rollout_batches(cfg, seed)
    raise ConfigError(f"data.source={data.source!r} is invalid for `glm5 train` in mode {train.mode!r}")


def rollout_batches(cfg: ExperimentConfig, seed: int):
    """RL batches from stored rollout records: validated (errors name the rollout), filtered (stale, failed,
    broken groups; every drop counted), advantages over whole groups, then fixed-shape batches."""
    if cfg.train.mode != "rl":
        raise ConfigError(f"data.source='rollouts' is invalid for train.mode={cfg.train.mode!r}: use mode rl")
    rl = cfg.rl
    records = [r for path in cfg.data.paths for r in read_rollouts(path)]
    if not records:
        raise RolloutError(f"data.paths={list(cfg.data.paths)} hold no rollout records")
    validate_records(records, vocab_size=cfg.model.vocab_size)
    current = max(max(r.weight_versions) for r in records)
    kept, counts = filter_and_pad(records, current_version=current, max_staleness=rl.objective.max_staleness)
    require_kept(kept, counts, ", ".join(cfg.data.paths))
    dataset = rollout_dataset(kept, batch_size=cfg.train.batch_size, seq_len=cfg.train.seq_len,
                              config=rl.objective)
    if cfg.data.shuffle:
        dataset = dataset.shuffle(seed=seed)
    return dataset.repeat(None).to_iter_dataset(), {"records": len(records), "kept": len(kept), **counts}


def _flat_settings(cfg: ExperimentConfig) -> dict:
    return {f"{section}.{key}": value for section, fields in experiment_to_dict(cfg).items()
            if isinstance(fields, dict) for key, value in fields.items()}


def data_layout(cfg: ExperimentConfig) -> tuple[int, range]:
    """(number of data shards, the shards this process reads)."""
    num_shards = cfg.data.shards or jax.process_count()
    if cfg.train.batch_size % num_shards:
        raise ConfigError(f"data.shards={num_shards} is invalid: must divide train.batch_size={cfg.train.batch_size}")
    return num_shards, owned_shards(num_shards, jax.process_index(), jax.process_count())


def sharded_batches(cfg: ExperimentConfig, tokenizer, split: str = "train", seed_offset: int = 0):
    """This process's rows of every global batch, and the data statistics of its shards (summed)."""
    num_shards, shards = data_layout(cfg)
    stats: dict = {}

    def stream(shard):
        dataset, shard_stats = build_dataset(cfg, tokenizer, split, seed_offset, shard=shard, num_shards=num_shards)
        for key, value in shard_stats.items():
            stats[key] = stats.get(key, 0) + value if isinstance(value, (int, float)) else value
        return dataset

    return ShardedBatches(stream, shards), stats


def evaluate(cfg: ExperimentConfig, params, tokenizer, layout: MeshLayout) -> float | None:
    """Mean next-token loss on the validation split (stdlib corpus only), with the model's configured
    attention (so a DSA run is evaluated with its top-k selection)."""
    if cfg.data.source != "stdlib" or cfg.data.validation_fraction == 0:
        return None
    batches, _ = sharded_batches(cfg, tokenizer, split="validation", seed_offset=1)
    batch_loss = batch_loss_fn(cfg.model, cfg.train.vocab_chunk, layout.mesh, layout.replicated)
    total, count = 0.0, 0.0
    for index, batch in enumerate(batches):
        if index >= cfg.train.eval_batches:
            break
        s, c = np.asarray(batch_loss(params, layout.global_batch(batch)))
        total, count = total + float(s), count + float(c)
    return total / max(count, 1.0)


def load_params(run_dir: str | Path, like):
    """The latest parameters saved under another run's directory (shapes checked against `like`, restored
    into `like`'s shardings)."""
    with Checkpointer(Path(run_dir) / "checkpoints", read_only=True) as source:  # it may be training now
        return source.restore(like).params


def run(cfg: ExperimentConfig, *, log=print, allow_config_change: bool = False) -> dict:
    """Train `cfg.train.steps` steps (resuming when a checkpoint exists); returns the final summary.
    Every process of a multi-process job runs this; only process 0 logs, writes metrics and holds the run
    directory's lock (glm5_jax/train/run_lock.py) for the whole run."""
    initialize(cfg.distributed)
    primary = is_primary()
    if not primary:
        log = lambda *args, **kwargs: None  # noqa: E731
    with RunLock(cfg.train.run_dir, log=log) if primary else contextlib.nullcontext():
        return _run_locked(cfg, log=log, allow_config_change=allow_config_change, primary=primary)


def _run_locked(cfg: ExperimentConfig, *, log, allow_config_change: bool, primary: bool) -> dict:
    run_dir = Path(cfg.train.run_dir)
    if primary:
        run_dir.mkdir(parents=True, exist_ok=True)
    trainer = build_trainer(cfg)
    trainer.layout.require_equal_process_rows()
    log(f"mesh: {dict(trainer.mesh.shape)} over {jax.device_count()} devices in {jax.process_count()} process(es)")
    tokenizer = build_tokenizer(cfg)
    batches, data_stats = sharded_batches(cfg, tokenizer)
    log(f"data: {json.dumps(data_stats)}")
    with Checkpointer(run_dir / "checkpoints", save_interval_steps=cfg.checkpoint.every,
                      max_to_keep=cfg.checkpoint.keep) as checkpointer:
        resumed = _resume(cfg, trainer, batches, checkpointer, allow_config_change, log)
        state, start, config_changes = resumed or (_initial_state(cfg, trainer, log), 0, [])
        if primary:
            _write_run_config(run_dir, cfg, start)
        with MetricsLog(run_dir, cfg.train, first_step=start + 1, primary=primary, log=log,
                        flops_per_token=training_flops_per_token(cfg.model, cfg.train.seq_len)) as metrics_log:
            for step in range(start + 1, cfg.train.steps + 1):
                state, host = _train_step(cfg, trainer, state, batches, step)
                if host["non_finite"]:
                    _refuse_non_finite(cfg, step, host, state, checkpointer, config_changes, log)
                    metrics_log.skipped(step, host)
                    continue
                metrics_log.record(step, host)
                _save_if_due(cfg, step, state, host, batches, checkpointer)
            checkpointer.wait_until_finished()
            last = metrics_log.last
            eval_loss = None if cfg.train.mode == "rl" else evaluate(cfg, state.params, tokenizer, trainer.layout)
            summary = {"run_dir": str(run_dir), "steps": cfg.train.steps, "resumed_from": start,
                       "first_loss": metrics_log.first_loss, "final_loss": last and last["loss"],
                       "eval_loss": eval_loss, "seconds": round(metrics_log.seconds(), 1)}
    log("summary: " + json.dumps(summary))
    return summary


def _initial_state(cfg: ExperimentConfig, trainer: Trainer, log) -> TrainState:
    """Step 0: fresh parameters, or those of `train.init_from`'s latest checkpoint; a fresh optimizer."""
    params = trainer.init_params(jax.random.key(cfg.train.seed))
    if cfg.train.init_from:
        params = load_params(cfg.train.init_from, params)
        log(f"initialised parameters from {cfg.train.init_from}")
    return trainer.init_state(params)


def _resume(cfg: ExperimentConfig, trainer: Trainer, batches, checkpointer: Checkpointer,
            allow_config_change: bool, log) -> tuple[TrainState, int, list[str]] | None:
    """(state, its step, the config changes since the checkpoint) from the run's latest checkpoint if the config
    agrees with the saved one, None when there is none to resume; the data iterator is moved to the saved
    position. The checkpoint is read straight into the state's shardings: no parameters or optimizer state are
    initialised (compiled, allocated) only to be overwritten."""
    latest = checkpointer.latest_step()
    if not cfg.checkpoint.resume or latest is None:
        return None
    changes = check_resume_config(checkpointer.saved_config(), experiment_to_dict(cfg), step=latest,
                                  allow_change=allow_config_change, defaults=default_experiment_dict())
    target = trainer.abstract_state()
    restored = checkpointer.restore(target.params, target.opt_state)
    state = TrainState(step=jax.device_put(jnp.asarray(restored.step, jnp.int32), trainer.layout.replicated),
                       params=restored.params, opt_state=restored.opt_state)
    if restored.data_state is not None:
        batches.set_state(restored.data_state)
    log(f"resumed from step {restored.step} in {checkpointer.directory}")
    return state, restored.step, changes


def _write_run_config(run_dir: Path, cfg: ExperimentConfig, start: int) -> None:
    """Written once the restore succeeded, so a refused resume leaves the run's config as it was."""
    (run_dir / "config.yaml").write_text(yaml.safe_dump(json.loads(json.dumps(experiment_to_dict(cfg))),
                                                         sort_keys=False))
    drop_metrics_after(run_dir / "metrics.jsonl", start)  # steps after the restored one run (and log) again


def _train_step(cfg: ExperimentConfig, trainer: Trainer, state: TrainState, batches, step: int):
    """(new state, its metrics on the host) from the next batch; this process validates its own rows."""
    try:
        local = next(batches)
    except StopIteration:
        raise TrainingError(f"the dataset ran out of batches at step {step}") from None
    validate_batch(local, cfg.model, cfg.train, trainer.step.required_keys)
    state, metrics = trainer.step.jitted(state, trainer.layout.global_batch(local))
    return state, metrics_to_host(metrics)


def _refuse_non_finite(cfg: ExperimentConfig, step: int, host: dict, state: TrainState, checkpointer: Checkpointer,
                       config_changes: list[str], log) -> None:
    """The step was not applied: stop naming the first non-finite leaf, or (train.non_finite=skip) say so. A state
    the update itself made non-finite (`non_finite_state`) cannot be skipped: the old one is gone, so stop."""
    message = describe_non_finite(step, host, checked_leaf_names(state.params, state.opt_state),
                                  _flat_settings(cfg), state.params, checkpointer.latest_step(), config_changes)
    if cfg.train.non_finite == "stop" or host.get("non_finite_state"):
        raise TrainingError(f"{message}\n  the last good checkpoint (step {checkpointer.latest_step()}) is kept")
    log(f"skipped (train.non_finite=skip): {message}")


def _save_if_due(cfg: ExperimentConfig, step: int, state: TrainState, host: dict, batches,
                 checkpointer: Checkpointer) -> None:
    final = step == cfg.train.steps
    if final or checkpointer.should_save(step):
        # Every process's data position, gathered so that any process count can resume from it.
        data_state = merge_states(allgather_json(batches.get_state()))
        checkpointer.save_if_finite(step, loss=host["loss"], params=state.params, opt_state=state.opt_state,
                                    data_state=data_state, config=experiment_to_dict(cfg), force=final)
