"""Training-step and forward throughput of glm5_jax against Hugging Face `GlmMoeDsaForCausalLM`, side by side.

Both frameworks get the same weights (glm5_jax's init, exported through `glm5_jax.convert.hf`) and the same
token batches, fp32, MTP off (HF has none). Measured in one process pinned to --threads CPUs (benchmarks/
cpu_limit.py: XLA's thread pools follow the CPU affinity; torch gets that many threads), after the same warm-up
for every side, as the median of `--steps` timed steps per side, with the min and max beside it. The sides take
turns step by step, in ABBA order (glm5_jax, HF variants, then backwards), so drifting load falls on all alike.
Each --hf-variants entry (benchmarks/hf_variants.py: `eager`, HF's default, and `sdpa`, torch's fused attention;
with `_checkpointed`, HF's gradient checkpointing in the train phase) is its own model, measured in its own
pairing against fresh glm5_jax runners with no other HF model alive, one JSON line per pairing and phase:
  train    glm5_jax: the jitted `make_train_step` (AdamW, clip 1.0, bias update, metrics; the config's
           remat policy, `none`);
           HF: model.train(), loss.backward(), clip_grad_norm_(1.0), torch.optim.AdamW.step()
  forward  the mean next-token loss without gradients (glm5_jax: jitted forward + chunked cross-entropy;
           HF: model.eval(), torch.no_grad() forward with labels)
Each line has both sides' tokens/s and `ratio` = glm5_jax / that HF variant; the
first-step losses are printed too, as a check that the models really hold the same weights. Each line also carries
both sides' model FLOP/s (analytic FLOPs per token from `glm5_jax.model.flops`, the same count for both)
against the fp32 matmul peak of jax and of torch measured in the same run, and `ratio_ceiling`: the ratio
glm5_jax would reach at 100% of the jax peak, i.e. the most any implementation could gain on this machine
over the reference at its measured speed.

  PYTHONPATH=. python benchmarks/train_step_vs_hf.py [--configs tiny small] [--steps 5] [--threads 2] \
      [--hf-variants eager sdpa]
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import json
import os
import time

import jax
import jax.numpy as jnp
import numpy as np

from benchmarks.cpu_limit import limit_cpus
from benchmarks.peak import matmul_peak_flops, torch_matmul_peak_flops
from benchmarks.repeats import spread_of
from glm5_jax.config import ModelConfig, TrainConfig
from glm5_jax.model import flops
from glm5_jax.model.transformer import forward, init
from glm5_jax.train import losses
from glm5_jax.train.optim import OptimConfig, make_optimizer
from glm5_jax.train.step import init_train_state, make_train_step

# Shared by both configs: fp32, no MTP, GLM-5 routing constants, one shared expert.
_COMMON = dict(num_nextn_predict_layers=0, mtp_num_steps=0, first_k_dense_replace=1, n_shared_experts=1,
               n_group=4, topk_group=2, num_experts_per_tok=4, param_dtype="float32", compute_dtype="float32",
               max_position_embeddings=4096)

CONFIGS = {
    "tiny": ModelConfig(vocab_size=1024, hidden_size=256, intermediate_size=512, moe_intermediate_size=128,
                        num_hidden_layers=4, num_attention_heads=4, n_routed_experts=16, kv_lora_rank=64,
                        q_lora_rank=96, qk_rope_head_dim=16, qk_nope_head_dim=32, v_head_dim=32, index_n_heads=4,
                        index_head_dim=32, index_topk=32, **_COMMON),
    "small": ModelConfig(vocab_size=8192, hidden_size=512, intermediate_size=1408, moe_intermediate_size=256,
                         num_hidden_layers=6, num_attention_heads=8, n_routed_experts=32, kv_lora_rank=128,
                         q_lora_rank=192, qk_rope_head_dim=32, qk_nope_head_dim=64, v_head_dim=64,
                         index_n_heads=4, index_head_dim=64, index_topk=128, **_COMMON),
}
OPTIM = OptimConfig(name="adamw", lr=1e-3, warmup_steps=0, schedule="constant", weight_decay=0.1, grad_clip_norm=1.0)


def token_batches(config: ModelConfig, batch: int, seq: int, count: int, seed: int) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    return [rng.integers(0, config.vocab_size, (batch, seq), dtype=np.int32) for _ in range(count)]


def lm_batch(tokens: np.ndarray) -> dict:
    b, s = tokens.shape
    return {"tokens": jnp.asarray(tokens), "segment_ids": jnp.ones((b, s), jnp.int32),
            "positions": jnp.broadcast_to(jnp.arange(s, dtype=jnp.int32), (b, s)),
            "loss_mask": jnp.ones((b, s), jnp.int32)}


def timed_interleaved(runs: tuple, inputs: list, warmup: int) -> tuple[list[list[float]], list]:
    """Run each fn on each input in turn, forwards on even inputs and backwards on odd ones (a, b, b, a, ...),
    so drifting background load hits every side alike; return per fn the wall times of the runs after
    `warmup`, and per fn its first result."""
    times, firsts = [[] for _ in runs], [None for _ in runs]
    for i, x in enumerate(inputs):
        order = range(len(runs)) if i % 2 == 0 else reversed(range(len(runs)))
        for k in order:
            fn = runs[k]
            start = time.perf_counter()
            out = fn(x)
            elapsed = time.perf_counter() - start
            firsts[k] = out if i == 0 else firsts[k]
            if i >= warmup:
                times[k].append(elapsed)
    return times, firsts


def train_config_for(batch: int, seq: int) -> TrainConfig:
    return TrainConfig(batch_size=batch, seq_len=seq)


def jax_train_runner(params, config: ModelConfig, batch: int, seq: int):
    """A closure that runs one training step on a token batch and blocks; returns the step's lm_loss."""
    optimizer = make_optimizer(OPTIM, params, config=config)
    step = make_train_step(config, train_config_for(batch, seq), optimizer)
    state = {"s": init_train_state(jax.tree.map(jnp.array, params), optimizer)}

    def run(tokens):
        state["s"], metrics = step(state["s"], lm_batch(tokens))
        return float(jax.block_until_ready(metrics["lm_loss"]))

    return run


