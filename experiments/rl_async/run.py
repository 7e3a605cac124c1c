"""Run the asynchronous RL experiment: one SFT, then every variant of config.yaml from the SFT weights, each
through the library function `glm5 rl-async` runs (glm5_jax.commands.rl_async.run_rl_async).

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

from experiments.rl_async.sort_task import sft
from glm5_jax.commands.rl_async import rl_async_from_dict, run_rl_async, summarize
from glm5_jax.config import ModelConfig, _deep_update, apply_overrides, load_yaml
from glm5_jax.config.async_rl import AsyncRLConfig
from glm5_jax.model.transformer import init
from glm5_jax.rollout.async_rl import greedy_accuracy

HERE = Path(__file__).resolve().parent


def _sections(data: dict):
    """(model, task, optim, train, rl, async) of the config `data` (its variants: section, this experiment's
    own, left aside), parsed and checked as `glm5 rl-async` does."""
    config = rl_async_from_dict({name: section for name, section in data.items() if name != "variants"})
    experiment = config.experiment
    return (experiment.model, config.task, experiment.optim, experiment.train, experiment.rl,
            config.async_config)


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
        rows = run_rl_async(rl_async_from_dict(data), params, out / f"{name}.jsonl",
                            log=lambda row, name=name: print(json.dumps({"variant": name, **row}), flush=True))
        summary[name] = summarize(rows)
    summary["total_wall_s"] = round(time.perf_counter() - start, 2)
    (out / "summary.json").write_text(json.dumps(summary, indent=1) + "\n")
    print(json.dumps(summary), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
