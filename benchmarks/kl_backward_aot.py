"""The sparse indexer KL's backward alone, jnp against the Mosaic kernel, compiled ahead of time for TPU without a
TPU (libtpu describes the chip): one layer at GLM-5's shapes (indexer 32 x 128, top-k 2048, bf16 queries and
keys, fp32 weights and cotangent), one sequence per chip (B 1, S = T = --seq), query blocks of --chunk (the v5p
recipes' `index_query_chunk` 512).

    python benchmarks/kl_backward_aot.py [--chips v5p v6e] [--seq 4096] [--chunk 512]

jnp: `pallas_kernels.selected_scores.gathered_scores_backward` (XLA gathers the rows [B, c, N, J] and takes the
VJP of the fp32 per-head logits); kernel: `pallas_kernels.selected_scores_backward` (rows DMA'd into VMEM per
query, per-slot key gradients in bf16 scatter-added into fp32 dk outside). Per side and chip, one JSON line:
HBM bytes and matmul FLOPs as `glm5 compile` counts them (`parallel/hlo_stats.py`: every loop trip, Mosaic
kernels by their declared `pl.CostEstimate`), XLA's own `cost_analysis()` bytes (it visits a loop body once), the
compiled temporaries, the largest Mosaic kernel's scoped VMEM, and the roofline time at the chip's peak.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")  # other processes on this host may hold libtpu's lock
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

from jax.sharding import Mesh, NamedSharding, PartitionSpec  # noqa: E402

from benchmarks.tpu_kernels_aot import _vmem  # noqa: E402
from glm5_jax.parallel.hlo_stats import hlo_stats  # noqa: E402
from glm5_jax.parallel.topology import CHIPS, get_topology  # noqa: E402
from pallas_kernels import selected_scores_backward  # noqa: E402
from pallas_kernels.selected_scores import gathered_scores_backward  # noqa: E402

I, J, N = 32, 128, 2048


def sides(chunk: int) -> dict:
    def jnp_side(q, k, w, topk, g):
        return gathered_scores_backward(q, w, k, topk, g, chunk)

    def kernel_side(q, k, w, topk, g):
        return selected_scores_backward(q, k, w, topk, g, bwd_query_chunk=chunk, platform="tpu", interpret=False)

    return {"jnp": jnp_side, "kernel": kernel_side}


def measure(name: str, fn, chip: str, seq: int) -> dict:
    sharding = NamedSharding(Mesh(get_topology(f"{chip}-8").devices()[:1], ("chip",)), PartitionSpec())
    args = [jax.ShapeDtypeStruct(shape, dtype, sharding=sharding) for shape, dtype in
            [((1, seq, I, J), jnp.bfloat16), ((1, seq, J), jnp.bfloat16), ((1, seq, I), jnp.float32),
             ((1, seq, N), jnp.int32), ((1, seq, N), jnp.float32)]]
    start = time.time()
    compiled = jax.jit(fn).trace(*args).lower().compile()
    seconds = time.time() - start
    stats = hlo_stats(compiled.as_text(), 1)
    xla = compiled.cost_analysis()
    xla = xla[0] if isinstance(xla, list) else xla
    peak = CHIPS[chip].peak_bf16_flops
    roofline = max(stats.matmul_flops / peak, stats.hbm_bytes / CHIPS[chip].hbm_bytes_per_s)
    top = sorted(stats.hbm_bytes_by_source.items(), key=lambda kv: -kv[1])[:4]
    return dict(side=name, chip=chip, seq=seq, hbm_gb=stats.hbm_bytes / 1e9, gflop=stats.matmul_flops / 1e9,
                xla_bytes_gb=xla.get("bytes accessed", 0.0) / 1e9,
                temp_mib=compiled.memory_analysis().temp_size_in_bytes / 2**20, vmem_kib=_vmem(compiled) / 1024,
                roofline_ms=roofline * 1e3, compile_s=round(seconds, 1),
                hbm_gb_by_source={k: round(v / 1e9, 3) for k, v in top})


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--chips", nargs="+", default=["v5p"])
    parser.add_argument("--seq", type=int, default=4096)
    parser.add_argument("--chunk", type=int, default=512)
    args = parser.parse_args()
    for chip in args.chips:
        for name, fn in sides(args.chunk).items():
            print(json.dumps(measure(name, fn, chip, args.seq)), flush=True)


if __name__ == "__main__":
    main()
