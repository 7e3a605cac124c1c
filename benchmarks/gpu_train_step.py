"""Training step of a ~1B-parameter GLM-5-shaped model on one GPU: compile time, tokens/s and MFU.

The model is `configs/glm5_1b_h200.yaml`'s: GLM-5's per-head shapes (qk 192 nope + 64 rope, v 256, kv latent
512, indexer heads of 128 with top-k 2048) and its routing (sigmoid, one shared expert, 8 routed experts per
token), scaled to hidden 2048, 12 layers (2 dense), 32 experts and a 32K vocabulary, with the shared 1-layer MTP
applied `--mtp-steps` times. bf16 compute, fp32 parameters, AdamW. Sequences longer than the top-k make DSA
prune. `glm5 compile configs/glm5_1b_h200.yaml --topology h200-1` gives the same step's compiled memory and
roofline without a GPU.

MFU = analytic training FLOPs/token (`glm5_jax.model.flops`) x tokens/s / `--peak-tflops` (H200 dense
bf16: 989). One JSON line per result on stdout and appended to --out; failures become error lines.

  PYTHONPATH=. python benchmarks/gpu_train_step.py --out "$OUT/gpu_check.jsonl"
  PYTHONPATH=. python benchmarks/gpu_train_step.py --attention-backend pallas,sparse   # kernels vs jnp DSA
  PYTHONPATH=. python benchmarks/gpu_train_step.py --attention-backend pallas --sparse-row-gradients atomic
  PYTHONPATH=. python benchmarks/gpu_train_step.py --attention-backend pallas --profile-steps 2   # where time goes
  PYTHONPATH=. python benchmarks/gpu_train_step.py --smoke          # tiny shapes, any backend (CPU check)
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import statistics
import tempfile
import time
import traceback
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from benchmarks.json_lines import emit
from benchmarks.profile_summary import summarize
from glm5_jax.config import ModelConfig, TrainConfig, load_model_config
from glm5_jax.model import flops
from glm5_jax.model.param_count import count_params
from glm5_jax.model.transformer import init
from glm5_jax.train.optim import OptimConfig, make_optimizer
from glm5_jax.train.step import init_train_state, make_train_step

GLM5_1B = load_model_config(Path(__file__).resolve().parents[1] / "configs" / "glm5_1b_h200.yaml")
# Same code path at a size a CPU runs in seconds (checks the script, measures nothing meaningful).
SMOKE = dataclasses.replace(
    GLM5_1B, vocab_size=512, hidden_size=64, intermediate_size=128, moe_intermediate_size=32, num_hidden_layers=3,
    num_attention_heads=2, q_lora_rank=32, kv_lora_rank=32, qk_nope_head_dim=16, qk_rope_head_dim=8,
    v_head_dim=16, n_routed_experts=8, num_experts_per_tok=2, first_k_dense_replace=1, index_n_heads=2,
    index_head_dim=16, index_topk=16, attention_backend="sparse")


BACKENDS = ("pallas", "sparse", "dense")


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", default=None, help="append JSON lines here too")
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument("--seq", type=int, default=4096)
    parser.add_argument("--steps", type=int, default=5, help="timed steps (median reported)")
    parser.add_argument("--mtp-steps", type=int, default=1)
    parser.add_argument("--attention-backend", default=None,
                        help="sparse, pallas or dense; a comma-separated list times each in turn (same weights)")
    parser.add_argument("--remat", default="none", choices=("none", "full", "dots", "dots_no_batch"))
    parser.add_argument("--sparse-row-gradients", default="scatter", choices=("scatter", "atomic"),
                        help="model.sparse_row_gradients: how the Triton sparse MLA backward sums row gradients")
    parser.add_argument("--peak-tflops", type=float, default=989.0, help="dense bf16 peak of the chip")
    parser.add_argument("--budget-s", type=float, default=45.0, help="stop timing steps after this many seconds")
    parser.add_argument("--smoke", action="store_true", help="tiny shapes (seq 64) to check the script on CPU")
    parser.add_argument("--profile-steps", type=int, default=0,
                        help="after timing, trace this many steps and print where the device time went")
    parser.add_argument("--profile-dir", default=None, help="keep the trace here (default: a temporary directory)")
    args = parser.parse_args(argv)
    for backend in (args.attention_backend or "").split(","):
        if backend and backend not in BACKENDS:
            parser.error(f"--attention-backend={backend!r} is invalid: choose from {', '.join(BACKENDS)}")
    if args.profile_steps < 0:
        parser.error(f"--profile-steps={args.profile_steps} is invalid: must be >= 0")
    for field in ("batch", "seq", "steps"):
        if getattr(args, field) < 1:
            parser.error(f"--{field}={getattr(args, field)} is invalid: must be >= 1")
    if args.mtp_steps < 0:
        parser.error(f"--mtp-steps={args.mtp_steps} is invalid: must be >= 0")
    return args


def build_config(args: argparse.Namespace, backend: str | None) -> ModelConfig:
    base = SMOKE if args.smoke else GLM5_1B
    changes = {"mtp_num_steps": args.mtp_steps, "num_nextn_predict_layers": int(args.mtp_steps > 0),
               "remat_policy": args.remat, "sparse_row_gradients": args.sparse_row_gradients}
    if backend:
        changes["attention_backend"] = backend
    elif not args.smoke and jax.default_backend() != "gpu":
        changes["attention_backend"] = "sparse"  # Pallas kernels only compile for GPU
    return dataclasses.replace(base, **changes).validate()


def run(args: argparse.Namespace, backend: str | None, params=None):
    """Times one attention backend's step; returns the initial weights for the next backend to reuse."""
    config = build_config(args, backend)
    batch, seq = args.batch, (64 if args.smoke else args.seq)
    counts = count_params(config)
    optim = OptimConfig(name="adamw", lr=1e-4, warmup_steps=0, schedule="constant")
    params = init(config, jax.random.key(0)) if params is None else jax.device_put(params)
    # The step donates its state; the next backend's weights wait on the host, so they are not in this step's peak.
    untouched = jax.device_get(params)
    optimizer = make_optimizer(optim, params, config=config)
    step = make_train_step(config, TrainConfig(batch_size=batch, seq_len=seq), optimizer)
    state = init_train_state(params, optimizer)
    rng = np.random.default_rng(0)

    def make_batch():
        tokens = jnp.asarray(rng.integers(0, config.vocab_size, (batch, seq), dtype=np.int32))
        return {"tokens": tokens, "segment_ids": jnp.ones((batch, seq), jnp.int32),
                "positions": jnp.broadcast_to(jnp.arange(seq, dtype=jnp.int32), (batch, seq)),
                "loss_mask": jnp.ones((batch, seq), jnp.int32)}

    start = time.perf_counter()
    compiled = step.jitted.lower(state, make_batch()).compile()
    compile_s = time.perf_counter() - start
    state, metrics = compiled(state, make_batch())  # warm-up
    first_loss = float(metrics["loss"])
    times, deadline = [], time.perf_counter() + args.budget_s
    while len(times) < args.steps and time.perf_counter() < deadline:
        b = make_batch()
        jax.block_until_ready(b)
        t0 = time.perf_counter()
        state, metrics = compiled(state, b)
        jax.block_until_ready(metrics["loss"])
        times.append(time.perf_counter() - t0)
    if args.profile_steps:
        state = profile(args, compiled, state, make_batch, config.attention_backend)
    tokens_per_s = batch * seq / statistics.median(times)
    per_token = flops.training_flops_per_token(config, seq)
    memory = jax.local_devices()[0].memory_stats() or {}
    emit("train_step", {
        "device": jax.devices()[0].device_kind, "config": "smoke" if args.smoke else "glm5_1b",
        "params_total": counts["total"], "params_active_per_token": counts["active_per_token"],
        "batch": batch, "seq": seq, "mtp_steps": args.mtp_steps, "attention_backend": config.attention_backend,
        "remat": config.remat_policy, "sparse_row_gradients": config.sparse_row_gradients,
        "compute_dtype": config.compute_dtype, "compile_s": round(compile_s, 1),
        "steps_timed": len(times), "step_ms": round(1e3 * statistics.median(times), 1),
        "tokens_per_s": round(tokens_per_s, 1), "train_tflops_per_token": per_token / 1e12,
        "achieved_tflops": round(per_token * tokens_per_s / 1e12, 2), "peak_tflops": args.peak_tflops,
        "mfu": round(per_token * tokens_per_s / (args.peak_tflops * 1e12), 4),
        "first_loss": round(first_loss, 4), "last_loss": round(float(metrics["loss"]), 4),
        "peak_memory_gib": round(memory.get("peak_bytes_in_use", 0) / 2**30, 2),
    }, args.out)
    return untouched


