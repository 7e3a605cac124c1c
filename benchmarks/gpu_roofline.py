"""The roofline of the DSA Triton kernels for an H200, compiled here without a GPU, beside the times an H200
measured for the same programs: how far the kernels run from the bound the TPU tables rest on.

    python benchmarks/gpu_roofline.py [--seqs 8192 16384 32768 65536] [--measured benchmarks/gpu_runs/*.jsonl]

Each program is the one `gpu_kernels.py` times at S = T (B 1, H 64, C 512, R 64, N 2048, indexer 32 x 128,
bf16): the sparse MLA forward, its forward+backward under a sum-of-squares loss, the same two of the Triton flash
attention over every visible key (expanded form, 64 heads of 256), and the indexer top-k. It is
compiled for an H200 by XLA:GPU and Triton through the CUDA plugin (the test extra; no GPU, no cuDNN, so the
cuDNN flash baseline cannot be compiled here), and `glm5_jax.parallel.hlo_stats` counts its matmul FLOPs (the
kernels' declared costs included) and HBM bytes, every loop trip counted. Roofline: max(FLOPs / 989 TFLOP/s,
bytes / 4.8 TB/s). The kernels' declared costs count every row block of every query (their programs skip the
blocks past a query's last valid slot at run time), so at these lengths, where nearly every query holds
2048 valid slots, the count is the work done; at S = T = 2048 (every key selected, causally about half of them
valid) it is about twice the work done. The flash kernels count the key blocks on or below the diagonal. Measured: the median times in the given JSON lines
(`gpu_check.jsonl` of an H200 run; the last line per program and length wins).
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
from jax.experimental import topologies  # noqa: E402
from jax.sharding import Mesh, NamedSharding, PartitionSpec  # noqa: E402

from glm5_jax.parallel.hlo_stats import hlo_stats  # noqa: E402
from glm5_jax.parallel.topology import CHIPS  # noqa: E402
from pallas_kernels import causal_flash_attention, indexer_topk, sparse_mla_attention  # noqa: E402
from pallas_kernels.gpu_targets import gpu_target_config  # noqa: E402

H, C, R, N, I, J = 64, 512, 64, 2048, 32, 128
FLASH_DIM = 256  # GLM-5's query-key (192 + 64) and value head dims
GPU = dict(platform="gpu", interpret=False)
MEASURED = str(Path(__file__).resolve().parent / "gpu_runs" / "*.jsonl")


def programs(q_len: int) -> dict:
    """name: (function, abstract arguments) of the programs `gpu_kernels.py` times at S = T = q_len."""
    sds = jax.ShapeDtypeStruct
    q, latent = sds((1, q_len, H, C + R), jnp.bfloat16), sds((1, q_len, C + R), jnp.bfloat16)
    indices = sds((1, q_len, min(N, q_len)), jnp.int32)
    qi, ki, wi = sds((1, q_len, I, J), jnp.bfloat16), sds((1, q_len, J), jnp.bfloat16), sds((1, q_len, I), jnp.float32)
    scale = (C + R) ** -0.5

    def forward(q, latent, indices):
        return sparse_mla_attention(q, latent, indices, scale=scale, kv_lora_rank=C, **GPU)[0]

    def forward_backward(q, latent, indices):
        return jax.grad(lambda a, b: jnp.sum(jnp.square(forward(a, b, indices).astype(jnp.float32))),
                        argnums=(0, 1))(q, latent)

    def select(q, k, w):
        return indexer_topk(q, k, w, topk=min(N, q_len), **GPU)

    # Flash attention over every visible key in MLA's expanded form (64 heads of 256), as the model runs it
    # where the top-k keeps every key (T <= N) and in the dense warm-up.
    expanded, segments = sds((1, q_len, H, FLASH_DIM), jnp.bfloat16), sds((1, q_len), jnp.int32)

    def flash(q, k, v, segment_ids):
        return causal_flash_attention(q, k, v, segment_ids, scale=FLASH_DIM ** -0.5, **GPU)

    def flash_backward(q, k, v, segment_ids):
        return jax.grad(lambda a, b, c: jnp.sum(jnp.square(flash(a, b, c, segment_ids).astype(jnp.float32))),
                        argnums=(0, 1, 2))(q, k, v)

    flash_args = (expanded, expanded, expanded, segments)
    return {"pallas_sparse forward": (forward, (q, latent, indices)),
            "pallas_sparse forward+backward": (forward_backward, (q, latent, indices)),
            "pallas_flash forward": (flash, flash_args),
            "pallas_flash forward+backward": (flash_backward, flash_args),
            "indexer_topk": (select, (qi, ki, wi))}


def h200_device():
    return topologies.get_topology_desc(platform="cuda", target_config=gpu_target_config("h200"),
                                        topology="1x1x1").devices[0]


def counted(fn, args, device) -> tuple[float, float]:
    """(matmul FLOPs, HBM bytes) of fn(*args) compiled for `device` (its default device too: Triton picks the
    GPU architecture from it)."""
    sharding = NamedSharding(Mesh([device], ("gpu",)), PartitionSpec())
    placed = [jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=sharding) for a in args]
    jax.config.update("jax_persistent_cache_min_compile_time_secs", float("inf"))  # not loadable without a GPU
    with jax.default_device(device):
        stats = hlo_stats(jax.jit(fn).trace(*placed).lower().compile().as_text(), 1)
    return stats.matmul_flops, stats.hbm_bytes


def measured_ms(pattern: str) -> dict[tuple[str, int], float]:
    """(program, S) -> milliseconds from the H200 runs' JSON lines."""
    found = {}
    for path in sorted(glob.glob(pattern)):
        for line in Path(path).read_text().splitlines():
            record = json.loads(line)
            if record.get("check") != "scaling" or "forward_ms" not in record:
                continue
            if record["path"] in ("pallas_sparse", "pallas_flash"):
                found[(f"{record['path']} forward", record["seq"])] = record["forward_ms"]
                found[(f"{record['path']} forward+backward", record["seq"])] = record["fwd_bwd_ms"]
            elif record["path"] == "indexer_topk":
                found[("indexer_topk", record["seq"])] = record["forward_ms"]
    return found


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seqs", type=int, nargs="+", default=[8192, 16384, 32768, 65536])
    parser.add_argument("--measured", default=MEASURED, help="glob of an H200 run's JSON lines")
    args = parser.parse_args(argv)
    for q_len in args.seqs:
        if q_len < 256 or q_len % 256:
            parser.error(f"--seqs {q_len} is invalid: must be a multiple of 256 (the top-k's query chunk)")
    chip, device, times = CHIPS["h200"], h200_device(), measured_ms(args.measured)
    print(f"jax {jax.__version__}; H200 roofline: {chip.peak_bf16_flops / 1e12:.0f} TFLOP/s, "
          f"{chip.hbm_bytes_per_s / 1e12:.1f} TB/s\n")
    print("| program | S = T | GFLOP (counted) | HBM GB | roofline ms | bound | measured ms | measured / roofline |")
    print("|---|---:|---:|---:|---:|---|---:|---:|")
    for q_len in args.seqs:
        for name, (fn, fn_args) in programs(q_len).items():
            flops, hbm = counted(fn, fn_args, device)
            compute, memory = flops / chip.peak_bf16_flops, hbm / chip.hbm_bytes_per_s
            roof = max(compute, memory)
            got = times.get((name, q_len))
            ratio = f"{got / 1e3 / roof:.1f}x" if got is not None else "-"
            print(f"| {name} | {q_len:,} | {flops / 1e9:,.0f} | {hbm / 1e9:,.1f} | {roof * 1e3:.1f} | "
                  f"{'compute' if compute >= memory else 'memory'} | {got if got is not None else '-'} | {ratio} |",
                  flush=True)


if __name__ == "__main__":
    main()
