"""Training-step and compile time of two checkouts of the library, alternating in one process.

Issue 28 asks that its refactor keep step and compile time within 3% of the code before it, "measured
alternately in one run". On this VM two separate runs differ by 5-20%, so both libraries are imported into one
process, each `glm5_jax` (and `pallas_kernels`) kept as its own snapshot of `sys.modules` that is swapped in
while that library traces, and the measurements interleave: one step of A, one of B, then B, A (ABBA), so a
change in the machine's speed falls on both alike. Compiles interleave the same way (fresh `jax.jit` objects,
no persistent cache). Both sides build the same `small` config from the same seed and train on the same
tokens, so the script also reports whether the initial weights are bit-identical and how far the losses
drift apart.

  git worktree add /tmp/before d073238      # the checkout before the change
  PYTHONPATH=. python benchmarks/ab_libraries.py --before /tmp/before --after . [--steps 20] [--compiles 4]

Prints JSON lines: `ab_step` (each side's step times, after / before as the median of the per-round ratios
and as the ratio of medians) and one `ab_compile` per layer count (trace + lower, XLA compile, both).
"""

from __future__ import annotations

import argparse
import contextlib
import inspect
import json
import os
import statistics
import sys
import time
from pathlib import Path

import numpy as np

from benchmarks.repeats import spread_of, turn_order

PACKAGES = ("glm5_jax", "pallas_kernels")
# The `small` config of train_step_vs_hf.py, spelled out so that both libraries build it from their own
# ModelConfig (fields both have had since the NNX change).
SMALL = dict(vocab_size=8192, hidden_size=512, intermediate_size=1408, moe_intermediate_size=256, num_hidden_layers=6,
             num_attention_heads=8, n_routed_experts=32, kv_lora_rank=128, q_lora_rank=192, qk_rope_head_dim=32,
             qk_nope_head_dim=64, v_head_dim=64, index_n_heads=4, index_head_dim=64, index_topk=128,
             num_nextn_predict_layers=0, mtp_num_steps=0, first_k_dense_replace=1, n_shared_experts=1, n_group=4,
             topk_group=2, num_experts_per_tok=4, param_dtype="float32", compute_dtype="float32",
             max_position_embeddings=4096)
OPTIM = dict(name="adamw", lr=1e-3, warmup_steps=0, schedule="constant", weight_decay=0.1, grad_clip_norm=1.0)


def _ours(name: str) -> bool:
    return any(name == p or name.startswith(p + ".") for p in PACKAGES)


class Library:
    """One checkout's `glm5_jax`, imported from `root` and kept apart from any other checkout's."""

    def __init__(self, root: str, label: str):
        self.root, self.label = str(Path(root).resolve()), label
        outside = {k: sys.modules.pop(k) for k in list(sys.modules) if _ours(k)}
        sys.path.insert(0, self.root)
        try:
            from glm5_jax.config import ModelConfig, TrainConfig
            from glm5_jax.model.transformer import init
            from glm5_jax.train.optim import OptimConfig, make_optimizer
            from glm5_jax.train.step import init_train_state, make_train_step
            self.modules = {k: m for k, m in sys.modules.items() if _ours(k)}
        finally:
            sys.path.remove(self.root)
            for k in [k for k in sys.modules if _ours(k)]:
                del sys.modules[k]
            sys.modules.update(outside)
        loaded = Path(self.modules["glm5_jax"].__file__).resolve()
        if Path(self.root) not in loaded.parents:
            raise RuntimeError(f"--{label} {root}: imported glm5_jax from {loaded}, not from that checkout")
        self.ModelConfig, self.TrainConfig, self.OptimConfig = ModelConfig, TrainConfig, OptimConfig
        self.init, self.init_train_state, self.make_train_step = init, init_train_state, make_train_step
        self._make_optimizer = make_optimizer

    @contextlib.contextmanager
    def active(self):
        """This library's modules in sys.modules (a function importing lazily gets its own checkout's)."""
        outside = {k: sys.modules.pop(k) for k in list(sys.modules) if _ours(k)}
        sys.modules.update(self.modules)
        try:
            yield self
        finally:
            for k in [k for k in sys.modules if _ours(k)]:
                del sys.modules[k]
            sys.modules.update(outside)

    def make_optimizer(self, params, config):
        cfg = self.OptimConfig(**OPTIM)
        if "config" in inspect.signature(self._make_optimizer).parameters:  # added by issue 28
            return self._make_optimizer(cfg, params, config=config)
        return self._make_optimizer(cfg, params)

    def build(self, layers: int, batch: int, seq: int, abstract: bool, seed: int = 0):
        """(step, state) of the `small` config with `layers` layers; abstract shapes only if `abstract`."""
        import jax
        with self.active():
            config = self.ModelConfig(**{**SMALL, "num_hidden_layers": layers})
            make_params = lambda: self.init(config, jax.random.key(seed))  # noqa: E731
            params = jax.eval_shape(make_params) if abstract else make_params()
            optimizer = self.make_optimizer(params, config)
            state = (jax.eval_shape(lambda p: self.init_train_state(p, optimizer), params) if abstract
                     else self.init_train_state(params, optimizer))
            step = self.make_train_step(config, self.TrainConfig(batch_size=batch, seq_len=seq), optimizer)
        return step, state


def lm_batch(tokens: np.ndarray) -> dict:
    import jax.numpy as jnp
    b, s = tokens.shape
    return {"tokens": jnp.asarray(tokens), "segment_ids": jnp.ones((b, s), jnp.int32),
            "positions": jnp.broadcast_to(jnp.arange(s, dtype=jnp.int32), (b, s)),
            "loss_mask": jnp.ones((b, s), jnp.int32)}


