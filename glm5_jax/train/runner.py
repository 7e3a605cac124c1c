"""`glm5 train CONFIG [key=value ...]`: run an experiment into its run directory.

The run directory gets the resolved config (config.yaml), metrics as JSON lines (metrics.jsonl) and TensorBoard
event files (tb/), and orbax checkpoints (checkpoints/). A run resumes from its latest checkpoint by default
(params, optimizer state, step and the data iterator's position) when the saved config agrees with the new one.
A step whose loss, gradients or optimizer state is not finite is never applied nor saved (train.non_finite: stop
or skip). One live run owns the directory (run.lock). README "When a run stops" has the whole story.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import time
from pathlib import Path

import jax
import numpy as np
import yaml

from glm5_jax.checkpoint import Checkpointer
from glm5_jax.config import ConfigError
from glm5_jax.experiment import ExperimentConfig, load_experiment
from glm5_jax.model.flops import training_flops_per_token
from glm5_jax.model.transformer import init
from glm5_jax.train.finite_guard import checked_leaf_names, describe_non_finite
from glm5_jax.train.optim import learning_rate_schedule, make_optimizer
from glm5_jax.train.resume import check_resume_config, default_experiment_dict, drop_metrics_after
from glm5_jax.train.run_lock import RunLock, RunLockedError
from glm5_jax.train.step import init_train_state, make_train_step
from glm5_jax.train.tensorboard import SummaryWriter


class TrainingError(RuntimeError):
    """The run cannot continue (non-finite loss, data exhausted, ...)."""


def build_tokenizer(cfg: ExperimentConfig):
    from glm5_jax.data.tokenizer import load_tokenizer

    tokenizer = load_tokenizer(cfg.data.tokenizer)
    if tokenizer.vocab_size > cfg.model.vocab_size:
        raise ConfigError(f"model.vocab_size={cfg.model.vocab_size} is invalid: the tokenizer "
                          f"{cfg.data.tokenizer!r} has {tokenizer.vocab_size} ids")
    return tokenizer


def build_dataset(cfg: ExperimentConfig, tokenizer, split: str = "train", seed_offset: int = 0):
    """(grain iterable of batches, stats dict) for the configured source."""
    from glm5_jax.data.pretrain import pretrain_dataset, read_jsonl

    data, train = cfg.data, cfg.train
    seed = train.seed + seed_offset
    if data.source in ("stdlib", "jsonl"):
        if data.source == "stdlib":
            from glm5_jax.data.corpus import stdlib_corpus

            docs = stdlib_corpus(split, validation_fraction=data.validation_fraction,
                                 max_files=data.max_files or None)
        else:
            docs = read_jsonl(list(data.paths))
        dataset, stats = pretrain_dataset(docs, tokenizer, seq_len=train.seq_len, batch_size=train.batch_size,
                                          seed=seed, shuffle=data.shuffle, vocab_size=cfg.model.vocab_size)
        return dataset, stats.as_dict()
    if data.source == "chat_jsonl":
        from glm5_jax.data.chat import read_chat_jsonl, render_dataset
        from glm5_jax.data.sft import sft_dataset

        records = [r for path in data.paths for r in read_chat_jsonl(path, location_ids=True)]
        rendered = render_dataset(records, tokenizer, max_length=train.seq_len, clear_thinking=data.clear_thinking)
        rendered.require_examples(", ".join(data.paths))
        stats = {"records": len(records), "kept": len(rendered.examples), "dropped": rendered.drop_counts}
        return sft_dataset(rendered.examples, seq_len=train.seq_len, batch_size=train.batch_size, seed=seed,
                           shuffle=data.shuffle), stats
    if data.source == "rollouts":
        return rollout_batches(cfg, seed)
    raise ConfigError(f"data.source={data.source!r} is invalid for `glm5 train` in mode {train.mode!r}")


def rollout_batches(cfg: ExperimentConfig, seed: int):
    """RL batches from stored rollout records: validated (errors name the rollout), filtered (stale, failed,
    broken groups; every drop counted), advantages over whole groups, then fixed-shape batches."""
    from glm5_jax.data.rollouts import (RolloutError, filter_and_pad, read_rollouts, require_kept, rollout_dataset,
                                        validate_records)
    from glm5_jax.train.rl_step import rl_step_config_from_dict

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


def evaluate(cfg: ExperimentConfig, params, tokenizer) -> float | None:
    """Mean next-token loss on the validation split (stdlib corpus only), with the model's configured
    attention (so a DSA run is evaluated with its top-k selection)."""
    if cfg.data.source != "stdlib" or cfg.data.validation_fraction == 0:
        return None
    from glm5_jax.train import losses
    from glm5_jax.model.transformer import forward

    dataset, _ = build_dataset(cfg, tokenizer, split="validation", seed_offset=1)

    @jax.jit
    def batch_loss(p, b):
        out = forward(p, b["tokens"], config=cfg.model, positions=b["positions"], segment_ids=b["segment_ids"],
                      return_logits=False, mtp_steps=0)
        return losses.cross_entropy(out.hidden, p["lm_head"]["kernel"], b["tokens"], b["segment_ids"],
                                    b["loss_mask"], cfg.train.vocab_chunk)

    total, count = 0.0, 0.0
    for index, batch in enumerate(dataset):
        if index >= cfg.train.eval_batches:
            break
        s, c = batch_loss(params, batch)
        total, count = total + float(s), count + float(c)
    return total / max(count, 1.0)


def load_params(run_dir: str | Path, like):
    """The latest parameters saved under another run's directory (shapes checked against `like`)."""
    with Checkpointer(Path(run_dir) / "checkpoints", read_only=True) as source:  # it may be training now
        return source.restore(like).params


