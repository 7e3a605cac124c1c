"""The tiny model's training steps on the accelerator against the same steps on the host CPU, in one process.

configs/tiny.yaml (every feature on: MLA, DSA top-k with the indexer, MoE with its bias update, MTP) in bf16
compute, AdamW, the same weights and batches on both sides. The accelerator side runs its own kernels (Pallas
DSA kernels for `--attention-backend pallas`, the grouped-matmul kernels of the routed experts); the CPU side
runs the jnp paths and the blocked experts. Losses must agree within bf16 tolerance at every step. One JSON line
per step and a summary line (`"ok"`), on stdout and appended to --out; no grain, no network.

  PYTHONPATH=. python benchmarks/gpu_tiny_losses.py --out "$OUT/gpu_check.jsonl"
  PYTHONPATH=. python benchmarks/gpu_tiny_losses.py --accelerator cpu   # checks the script on a CPU host
  PYTHONPATH=. python benchmarks/gpu_tiny_losses.py --mode dsa_warmup    # the dense warm-up (flash on GPU)
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import time
from pathlib import Path

# A numerics check, not a speed one: both sides compile fast (LLVM unoptimised, no GEMM autotuning on the GPU),
# 70 s instead of 131 s with both sides on a 2-core CPU (2026-12-04). Set before jax reads XLA_FLAGS.
os.environ["XLA_FLAGS"] = " ".join([os.environ.get("XLA_FLAGS", ""), "--xla_backend_optimization_level=0",
                                    "--xla_gpu_autotune_level=0"]).strip()

import jax  # noqa: E402
import numpy as np  # noqa: E402

from benchmarks.json_lines import emit  # noqa: E402
from glm5_jax.config import TrainConfig, load_model_config  # noqa: E402
from glm5_jax.model.transformer import init  # noqa: E402
from glm5_jax.train.optim import OptimConfig, make_optimizer  # noqa: E402
from glm5_jax.train.step import init_train_state, make_train_step  # noqa: E402

TINY = Path(__file__).resolve().parents[1] / "configs" / "tiny.yaml"


def run_steps(config, device, batches: list[dict], steps: int, mode: str = "pretrain") -> list[float]:
    """Losses of `steps` AdamW steps of training `mode` from the same initial weights, every array on `device`
    (the DSA dense warm-up trains the indexer only, on its KL loss)."""
    with jax.default_device(device):
        params = init(config, jax.random.key(0))
        trainable = "indexer" if mode == "dsa_warmup" else "all"
        optimizer = make_optimizer(OptimConfig(name="adamw", lr=1e-3, warmup_steps=0, total_steps=steps,
                                               trainable=trainable), params, config=config)
        rows, seq = batches[0]["tokens"].shape
        train_step = make_train_step(config, TrainConfig(batch_size=rows, seq_len=seq, mode=mode), optimizer)
        state = init_train_state(params, optimizer)
        losses = []
        for batch in batches[:steps]:
            state, metrics = train_step(state, jax.device_put(batch, device))
            losses.append(float(metrics["loss"]))
    return losses


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", default=None, help="append JSON lines here too")
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--seq", type=int, default=128, help="longer than the tiny model's index_topk (8)")
    parser.add_argument("--accelerator", default=None, help="platform to check (default: jax's default backend)")
    parser.add_argument("--attention-backend", default="pallas", choices=("pallas", "sparse", "dense"))
    parser.add_argument("--rtol", type=float, default=2e-2, help="bf16 compute: relative tolerance per step")
    parser.add_argument("--mode", default="pretrain", choices=("pretrain", "dsa_warmup"),
                        help="dsa_warmup: every layer attends to every key (on a GPU with the kernels: the Triton "
                             "flash attention and the dense KL target kernel)")
    args = parser.parse_args(argv)

    platform = args.accelerator or jax.default_backend()
    base = dataclasses.replace(load_model_config(TINY), compute_dtype="bfloat16", moe_backend="ragged")
    on_accelerator = dataclasses.replace(base, attention_backend=args.attention_backend if platform != "cpu"
                                         else "sparse").validate()
    on_cpu = dataclasses.replace(base, attention_backend="sparse").validate()
    rng = np.random.default_rng(0)
    shape = (args.batch, args.seq)
    batches = [{"tokens": rng.integers(0, base.vocab_size, shape, dtype=np.int32),
                "segment_ids": np.ones(shape, np.int32),
                "positions": np.broadcast_to(np.arange(args.seq, dtype=np.int32), shape).copy(),
                "loss_mask": np.ones(shape, np.int32)} for _ in range(args.steps)]
    try:
        start = time.perf_counter()
        accelerator = run_steps(on_accelerator, jax.devices(platform)[0], batches, args.steps, args.mode)
        middle = time.perf_counter()
        reference = run_steps(on_cpu, jax.devices("cpu")[0], batches, args.steps, args.mode)
        seconds = {"accelerator_s": round(middle - start, 1), "cpu_s": round(time.perf_counter() - middle, 1)}
    except Exception as err:  # noqa: BLE001 - reported as a result line, the check script goes on
        emit("tiny_losses", {"error": f"{type(err).__name__}: {err}"[:2000], "platform": platform}, args.out)
        return 1
    ok = True
    for step, (got, want) in enumerate(zip(accelerator, reference), start=1):
        close = bool(np.isclose(got, want, rtol=args.rtol, atol=0.0))
        ok &= close
        emit("tiny_losses", {"step": step, "platform": platform, "loss": got, "cpu_loss": want,
              "relative_difference": abs(got - want) / abs(want), "close": close}, args.out)
    emit("tiny_losses", {"summary": True, "platform": platform, "attention_backend": on_accelerator.attention_backend,
          "mode": args.mode, "steps": args.steps, "rtol": args.rtol, "ok": ok, **seconds}, args.out)
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