def same_weights(a, b) -> bool:
    import jax
    la, lb = jax.tree.leaves(a), jax.tree.leaves(b)
    return len(la) == len(lb) and all(x.shape == y.shape and np.array_equal(np.asarray(x), np.asarray(y))
                                      for x, y in zip(la, lb))


def measure_steps(libraries: list, batch: int, seq: int, steps: int, warmup: int, seed: int) -> dict:
    import jax
    runs = {lib.label: lib.build(SMALL["num_hidden_layers"], batch, seq, abstract=False, seed=seed)
            for lib in libraries}
    a, b = (runs[lib.label][1].params for lib in libraries)
    identical_init = same_weights(a, b)
    rng = np.random.default_rng(seed + 1)
    tokens = [rng.integers(0, SMALL["vocab_size"], (batch, seq), dtype=np.int32) for _ in range(warmup + steps)]
    times = {lib.label: [] for lib in libraries}
    losses = {lib.label: [] for lib in libraries}
    by_label = {lib.label: lib for lib in libraries}
    for i, label in turn_order(list(by_label), warmup + steps):
        lib = by_label[label]
        step, state = runs[label]
        data = lm_batch(tokens[i])
        start = time.perf_counter()
        with lib.active():
            state, metrics = step(state, data)
        loss = float(jax.block_until_ready(metrics["loss"]))
        if i >= warmup:
            times[lib.label].append(time.perf_counter() - start)
        losses[lib.label].append(loss)
        runs[lib.label] = (step, state)
    la, lb = (np.array(losses[lib.label]) for lib in libraries)
    return {"times": times, "identical_init": identical_init,
            "max_loss_diff": float(np.max(np.abs(la - lb))), "losses": {k: v[-1] for k, v in losses.items()}}


def measure_compiles(libraries: list, layers: int, batch: int, seq: int, rounds: int) -> dict:
    """Seconds of trace + lower and of XLA compile, per library, interleaved ABBA."""
    import jax
    out = {lib.label: {"lower_s": [], "compile_s": []} for lib in libraries}
    shapes = jax.eval_shape(lambda: lm_batch(np.zeros((batch, seq), np.int32)))
    by_label = {lib.label: lib for lib in libraries}
    for _, label in turn_order(list(by_label), rounds):
        lib = by_label[label]
        step, state = lib.build(layers, batch, seq, abstract=True)
        with lib.active():
            start = time.perf_counter()
            lowered = step.jitted.lower(state, shapes)
            mid = time.perf_counter()
            lowered.compile()
            end = time.perf_counter()
        out[lib.label]["lower_s"].append(mid - start)
        out[lib.label]["compile_s"].append(end - mid)
    return out


def ratio_summary(before: list[float], after: list[float]) -> dict:
    pairs = [b / a for a, b in zip(before, after)]
    q = np.percentile(pairs, [25, 75])
    return {"median_of_pair_ratios": round(statistics.median(pairs), 4), "pair_ratio_iqr": [round(x, 4) for x in q],
            "ratio_of_medians": round(statistics.median(after) / statistics.median(before), 4), "pairs": len(pairs)}


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--before", required=True, help="checkout (directory holding glm5_jax/) of the old code")
    parser.add_argument("--after", default=".", help="checkout of the new code (default: this one)")
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--seq", type=int, default=512)
    parser.add_argument("--steps", type=int, default=20, help="timed steps per library, interleaved ABBA")
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--compiles", type=int, default=4, help="compiles per library and layer count")
    parser.add_argument("--compile-layers", type=int, nargs="*", default=[4, 32])
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    for field in ("batch", "seq", "steps", "compiles"):
        if getattr(args, field) < 1:
            parser.error(f"--{field}={getattr(args, field)} is invalid: must be >= 1")
    for field in ("before", "after"):
        if not (Path(getattr(args, field)) / "glm5_jax" / "__init__.py").is_file():
            parser.error(f"--{field}={getattr(args, field)} is invalid: no glm5_jax/__init__.py there")
    if any(n < 2 for n in args.compile_layers):
        parser.error(f"--compile-layers={args.compile_layers} is invalid: each needs >= 2 (1 dense + 1 MoE)")
    return args


def main(argv=None) -> None:
    args = parse_args(argv)
    os.environ.pop("JAX_COMPILATION_CACHE_DIR", None)  # every compile is a real one
    import jax
    jax.config.update("jax_enable_compilation_cache", False)
    libraries = [Library(args.before, "before"), Library(args.after, "after")]
    result = measure_steps(libraries, args.batch, args.seq, args.steps, args.warmup, args.seed)
    before, after = (result["times"][lib.label] for lib in libraries)
    print(json.dumps({"benchmark": "ab_step", "config": "small", "batch": args.batch, "seq": args.seq,
                      "step_s": {k: spread_of(v) for k, v in result["times"].items()},
                      "after_over_before": ratio_summary(before, after),
                      "identical_init": result["identical_init"], "max_loss_diff": result["max_loss_diff"],
                      "last_loss": result["losses"], "jax": jax.__version__}), flush=True)
    for layers in args.compile_layers:
        c = measure_compiles(libraries, layers, args.batch, args.seq, args.compiles)
        row = {"benchmark": "ab_compile", "layers": layers}
        for phase in ("lower_s", "compile_s"):
            row[phase] = {k: [round(x, 3) for x in v[phase]] for k, v in c.items()}
            row[f"{phase}_after_over_before"] = ratio_summary(c["before"][phase], c["after"][phase])
        total = {k: [lo + co for lo, co in zip(v["lower_s"], v["compile_s"])] for k, v in c.items()}
        row["total_after_over_before"] = ratio_summary(total["before"], total["after"])
        print(json.dumps(row), flush=True)


if __name__ == "__main__":
    main()
