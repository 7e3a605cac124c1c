"""Model FLOPs utilisation of the training step, against this machine's measured matmul peak, plus compile time.

Model FLOPs per token come from `glm5_jax.model.flops.training_flops_per_token` (matrix multiplies only,
2 FLOPs per multiply-add; the formula is documented there: MLA projections, the indexer scoring every
causal key, attention over the selected top-k, active MoE experts + shared expert + router, MTP per depth,
LM head; training = 3 x forward). MFU = FLOPs/token * tokens/s / peak, where the peak is the best of
`--peak-repeats` runs of a large fp32 `jnp.dot` measured in the same process (so background load on the
machine lowers both alike).

Compile time: the training step is lowered and compiled for the same config with 4 and with 32 layers
(the layer stacks run under `lax.scan`, so the two should be close; the issue's target is within 1.5x).

  PYTHONPATH=. python benchmarks/mfu.py [--config small] [--steps 5] [--compile-layers 4 32]
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import time

import jax
import jax.numpy as jnp

from benchmarks.peak import matmul_peak_flops
from benchmarks.train_step_vs_hf import CONFIGS, OPTIM, lm_batch, token_batches, train_config_for
from glm5_jax.model import flops
from glm5_jax.model.transformer import init
from glm5_jax.train.optim import make_optimizer
from glm5_jax.train.step import init_train_state, make_train_step


def step_tokens_per_s(config, batch: int, seq: int, steps: int, warmup: int, seed: int) -> float:
    params = init(config, jax.random.key(seed))
    optimizer = make_optimizer(OPTIM, params, config=config)
    step = make_train_step(config, train_config_for(batch, seq), optimizer)
    state = init_train_state(params, optimizer)
    times = []
    for i, tokens in enumerate(token_batches(config, batch, seq, warmup + steps, seed + 1)):
        start = time.perf_counter()
        state, metrics = step(state, lm_batch(tokens))
        jax.block_until_ready(metrics["loss"])
        if i >= warmup:
            times.append(time.perf_counter() - start)
    return batch * seq / statistics.median(times)


def compile_seconds(config, batch: int, seq: int) -> float:
    """Lower + compile the training step from abstract shapes (nothing is allocated or run)."""
    params = jax.eval_shape(lambda: init(config, jax.random.key(0)))
    optimizer = make_optimizer(OPTIM, params, config=config)
    state = jax.eval_shape(lambda p: init_train_state(p, optimizer), params)
    step = make_train_step(config, train_config_for(batch, seq), optimizer)
    batch_shapes = jax.eval_shape(lambda: lm_batch(jnp.zeros((batch, seq), jnp.int32)))
    start = time.perf_counter()
    step.jitted.lower(state, batch_shapes).compile()
    return time.perf_counter() - start


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--config", default="small", choices=list(CONFIGS))
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--seq", type=int, default=512)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--peak-size", type=int, default=2048, help="matrix size of the peak matmul")
    parser.add_argument("--peak-repeats", type=int, default=10)
    parser.add_argument("--compile-layers", type=int, nargs="*", default=[4, 32])
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    for field in ("batch", "seq", "steps", "peak_size", "peak_repeats"):
        if getattr(args, field) < 1:
            parser.error(f"--{field.replace('_', '-')}={getattr(args, field)} is invalid: must be >= 1")
    if any(n < 2 for n in args.compile_layers):
        parser.error(f"--compile-layers={args.compile_layers} is invalid: each needs >= 2 (1 dense + 1 MoE)")
    return args


def main(argv=None) -> None:
    args = parse_args(argv)
    config = CONFIGS[args.config]
    peak_before = matmul_peak_flops(args.peak_size, args.peak_repeats)
    tokens_per_s = step_tokens_per_s(config, args.batch, args.seq, args.steps, args.warmup, args.seed)
    peak = max(peak_before, matmul_peak_flops(args.peak_size, args.peak_repeats))
    per_token = flops.training_flops_per_token(config, args.seq)
    achieved = per_token * tokens_per_s
    print(json.dumps({
        "benchmark": "mfu", "config": args.config, "batch": args.batch, "seq": args.seq,
        "train_flops_per_token": per_token, "tokens_per_s": round(tokens_per_s, 1),
        "achieved_gflops": round(achieved / 1e9, 2), "peak_matmul_gflops": round(peak / 1e9, 2),
        "mfu": round(achieved / peak, 4), "jax": jax.__version__, "backend": jax.default_backend(),
    }), flush=True)
    compiles = {n: compile_seconds(dataclasses.replace(config, num_hidden_layers=n), args.batch, args.seq)
                for n in args.compile_layers}
    row = {"benchmark": "compile_time", "config": args.config,
           **{f"compile_s_{n}_layers": round(t, 2) for n, t in compiles.items()}}
    if len(compiles) >= 2:
        (lo, t_lo), (hi, t_hi) = min(compiles.items()), max(compiles.items())
        row[f"ratio_{hi}_over_{lo}"] = round(t_hi / t_lo, 3)
    print(json.dumps(row), flush=True)


if __name__ == "__main__":
    main()