def profile(args, compiled, state, make_batch, backend: str):
    """Traces args.profile_steps steps and emits one `step_profile` line per device timeline
    (`profile_summary.summarize`); returns the state after them."""
    batches = [make_batch() for _ in range(args.profile_steps)]
    jax.block_until_ready(batches)
    with contextlib.ExitStack() as stack:
        trace_dir = args.profile_dir or stack.enter_context(tempfile.TemporaryDirectory())
        with jax.profiler.trace(trace_dir):
            for b in batches:
                state, metrics = compiled(state, b)
            jax.block_until_ready(metrics["loss"])
        for record in summarize(trace_dir, args.profile_steps):
            emit("step_profile", {"attention_backend": backend, **record}, args.out)
    return state


def main(argv=None) -> None:
    args = parse_args(argv)
    params, failed = None, False
    for backend in (args.attention_backend or "").split(",") or [None]:
        try:
            params = run(args, backend or None, params)
        except Exception as exc:  # an OOM or compile failure is a result to report, not a crash of the check
            emit("train_step", {"attention_backend": backend or "default",
                                "error": f"{type(exc).__name__}: {exc}"[:2000],
                                "traceback": traceback.format_exc()[-3000:]}, args.out)
            failed = True
    if failed:
        raise SystemExit(1)


if __name__ == "__main__":
    main()