def jax_forward_runner(params, config: ModelConfig):
    @jax.jit
    def loss_fn(p, b):
        out = forward(p, b["tokens"], config=config, positions=b["positions"], segment_ids=b["segment_ids"],
                      return_logits=False, mtp_steps=0)
        total, count = losses.cross_entropy(out.hidden, p["lm_head"]["kernel"], b["tokens"], b["segment_ids"],
                                            b["loss_mask"])
        return total / count

    params = jax.tree.map(jnp.array, params)
    return lambda tokens: float(jax.block_until_ready(loss_fn(params, lm_batch(tokens))))


def hf_model(params, config: ModelConfig, variant: str = "eager"):
    """GlmMoeDsaForCausalLM holding `params`, set up as the HF variant says (benchmarks/hf_variants.py)."""
    import torch
    from transformers import GlmMoeDsaConfig, GlmMoeDsaForCausalLM

    from benchmarks.hf_variants import HF_VARIANTS, enable_checkpointing
    from glm5_jax.convert.hf import hf_config_dict, to_hf_state_dict

    attention, checkpointed = HF_VARIANTS[variant]
    kwargs = {k: v for k, v in hf_config_dict(config).items() if k not in ("architectures", "model_type",
                                                                          "torch_dtype")}
    hf_config = GlmMoeDsaConfig(**kwargs)
    hf_config._attn_implementation = attention
    model = GlmMoeDsaForCausalLM(hf_config)
    state = {k: torch.from_numpy(np.array(v, np.float32)) for k, v in
             to_hf_state_dict(params, config, fused_experts=True, include_mtp=False).items()}
    model.load_state_dict(state, strict=True)
    if checkpointed:
        enable_checkpointing(model)
    return model


def hf_train_runner(model):
    import torch

    # Same groups as glm5_jax's AdamW: no decay on norms (1-D leaves); the correction bias is a buffer.
    decay = [p for p in model.parameters() if p.ndim >= 2]
    no_decay = [p for p in model.parameters() if p.ndim < 2]
    optimizer = torch.optim.AdamW([{"params": decay, "weight_decay": OPTIM.weight_decay},
                                   {"params": no_decay, "weight_decay": 0.0}],
                                  lr=OPTIM.lr, betas=(OPTIM.b1, OPTIM.b2), eps=OPTIM.eps)

    def run(tokens):
        model.train()  # the forward phase's runner shares this model and sets eval mode
        ids = torch.from_numpy(tokens).long()
        loss = model(input_ids=ids, labels=ids).loss
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), OPTIM.grad_clip_norm)
        optimizer.step()
        return float(loss.detach())

    return run


def hf_forward_runner(model):
    import torch

    def run(tokens):
        model.eval()  # forward only: no dropout, no training-only branches
        ids = torch.from_numpy(tokens).long()
        with torch.no_grad():
            return float(model(input_ids=ids, labels=ids).loss)

    return run


def measure_peaks(repeats: int = 5, size: int = 2048) -> dict:
    return {"jax": matmul_peak_flops(size, repeats), "torch": torch_matmul_peak_flops(size, repeats)}


def side_figures(times: list[float], tokens: int, first_loss: float) -> dict:
    step = spread_of(times)
    return {"tokens_per_s": round(tokens / step["median_s"], 1), "step_ms": round(1e3 * step["median_s"], 1),
            "step_ms_min": round(1e3 * step["min_s"], 1), "step_ms_max": round(1e3 * step["max_s"], 1),
            "timed_steps": step["repeats"], "first_loss": round(first_loss, 5)}