def run(cfg: ExperimentConfig, *, log=print, allow_config_change: bool = False) -> dict:
    """Train `cfg.train.steps` steps (resuming when a checkpoint exists); returns the final summary.
    The run directory is locked for the whole run (glm5_jax/train/run_lock.py)."""
    with RunLock(cfg.train.run_dir, log=log):
        return _run_locked(cfg, log=log, allow_config_change=allow_config_change)


def _run_locked(cfg: ExperimentConfig, *, log, allow_config_change: bool) -> dict:
    run_dir = Path(cfg.train.run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    tokenizer = build_tokenizer(cfg)
    dataset, data_stats = build_dataset(cfg, tokenizer)
    log(f"data: {json.dumps(data_stats)}")

    params = init(cfg.model, jax.random.key(cfg.train.seed))
    if cfg.train.init_from:
        params = load_params(cfg.train.init_from, params)
        log(f"initialised parameters from {cfg.train.init_from}")
    optim_config, rl_config = cfg.optim, None
    if cfg.train.mode == "rl":
        from glm5_jax.train.rl_step import rl_optim_config, rl_step_config_from_dict

        rl_config = rl_step_config_from_dict(cfg.rl)
        optim_config = rl_optim_config(cfg.optim, rl_config)  # the DSA indexer is frozen in RL by default
    optimizer = make_optimizer(optim_config, params)
    schedule = learning_rate_schedule(optim_config)
    state = init_train_state(params, optimizer)
    checked_leaves = checked_leaf_names(state.params, state.opt_state)
    step_fn = make_train_step(cfg.model, cfg.train, optimizer, lr_schedule=schedule, rl_config=rl_config)
    iterator = iter(dataset)

    checkpointer = Checkpointer(run_dir / "checkpoints", save_interval_steps=cfg.checkpoint.every,
                                max_to_keep=cfg.checkpoint.keep)
    start, config_changes = 0, []
    if cfg.checkpoint.resume and checkpointer.latest_step() is not None:
        config_changes = check_resume_config(checkpointer.saved_config(), dataclasses.asdict(cfg),
                                             step=checkpointer.latest_step(), allow_change=allow_config_change,
                                             defaults=default_experiment_dict())
        restored = checkpointer.restore(state.params, state.opt_state)
        state = state._replace(step=jax.numpy.asarray(restored.step, jax.numpy.int32), params=restored.params,
                               opt_state=restored.opt_state)
        if restored.data_state is not None:
            iterator.set_state(restored.data_state)
        start = restored.step
        log(f"resumed from step {start} in {checkpointer.directory}")
    # Written once the restore succeeded, so a refused resume leaves the run's config as it was.
    (run_dir / "config.yaml").write_text(yaml.safe_dump(json.loads(json.dumps(dataclasses.asdict(cfg))),
                                                         sort_keys=False))
    drop_metrics_after(run_dir / "metrics.jsonl", start)  # steps after the restored one run (and log) again

    flops_per_token = training_flops_per_token(cfg.model, cfg.train.seq_len)
    writer = SummaryWriter(run_dir / "tb")
    metrics_file = open(run_dir / "metrics.jsonl", "a")
    first_loss = last = None
    t_start = time.perf_counter()
    t_window, tokens_window = t_start, 0.0
    try:
        for step in range(start + 1, cfg.train.steps + 1):
            try:
                batch = next(iterator)
            except StopIteration:
                raise TrainingError(f"the dataset ran out of batches at step {step}") from None
            state, metrics = step_fn(state, batch)
            host = _to_host(metrics)
            if host["non_finite"]:
                message = describe_non_finite(step, host, checked_leaves, _flat_settings(cfg), state.params,
                                              checkpointer.latest_step(), config_changes)
                if cfg.train.non_finite == "stop":
                    raise TrainingError(f"{message}\n  the last good checkpoint (step "
                                        f"{checkpointer.latest_step()}) is kept")
                log(f"skipped (train.non_finite=skip): {message}")
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
                writer.scalars(step, {k: v for k, v in host.items() if isinstance(v, float)})
            metrics_file.write(json.dumps({"step": step, **host}) + "\n")
            metrics_file.flush()
            last = host
            checkpointer.save_if_finite(step, loss=host["loss"], params=state.params, opt_state=state.opt_state,
                                        data_state=iterator.get_state(), config=dataclasses.asdict(cfg),
                                        force=step == cfg.train.steps)
        checkpointer.wait_until_finished()
        summary = {"run_dir": str(run_dir), "steps": cfg.train.steps, "resumed_from": start,
                   "first_loss": first_loss, "final_loss": last and last["loss"],
                   "eval_loss": evaluate(cfg, state.params, tokenizer) if cfg.train.mode != "rl" else None,
                   "seconds": round(time.perf_counter() - t_start, 1)}
        log("summary: " + json.dumps(summary))
        return summary
    finally:
        writer.close()
        metrics_file.close()
        checkpointer.close()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="glm5 train", description="Run an experiment from a config file.")
    parser.add_argument("config", help="experiment YAML (sections model/optim/train/data/checkpoint)")
    parser.add_argument("overrides", nargs="*", help="section.key=value, e.g. train.steps=20")
    parser.add_argument("--allow-config-change", action="store_true",
                        help="resume although the config differs from the checkpoint's (beyond steps, logging, "
                             "checkpoint cadence)")
    args = parser.parse_args(argv)
    try:
        cfg = load_experiment(args.config, args.overrides)
        run(cfg, allow_config_change=args.allow_config_change)
    except (ConfigError, TrainingError, RunLockedError, ValueError) as err:
        print(f"glm5 train: {err}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
