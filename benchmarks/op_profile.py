"""Where a jitted step spends its time on CPU: the XLA operations of glm5_jax's decode step or DSA training step,
ranked by their total time, from a `jax.profiler` trace (the perfetto JSON the profiler writes).

  decode  the `small` config of decode_vs_hf.py (index_topk 256), batch 8, one `decode_step` over a cache filled
          by a --prompt-len prefill
  train   the `small` config of long_context_vs_hf.py, batch 1, --seq tokens, a `dsa_sparse` training step

Each program compiles and runs once untimed, then --reps profiled runs; one JSON line per operation (name,
milliseconds per run, calls per run) after a line with the wall time per run. Operation names are XLA's
(`ynn_fusion` = a dot run by YNNPACK, `gather_*`/`dynamic-slice_*` = copies), so read them with the HLO
(`jax.jit(...).lower(...).as_text()`) at hand.

  PYTHONPATH=. python benchmarks/op_profile.py decode [--prompt-len 1024] [--top 25]
  PYTHONPATH=. python benchmarks/op_profile.py train [--seq 2048] [--top 25]
"""

from __future__ import annotations

import argparse
import collections
import glob
import gzip
import json
import tempfile
import time

import jax
import jax.numpy as jnp
import numpy as np

BATCH = 8
# Host-side events of the trace (Python frames, dispatch, buffer handling): not XLA operations.
HOST_EVENT_MARKERS = ("$", "Pjit", "Execute", "PjRt", "Buffer", "Await", "ParseArguments", "Handle input",
                      "PythonRefManager", "Allocate")


def op_times(run, reps: int) -> tuple[float, dict[str, float], dict[str, int]]:
    """(wall seconds per run, op -> ms per run, op -> calls per run) of `reps` profiled calls of `run`."""
    with tempfile.TemporaryDirectory(prefix="op_profile_") as directory:
        start = time.perf_counter()
        with jax.profiler.trace(directory, create_perfetto_trace=True):
            for _ in range(reps):
                run()
        wall = (time.perf_counter() - start) / reps
        (path,) = glob.glob(f"{directory}/**/perfetto_trace.json.gz", recursive=True)
        with gzip.open(path) as f:
            trace = json.load(f)
    events = trace["traceEvents"] if isinstance(trace, dict) else trace
    total, calls = collections.Counter(), collections.Counter()
    for event in events:
        name = event.get("name", "")
        if event.get("ph") == "X" and not any(marker in name for marker in HOST_EVENT_MARKERS):
            total[name] += event.get("dur", 0) / 1e3 / reps
            calls[name] += 1
    return wall, dict(total), {name: count // reps for name, count in calls.items()}


def decode_runner(prompt_len: int):
    from benchmarks.decode_vs_hf import model_config
    from glm5_jax.generation.decode import decode_step, prefill
    from glm5_jax.generation.sampling import SamplingParams, split_sampling
    from glm5_jax.model.transformer import init

    max_len = prompt_len + 64
    config = model_config(max_len)
    params = init(config, jax.random.key(0))
    prompts = jnp.asarray(np.random.default_rng(0).integers(0, config.vocab_size, (BATCH, prompt_len), np.int32))
    nucleus, values = split_sampling(SamplingParams(max_new_tokens=64, temperature=0.0).validate(config.vocab_size))
    state = prefill(params, prompts, jnp.full((BATCH,), prompt_len), jax.random.key(0), values, config=config,
                    nucleus=nucleus, max_len=max_len, max_new_tokens=64, collect_routing=False,
                    return_logits=False)[0]
    box = [state]

    def run():
        box[0] = decode_step(params, box[0], values, config=config, nucleus=nucleus)
        jax.block_until_ready(box[0])

    return run


def train_runner(seq: int):
    from benchmarks.long_context_vs_hf import model_config
    from benchmarks.train_step_vs_hf import OPTIM, lm_batch
    from glm5_jax.config import TrainConfig
    from glm5_jax.model.transformer import init
    from glm5_jax.train.optim import make_optimizer
    from glm5_jax.train.step import init_train_state, make_train_step

    config = model_config(seq, 1024, "full")
    params = init(config, jax.random.key(0))
    optimizer = make_optimizer(OPTIM, params, config=config)
    step = make_train_step(config, TrainConfig(mode="dsa_sparse", batch_size=1, seq_len=seq), optimizer)
    box = [init_train_state(params, optimizer)]
    batch = lm_batch(np.random.default_rng(1).integers(0, config.vocab_size, (1, seq), dtype=np.int32))

    def run():
        box[0], metrics = step(box[0], batch)
        jax.block_until_ready(metrics)

    return run


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("program", choices=("decode", "train"))
    parser.add_argument("--prompt-len", type=int, default=1024, help="decode: tokens in the cache")
    parser.add_argument("--seq", type=int, default=2048, help="train: sequence length")
    parser.add_argument("--reps", type=int, default=3, help="profiled runs (after one untimed run)")
    parser.add_argument("--top", type=int, default=25, help="operations listed")
    args = parser.parse_args(argv)
    for name in ("prompt_len", "seq", "reps", "top"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')}={getattr(args, name)} is invalid: must be >= 1")
    if args.seq % 1024:
        parser.error(f"--seq={args.seq} is invalid: must be a multiple of 1024 (the indexer's query block)")
    return args


def main(argv=None) -> None:
    args = parse_args(argv)
    run = decode_runner(args.prompt_len) if args.program == "decode" else train_runner(args.seq)
    run()  # compile
    wall, total, calls = op_times(run, args.reps)
    print(json.dumps({"benchmark": "op_profile", "program": args.program, "wall_ms_per_run": round(1e3 * wall, 2),
                      "op_ms_per_run": round(sum(total.values()), 2)}), flush=True)
    for name, ms in sorted(total.items(), key=lambda item: -item[1])[:args.top]:
        print(json.dumps({"op": name, "ms_per_run": round(ms, 2), "calls_per_run": calls[name]}), flush=True)


if __name__ == "__main__":
    main()