def measure(name: str, config: ModelConfig, batch: int, seq: int, steps: int, warmup: int, seed: int,
            hf_variants: list[str]) -> list[dict]:
    params = jax.device_get(init(config, jax.random.key(seed)))
    inputs = token_batches(config, batch, seq, warmup + steps, seed + 1)
    rows = []
    peaks = measure_peaks()
    # One HF variant per pairing, alone in memory with fresh glm5_jax runners: with a second HF model (and its
    # AdamW state) alive in the process, glm5_jax's `small` training step ran 2.6x slower than with one
    # (7.5 s against 2.9 s median, 2026-12-02), a cost of the benchmark's layout, not of either side.
    for variant in hf_variants:
        model = hf_model(params, config, variant)
        runners = {"forward": (jax_forward_runner(params, config), hf_forward_runner(model)),
                   "train": (jax_train_runner(params, config, batch, seq), hf_train_runner(model))}
        for phase, runs in runners.items():
            times, first_losses = timed_interleaved(runs, inputs, warmup)
            jax_side, hf_side = (side_figures(t, batch * seq, loss) for t, loss in zip(times, first_losses))
            rows.append({
                "benchmark": "train_step_vs_hf", "config": name, "phase": phase, "batch": batch, "seq": seq,
                "steps": steps, "warmup": warmup, "hf_variant": variant, "glm5_jax": jax_side,
                "hf": {variant: hf_side},
                "ratio": {variant: round(jax_side["tokens_per_s"] / hf_side["tokens_per_s"], 3)},
                "hf_experts_impl": str(model.config._experts_implementation),
            })
        del model, runners
        gc.collect()
    # Peaks before and after the timed steps, best of both: background load lowers everything alike.
    later = measure_peaks()
    peaks = {k: max(v, later[k]) for k, v in peaks.items()}
    for row in rows:
        per_token = (flops.training_flops_per_token if row["phase"] == "train" else flops.forward_flops_per_token)(
            config, seq, mtp_steps=0)
        row.update({"model_mflop_per_token": round(per_token / 1e6, 2),
                    "jax_peak_gflops": round(peaks["jax"] / 1e9, 1),
                    "torch_peak_gflops": round(peaks["torch"] / 1e9, 1)})
        row["glm5_jax"]["mfu"] = round(per_token * row["glm5_jax"]["tokens_per_s"] / peaks["jax"], 4)
        for hf in row["hf"].values():
            hf["mfu"] = round(per_token * hf["tokens_per_s"] / peaks["torch"], 4)
            hf["ratio_ceiling"] = round(peaks["jax"] / (per_token * hf["tokens_per_s"]), 2)
    return rows


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--configs", nargs="+", default=list(CONFIGS), choices=list(CONFIGS))
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--seq", type=int, default=512)
    parser.add_argument("--steps", type=int, default=5, help="timed steps per measurement (median reported)")
    parser.add_argument("--warmup", type=int, default=2, help="untimed steps first (the first one compiles)")
    parser.add_argument("--threads", type=int, default=min(2, len(os.sched_getaffinity(0))),
                        help="CPUs this process (XLA and torch alike) is pinned to, and torch's intra-op threads")
    parser.add_argument("--hf-variants", nargs="+", default=["eager", "sdpa"],
                        choices=("eager", "sdpa", "eager_checkpointed", "sdpa_checkpointed"),
                        help="HF settings, each its own model and column (benchmarks/hf_variants.py)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--attention-backend", default=None, choices=("auto", "dense", "sparse"),
                        help="override the glm5_jax attention backend (default: the config's, 'auto')")
    parser.add_argument("--no-scan-layers", action="store_true",
                        help="glm5_jax with scan_layers=false (unrolled layer stacks)")
    args = parser.parse_args(argv)
    for field in ("batch", "seq", "steps", "warmup", "threads"):
        if getattr(args, field) < 1:
            parser.error(f"--{field}={getattr(args, field)} is invalid: must be >= 1")
    if args.threads > len(os.sched_getaffinity(0)):
        parser.error(f"--threads={args.threads} is invalid: this process may use {len(os.sched_getaffinity(0))} CPUs")
    if len(set(args.hf_variants)) != len(args.hf_variants):
        parser.error(f"--hf-variants={args.hf_variants} is invalid: name each variant once")
    return args


def main(argv=None) -> None:
    args = parse_args(argv)
    cpus = limit_cpus(args.threads)  # before jax starts its CPU backend (its first use, below)
    import torch

    torch.set_num_threads(args.threads)
    versions = {"jax": jax.__version__, "torch": torch.__version__, "cpu_count": os.cpu_count(), "cpus": cpus,
                "backend": jax.default_backend()}
    import transformers

    versions["transformers"] = transformers.__version__
    print(json.dumps({"benchmark": "train_step_vs_hf", "versions": versions}), flush=True)
    for name in args.configs:
        config = CONFIGS[name]
        if args.attention_backend:
            config = dataclasses.replace(config, attention_backend=args.attention_backend)
        if args.no_scan_layers:
            config = dataclasses.replace(config, scan_layers=False)
        for row in measure(name, config, args.batch, args.seq, args.steps, args.warmup, args.seed, args.hf_variants):
            row["attention_backend"] = config.attention_backend
            row["scan_layers"] = config.scan_layers
            print(json.dumps(row), flush=True)


if __name__ == "__main__":
    main()
