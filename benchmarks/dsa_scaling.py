"""How DSA attention cost grows with sequence length: forward+backward time and peak memory of three paths.

  dense   masked dense latent-form attention over all T keys with the top-k mask ([B, H, S, T] scores)
  sparse  jnp gather of each query's top-k latent rows (pallas_kernels.reference)
  pallas  the Pallas kernels (GPU or TPU: on CPU they only run in interpret mode, which measures nothing)

One JSON line per (path, S): time_ms (median of --repeats runs after a warm-up), peak_bytes (the compiled
executable's memory_analysis(): temporaries + arguments + outputs) and both as ratios to the same path at
the smallest S, so linear (sparse, pallas) against quadratic (dense) growth is visible. Paths that would
exceed --dense-max-bytes, or cannot run here, print a line with "skipped" and the reason.

  PYTHONPATH=. python benchmarks/dsa_scaling.py [--max-seq 16384] [--repeats 2]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np

from pallas_kernels import sparse_mla_attention
from pallas_kernels.reference import sparse_mla_attention_reference

SEQ_LENGTHS = (1024, 2048, 4096, 8192, 16384)


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--max-seq", type=int, default=16384, help="largest sequence length S (= T) to run")
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--kv-lora-rank", type=int, default=64)
    parser.add_argument("--rope-dim", type=int, default=16)
    parser.add_argument("--topk", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--dtype", choices=("float32", "bfloat16"), default=None,
                        help="default: float32 on CPU, bfloat16 on accelerators")
    parser.add_argument("--dense-max-bytes", type=float, default=6 * 2**30,
                        help="skip the dense path where its compiled peak memory would exceed this")
    args = parser.parse_args(argv)
    for name in ("max_seq", "batch", "heads", "kv_lora_rank", "rope_dim", "topk", "repeats"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be >= 1; got {getattr(args, name)}")
    return args


def strided_causal_indices(q_len: int, topk: int, batch: int) -> jax.Array:
    """Distinct causal keys per query, spread over its history: s, s - step, s - 2 step, ... (-1 below 0)."""
    s = np.arange(q_len)[:, None]
    step = np.maximum(1, (s + 1) // topk)
    keys = s - step * np.arange(topk)[None, :]
    return jnp.asarray(np.broadcast_to(np.where(keys >= 0, keys, -1), (batch, q_len, topk)).astype(np.int32))


def dense_attention(q, latent, indices, *, scale, kv_lora_rank):
    """Latent-form attention over all keys with the selection as a mask: the [B, H, S, T] baseline."""
    batch, q_len, num_slots = indices.shape
    num_keys = latent.shape[1]
    selected = jnp.zeros((batch, q_len, num_keys), bool).at[
        jnp.arange(batch)[:, None, None], jnp.arange(q_len)[None, :, None], jnp.where(indices >= 0, indices, num_keys)
    ].set(True, mode="drop")
    logits = jnp.einsum("BSHX,BTX->BHST", q, latent, preferred_element_type=jnp.float32) * scale
    probs = jax.nn.softmax(jnp.where(selected[:, None], logits, -1e30), axis=-1)
    return jnp.einsum("BHST,BTC->BSHC", probs.astype(q.dtype), latent[..., :kv_lora_rank]), None


def paths() -> dict:
    compiled = jax.default_backend() in ("gpu", "tpu")  # the kernels pick Triton or Mosaic from the backend
    return {
        "dense": dense_attention,
        "sparse": sparse_mla_attention_reference,
        "pallas": (lambda *a, **k: sparse_mla_attention(*a, interpret=False, **k)) if compiled else None,
    }


def forward_backward(fn, scale: float, kv_lora_rank: int):
    def loss(q, latent, indices):
        out, _ = fn(q, latent, indices, scale=scale, kv_lora_rank=kv_lora_rank)
        return jnp.sum(jnp.square(out.astype(jnp.float32)))

    return jax.jit(jax.value_and_grad(loss, argnums=(0, 1)))


def peak_bytes(compiled) -> int:
    stats = compiled.memory_analysis()
    return int(stats.temp_size_in_bytes + stats.argument_size_in_bytes + stats.output_size_in_bytes
               - stats.alias_size_in_bytes)


def measure(step, inputs, repeats: int) -> float:
    jax.block_until_ready(step(*inputs))
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        jax.block_until_ready(step(*inputs))
        times.append((time.perf_counter() - start) * 1e3)
    return statistics.median(times)


def main(argv=None) -> None:
    args = parse_args(argv)
    dtype = jnp.dtype(args.dtype or ("float32" if jax.default_backend() == "cpu" else "bfloat16"))
    width = args.kv_lora_rank + args.rope_dim
    scale = width**-0.5
    config = dict(device=jax.devices()[0].device_kind, dtype=dtype.name, batch=args.batch, heads=args.heads,
                  kv_lora_rank=args.kv_lora_rank, rope_dim=args.rope_dim, topk=args.topk)
    lengths = [s for s in SEQ_LENGTHS if s <= args.max_seq] or [args.max_seq]
    baselines: dict[str, tuple[float, int]] = {}
    for name, fn in paths().items():
        if fn is None:
            print(json.dumps({"path": name, **config, "skipped": f"no GPU or TPU (backend {jax.default_backend()}): "
                              "the Pallas kernels compile only there, and interpret mode measures nothing"}))
            continue
        for q_len in lengths:
            keys = jax.random.split(jax.random.key(q_len), 2)
            inputs = (jax.random.normal(keys[0], (args.batch, q_len, args.heads, width), dtype),
                      jax.random.normal(keys[1], (args.batch, q_len, width), dtype),
                      strided_causal_indices(q_len, args.topk, args.batch))
            step = forward_backward(fn, scale, args.kv_lora_rank).lower(*inputs).compile()
            peak = peak_bytes(step)
            record = {"path": name, "seq": q_len, **config, "peak_bytes": peak}
            if name == "dense" and peak > args.dense_max_bytes:
                print(json.dumps({**record, "skipped": f"compiled peak {peak / 2**30:.1f} GiB exceeds "
                                  f"--dense-max-bytes {args.dense_max_bytes / 2**30:.1f} GiB"}))
                continue
            time_ms = measure(step, inputs, args.repeats)
            base_time, base_peak = baselines.setdefault(name, (time_ms, peak))
            print(json.dumps({**record, "time_ms": round(time_ms, 3), "time_ratio": round(time_ms / base_time, 3),
                              "memory_ratio": round(peak / base_peak, 3), "seq_ratio": q_len // lengths[0]}),
                  flush=True)


if __name__ == "__main__":
    main()
