"""What `glm5 train CONFIG [key=value ...]` runs: an experiment into its run directory.

The run directory gets the resolved config (config.yaml), metrics as JSON lines (metrics.jsonl) and TensorBoard
event files (tb/), and orbax checkpoints (checkpoints/). A run resumes from its latest checkpoint by default
(params, optimizer state, step and the data iterator's position) when the saved config agrees with the new one.
A step whose loss, gradients or optimizer state is not finite is never applied nor saved (train.non_finite: stop
or skip). One live run owns the directory (run.lock). README "When a run stops" has the whole story.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import yaml
from jax.sharding import NamedSharding, PartitionSpec

from glm5_jax.checkpoint import Checkpointer
from glm5_jax.config import ConfigError
from glm5_jax.config.experiment import ExperimentConfig
from glm5_jax.config.rl import rl_step_config_from_dict
from glm5_jax.data.chat import read_chat_jsonl, render_dataset
from glm5_jax.data.corpus import stdlib_corpus
from glm5_jax.data.pretrain import pretrain_dataset, read_jsonl
from glm5_jax.data.rollouts import (RolloutError, filter_and_pad, read_rollouts, require_kept, rollout_dataset,
                                    validate_records)
from glm5_jax.data.sft import sft_dataset
from glm5_jax.data.tokenizer import load_tokenizer
from glm5_jax.data.sharded import ShardedBatches, merge_states, owned_shards
from glm5_jax.model.flops import training_flops_per_token
from glm5_jax.distributed.mesh import make_mesh
from glm5_jax.distributed.logical_axes import logical_to_spec
from glm5_jax.distributed.runtime import (DistributedError, allgather_json, global_batch, initialize, is_primary,
                                       process_row_block)
from glm5_jax.parallel.sharding import init_opt_state_sharded, init_sharded, opt_state_shardings, param_shardings
from glm5_jax.train.optim import learning_rate_schedule, make_optimizer
from glm5_jax.train.rl_step import rl_optim_config
from glm5_jax.train.step import TrainState, make_train_step, validate_batch
from glm5_jax.train.held_out import batch_loss_fn
from glm5_jax.train.finite_guard import checked_leaf_names, describe_non_finite
from glm5_jax.train.resume import check_resume_config, default_experiment_dict, drop_metrics_after
from glm5_jax.train.run_lock import RunLock
from glm5_jax.train.tensorboard import SummaryWriter


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
    rl = rl_step_config_from_dict(cfg.rl)
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
    return {f"{section}.{key}": value for section, fields in dataclasses.asdict(cfg).items()
            if isinstance(fields, dict) for key, value in fields.items()}


def _to_host(metrics: dict) -> dict:
    out = {}
    for key, value in jax.device_get(metrics).items():
        value = np.asarray(value)
        out[key] = float(value) if value.ndim == 0 else [round(float(v), 6) for v in value.ravel()]
    return out


def _progress(step: int, total: int, metrics: dict, tokens_per_s: float, elapsed: float) -> str:
    width = 24
    done = int(width * step / total)
    eta = elapsed / max(step, 1) * (total - step)
    return (f"[{'#' * done}{'.' * (width - done)}] step {step}/{total} loss {metrics['loss']:.4f} "
            f"tok/s {tokens_per_s:,.0f} eta {eta:,.0f}s")


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


class MeshLayout:
    """The run's mesh and the shardings of its batch and state."""

    def __init__(self, cfg: ExperimentConfig):
        mesh_cfg = cfg.mesh.resolve(jax.device_count())
        self.mesh = make_mesh(mesh_cfg)
        rows = cfg.train.batch_size
        shards = mesh_cfg.data * mesh_cfg.fsdp * mesh_cfg.expert
        if (rows // cfg.train.microbatches) % shards:
            raise ConfigError(f"train.batch_size={rows} is invalid: each of the {cfg.train.microbatches} "
                              f"microbatches must split evenly over the {shards} batch shards of mesh "
                              f"{mesh_cfg.axis_sizes()}")
        # Only the leading (row) dim is named, so one sharding serves batch keys of any rank.
        self.batch = NamedSharding(self.mesh, logical_to_spec(("batch",), (rows,), self.mesh))
        self.replicated = NamedSharding(self.mesh, PartitionSpec())
        self.rows = rows
        start, stop = process_row_block(self.batch, rows)
        if stop - start != rows // jax.process_count():
            raise DistributedError(f"process {jax.process_index()} holds {stop - start} of {rows} batch rows; "
                                   "each process must hold an equal share: make the batch axes span the processes")

    def global_batch(self, local: dict) -> dict:
        return global_batch(local, self.batch, self.rows)


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
    layout = MeshLayout(cfg)
    log(f"mesh: {dict(layout.mesh.shape)} over {jax.device_count()} devices in {jax.process_count()} process(es)")
    tokenizer = build_tokenizer(cfg)
    iterator, data_stats = sharded_batches(cfg, tokenizer)
    log(f"data: {json.dumps(data_stats)}")

    params = init_sharded(cfg.model, jax.random.key(cfg.train.seed), layout.mesh)
    if cfg.train.init_from:
        params = load_params(cfg.train.init_from, params)
        log(f"initialised parameters from {cfg.train.init_from}")
    optim_config, rl_config = cfg.optim, None
    if cfg.train.mode == "rl":
        rl_config = rl_step_config_from_dict(cfg.rl)
        optim_config = rl_optim_config(cfg.optim, rl_config)  # the DSA indexer is frozen in RL by default
    optimizer = make_optimizer(optim_config, params, config=cfg.model)
    schedule = learning_rate_schedule(optim_config)
    opt_state = init_opt_state_sharded(optimizer, params, layout.mesh, config=cfg.model)
    state = TrainState(step=jax.device_put(jnp.zeros((), jnp.int32), layout.replicated), params=params,
                       opt_state=opt_state)
    state_shardings = TrainState(step=layout.replicated,
                                 params=param_shardings(params, layout.mesh, config=cfg.model),
                                 opt_state=opt_state_shardings(opt_state, layout.mesh, config=cfg.model))
    step_fn = make_train_step(cfg.model, cfg.train, optimizer, lr_schedule=schedule, rl_config=rl_config,
                              mesh=layout.mesh, state_shardings=state_shardings, batch_sharding=layout.batch)
    checked_leaves = checked_leaf_names(state.params, state.opt_state)

    checkpointer = Checkpointer(run_dir / "checkpoints", save_interval_steps=cfg.checkpoint.every,
                                max_to_keep=cfg.checkpoint.keep)
    start, config_changes = 0, []
    if cfg.checkpoint.resume and checkpointer.latest_step() is not None:
        config_changes = check_resume_config(checkpointer.saved_config(), dataclasses.asdict(cfg),
                                             step=checkpointer.latest_step(), allow_change=allow_config_change,
                                             defaults=default_experiment_dict())
        restored = checkpointer.restore(state.params, state.opt_state)
        state = state._replace(step=jax.device_put(jnp.asarray(restored.step, jnp.int32), layout.replicated),
                               params=restored.params, opt_state=restored.opt_state)
        if restored.data_state is not None:
            iterator.set_state(restored.data_state)
        start = restored.step
        log(f"resumed from step {start} in {checkpointer.directory}")
    if primary:
        # Written once the restore succeeded, so a refused resume leaves the run's config as it was.
        (run_dir / "config.yaml").write_text(yaml.safe_dump(json.loads(json.dumps(dataclasses.asdict(cfg))),
                                                             sort_keys=False))
        drop_metrics_after(run_dir / "metrics.jsonl", start)  # steps after the restored one run (and log) again

    flops_per_token = training_flops_per_token(cfg.model, cfg.train.seq_len)
    writer = SummaryWriter(run_dir / "tb", first_step=start + 1) if primary else None
    metrics_file = open(run_dir / "metrics.jsonl", "a") if primary else None
    first_loss = last = None
    t_start = time.perf_counter()
    t_window, tokens_window = t_start, 0.0
    try:
        for step in range(start + 1, cfg.train.steps + 1):
            try:
                local = next(iterator)
            except StopIteration:
                raise TrainingError(f"the dataset ran out of batches at step {step}") from None
            validate_batch(local, cfg.model, cfg.train, step_fn.required_keys)  # this process's rows, on the host
            state, metrics = step_fn.jitted(state, layout.global_batch(local))
            host = _to_host(metrics)
            if host["non_finite"]:
                message = describe_non_finite(step, host, checked_leaves, _flat_settings(cfg), state.params,
                                              checkpointer.latest_step(), config_changes)
                if cfg.train.non_finite == "stop":
                    raise TrainingError(f"{message}\n  the last good checkpoint (step "
                                        f"{checkpointer.latest_step()}) is kept")
                log(f"skipped (train.non_finite=skip): {message}")
                if metrics_file is not None:
                    metrics_file.write(json.dumps({"step": step, "skipped": True, **host}) + "\n")
                    metrics_file.flush()
                continue
            tokens_window += host["tokens"]
            first_loss = host["loss"] if first_loss is None else first_loss
            if step % cfg.train.log_every == 0 or step == cfg.train.steps:
                now = time.perf_counter()
                tokens_per_s = tokens_window / (now - t_window)
                host["tokens_per_s"] = tokens_per_s
                host["model_tflops_per_s"] = tokens_per_s * flops_per_token / 1e12
                if cfg.train.peak_flops_per_device:
                    host["mfu"] = tokens_per_s * flops_per_token / (cfg.train.peak_flops_per_device
                                                                    * jax.device_count())
                log(_progress(step, cfg.train.steps, host, tokens_per_s, now - t_start))
                t_window, tokens_window = now, 0.0
                if writer is not None:
                    writer.scalars(step, {k: v for k, v in host.items() if isinstance(v, float)})
            if metrics_file is not None:
                metrics_file.write(json.dumps({"step": step, **host}) + "\n")
                metrics_file.flush()
            last = host
            final = step == cfg.train.steps
            if final or checkpointer.should_save(step):
                # Every process's data position, gathered so that any process count can resume from it.
                data_state = merge_states(allgather_json(iterator.get_state()))
                checkpointer.save_if_finite(step, loss=host["loss"], params=state.params,
                                            opt_state=state.opt_state, data_state=data_state,
                                            config=dataclasses.asdict(cfg), force=final)
        checkpointer.wait_until_finished()
        summary = {"run_dir": str(run_dir), "steps": cfg.train.steps, "resumed_from": start,
                   "first_loss": first_loss, "final_loss": last and last["loss"],
                   "eval_loss": evaluate(cfg, state.params, tokenizer, layout) if cfg.train.mode != "rl" else None,
                   "seconds": round(time.perf_counter() - t_start, 1)}
        log("summary: " + json.dumps(summary))
        return summary
    finally:
        if writer is not None:
            writer.close()
        if metrics_file is not None:
            metrics_file.close()
        checkpointer.close()
