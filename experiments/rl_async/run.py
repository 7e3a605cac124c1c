"""Run the asynchronous RL experiment: one SFT, then every variant of config.yaml from the SFT weights.

    python experiments/rl_async/run.py [--config experiments/rl_async/config.yaml] [--out DIR] [section.key=value ...]

Writes DIR/<variant>.jsonl (one JSON line per trainer step) and DIR/summary.json. async.seed=<n> sets every
random draw of the run: the initial weights, the SFT batches, the worker's prompts and sampling keys, and the
held-out prompts (run.sh runs one seed per DIR=results/seed_<n>/).
"""

from __future__ import annotations

import argparse
import copy
import json
import sys
import time
from pathlib import Path

import jax
import numpy as np

from experiments.rl_async.sort_task import SortTask, sft
from glm5_jax.config import ModelConfig, TrainConfig, _deep_update, apply_overrides, from_dict, load_yaml
from glm5_jax.config.async_rl import AsyncRLConfig
from glm5_jax.config.optim import OptimConfig
from glm5_jax.config.rl import rl_step_config_from_dict
from glm5_jax.model.transformer import init
from glm5_jax.rollout.async_rl import greedy_accuracy, run_async_rl

HERE = Path(__file__).resolve().parent


def _sections(data: dict):
    model = from_dict(ModelConfig, data["model"], prefix="model.").validate()
    task = from_dict(SortTask, data.get("task", {}), prefix="task.").validate(model.vocab_size)
    return (model, task, from_dict(OptimConfig, data["optim"], prefix="optim."),
            from_dict(TrainConfig, data["train"], prefix="train.").validate(),
            rl_step_config_from_dict(data["rl"]), from_dict(AsyncRLConfig, data["async"], prefix="async.").validate())


def _summary(rows: list[dict], window: int = 10) -> dict:
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


def initial_params(model: ModelConfig, config: AsyncRLConfig):
    """The weights SFT starts from: drawn from async.seed."""
    return init(model, jax.random.key(config.seed))


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", default=str(HERE / "config.yaml"))
    parser.add_argument("--only", default="", help="comma-separated variant names (default: all)")
    parser.add_argument("--out", default=str(HERE / "results" / "seed_0"))
    parser.add_argument("overrides", nargs="*")
    args = parser.parse_args(argv)
    base = apply_overrides(load_yaml(args.config), args.overrides)
    variants = base.pop("variants", {"default": {}})
    if args.only:
        variants = {name: variants[name] for name in args.only.split(",")}
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)

    model, task, _, _, _, async_config = _sections(base)
    start = time.perf_counter()
    params = initial_params(model, async_config)
    params, sft_loss = sft(params, model, task, async_config)
    eval_prompts = task.prompts(np.random.default_rng(async_config.seed + 3), async_config.eval_prompts)
    summary = {"sft": {"steps": async_config.sft_steps, "final_loss": sft_loss,
                       "greedy_accuracy": greedy_accuracy(params, model, task, eval_prompts),
                       "wall_s": round(time.perf_counter() - start, 2)}}
    print(json.dumps({"sft": summary["sft"]}), flush=True)
    for name, changes in variants.items():
        data = copy.deepcopy(base)
        _deep_update(data, changes)
        model, task, optim, train, rl, async_config = _sections(data)
        path = out / f"{name}.jsonl"
        with path.open("w") as sink:
            def log(row, sink=sink):
                sink.write(json.dumps(row) + "\n")
                sink.flush()
                print(json.dumps({"variant": name, **row}), flush=True)

            rows = run_async_rl(params, model, train, optim, rl, async_config, task, log=log)
        summary[name] = _summary(rows)
    summary["total_wall_s"] = round(time.perf_counter() - start, 2)
    (out / "summary.json").write_text(json.dumps(summary, indent=1) + "\n")
    print(json.dumps(summary), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
