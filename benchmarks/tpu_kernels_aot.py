"""Compile report of the DSA Mosaic kernels for TPU, made without a TPU: each kernel is compiled ahead of time for
each chip by XLA's TPU compiler and libtpu's Mosaic compiler (libtpu describes the chips; see
glm5_jax/parallel/topology.py), and the compiled module reports its memory and cost.

    python benchmarks/tpu_kernels_aot.py [--chips v5p v6e] [--seq 4096] [--long 16384 65536 131072 202752]
                                         [--skip-kernels]

Per kernel and chip (GLM-5 shapes: H 64, C 512, R 64, N 2048, indexer 32 x 128; bf16; B 1, S = T = --seq):
  - VMEM: the largest scoped VMEM libtpu allotted to one Mosaic kernel of the module (its pipeline buffers
    and scratch); HBM: arguments + outputs, and XLA's temporaries, of the module at full size.
  - FLOPs and bytes: read off the full-size compiled module by `glm5_jax.parallel.hlo_stats` (the counter
    `glm5 compile` uses): every op counted as many times as its loops run (XLA's own cost analysis visits a
    loop body once), matmul FLOPs of XLA's dots and the `pl.CostEstimate` each Mosaic kernel declares, and the
    HBM traffic of every op XLA runs outside a fusion (in-place updates count the update, not the buffer) plus
    the kernels' declared bytes.
    Until 2026-12-02 this report took XLA's cost analysis of a module of one 256-query chunk scaled by S / 256,
    which multiplied every per-call cost that does not grow with the queries (padding the latent, zeroing and
    casting d(latent)) by S / 256, and took XLA:TPU's estimate of its top-k (11x the scores it reads) where
    this counter takes one read of the scores and one write of the selection (a lower bound): DSA at 64K on
    v5p was 1880 GB that way, 1424 GB this way.
  - Roofline: max(FLOPs / peak bf16 FLOP/s, bytes / HBM bandwidth) on one chip, the time at the chip's peak,
    with the larger of the counted and the model FLOPs (a kernel without a cost estimate, e.g. the flash
    attention backward, counts no FLOPs; the counted figure includes padded and causally skipped tiles the
    model count leaves out).

Then the long-context comparison (--long, one table per length): DSA attention for training (indexer top-k + sparse MLA forward and
backward) against the dense attention it replaces, compiled the same way: JAX's Mosaic flash attention
(jax.experimental.pallas.ops.tpu.flash_attention, causal) forward and backward at GLM-5's expanded heads
(H 64, qk 192 + 64 = 256, v 256). The dense XLA attention of the model (a materialised [B, H, S, T] matrix,
1 TiB at 64K) is not a candidate there. Its FLOPs column is XLA's; "model FLOPs" counts the useful work
analytically (causal: half of S x T).

Both tables also show DSA's sparse training stage, whose indexer KL needs the attention's head-mean
probabilities at the selected rows: as two kernels (the sparse MLA forward, then `sparse_attention_target`
gathering the same rows again from its lse) and as one (`sparse_mla_attention_with_target`, since 2026-12-02).

Prints a markdown table per section. Nothing runs: no TPU is needed, only libtpu (the test extra).
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import os
import sys
import time
from pathlib import Path

os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")  # other processes on this host may hold libtpu's lock
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
from jax.experimental.layout import Format, Layout  # noqa: E402
from jax.sharding import Mesh, NamedSharding, PartitionSpec  # noqa: E402

from glm5_jax.parallel.hlo_stats import hlo_stats  # noqa: E402
from glm5_jax.parallel.topology import CHIPS, get_topology  # noqa: E402
from pallas_kernels import (  # noqa: E402
    causal_flash_attention,
    dense_attention_target,
    indexer_scores,
    indexer_topk,
    sparse_attention_target,
    sparse_mla_attention,
    sparse_mla_attention_with_target,
)

# HBM bandwidth per chip, bytes/s (Cloud TPU documentation); topology.CHIPS has HBM size and peak FLOP/s only.
HBM_BYTES_PER_S = {"v4": 1228e9, "v5e": 819e9, "v5p": 2765e9, "v6e": 1640e9}
CHUNK = 256  # the top-k query chunk: lengths are multiples of it
H, C, R, N, I, J = 64, 512, 64, 2048, 32, 128
QK_DENSE, V_DENSE = 192 + 64, 256  # GLM-5's expanded heads: qk_nope + rope, v_head_dim
BF16, F32, I32 = jnp.bfloat16, jnp.float32, jnp.int32
SCALE = (C + R) ** -0.5
TPU = dict(platform="tpu", interpret=False)


@dataclasses.dataclass
class Row:
    name: str
    chip: str
    vmem: int = 0
    hbm_io: int = 0
    hbm_temp: int = 0
    flops: float = 0.0
    bytes: float = 0.0
    model_flops: float = 0.0
    error: str = ""

    def roofline(self) -> tuple[float, str]:
        compute = max(self.flops, self.model_flops) / CHIPS[self.chip].peak_bf16_flops
        memory = self.bytes / HBM_BYTES_PER_S[self.chip]
        return max(compute, memory), "compute" if compute >= memory else "memory"


def _vmem(compiled) -> int:
    import json
    import re

    sizes = [0]
    for line in compiled.as_text().splitlines():
        if 'custom_call_target="tpu_custom_call"' in line:
            found = re.search(r'"used_scoped_memory_configs":(\[[^\]]*\])', line)
            sizes += [int(c["size"]) for c in json.loads(found.group(1))] if found else []
    return max(sizes)


def _row_major(shape, sharding) -> Format:
    return Format(Layout(major_to_minor=tuple(range(len(shape)))), sharding)


def _compile(fn, args, sharding):
    """The module with its arguments and results in row-major layouts, as the kernels take them inside a model.
    XLA:TPU's own choice for an entry array can differ: for q [1, S, 64, 576] it makes S the minor dimension
    (576 is not a whole number of 128-lane tiles), so a module left to choose relaid the queries out on the way in
    and their gradient on the way out, 30 GB at 64K tokens that a layer inside a model does not move."""
    placed = [jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=_row_major(a.shape, sharding)) for a in args]
    results = jax.eval_shape(fn, *args)
    out = jax.tree.map(lambda r: _row_major(r.shape, sharding), results)
    return jax.jit(fn, out_shardings=out).trace(*placed).lower().compile()


def _attention_grad(q, latent, indices):
    def loss(q, latent):
        out, lse = sparse_mla_attention(q, latent, indices, scale=SCALE, kv_lora_rank=C, **TPU)
        return jnp.sum(out.astype(F32)) + jnp.sum(lse)

    return jax.grad(loss, argnums=(0, 1))(q, latent)


def _attention_then_target(q, latent, indices):
    """The sparse stage's attention forward and KL target as two kernels: the target gathers the rows again."""
    out, lse = sparse_mla_attention(q, latent, indices, scale=SCALE, kv_lora_rank=C, **TPU)
    constant = jax.lax.stop_gradient
    return out, sparse_attention_target(constant(q), constant(latent), indices, constant(lse), scale=SCALE, **TPU)


def _attention_with_target(q, latent, indices):
    """The same from one kernel (one gather): `sparse_mla_attention_with_target`."""
    out, _, target = sparse_mla_attention_with_target(q, latent, indices, scale=SCALE, kv_lora_rank=C, **TPU)
    return out, target


def _sparse_stage_grad(attend):
    """Gradients of a loss on the attention output, with the target computed (and returned) alongside."""
    def grads(q, latent, indices):
        def loss(q, latent):
            out, target = attend(q, latent, indices)
            return jnp.sum(out.astype(F32)), target

        return jax.grad(loss, argnums=(0, 1), has_aux=True)(q, latent)

    return grads


def _scores_grad(q, k, w):
    return jax.grad(lambda q, k, w: jnp.sum(jnp.sin(indexer_scores(q, k, w, block_t=128, **TPU))),
                    argnums=(0, 1, 2))(q, k, w)


def _dsa_training(q, latent, q_index, k_index, weights):
    """What DSA attention costs one layer of a training step: top-k selection, sparse MLA forward + backward."""
    indices, _ = indexer_topk(q_index, k_index, weights, topk=N, block_t=128, **TPU)
    return _attention_grad(q, latent, jax.lax.stop_gradient(indices))


def _dsa_sparse_stage(attend):
    """DSA's sparse training stage per layer: top-k, then the attention forward + backward and the KL target,
    by `attend` (two kernels or one)."""
    def stage(q, latent, q_index, k_index, weights):
        indices, _ = indexer_topk(q_index, k_index, weights, topk=N, block_t=128, **TPU)
        return _sparse_stage_grad(attend)(q, latent, jax.lax.stop_gradient(indices))

    return stage


def _every_key_sparse_stage(q_heads, k_heads, v_heads, q, latent, q_index, k_index, weights):
    """DSA's sparse stage where the top-k keeps every key (S = T <= N), as the model runs it on TPU: the top-k (its
    scores feed the KL), flash attention over the expanded heads forward and backward, and the dense KL target
    (a constant), instead of the sparse MLA kernels gathering every visible row per query."""
    selection = indexer_topk(q_index, k_index, weights, topk=N, block_t=128, **TPU)
    segments = jnp.ones(q_heads.shape[:2], I32)
    target = dense_attention_target(q, latent, scale=SCALE, block_t=128, **TPU)

    def loss(q_heads, k_heads, v_heads):
        out = causal_flash_attention(q_heads, k_heads, v_heads, segments, scale=QK_DENSE**-0.5, **TPU)
        return jnp.sum(out.astype(F32))

    return jax.grad(loss, argnums=(0, 1, 2))(q_heads, k_heads, v_heads), target, selection


def _flash_training(q, k, v):
    from jax.experimental.pallas.ops.tpu.flash_attention import flash_attention

    def loss(q, k, v):
        return jnp.sum(flash_attention(q, k, v, causal=True, sm_scale=QK_DENSE**-0.5).astype(F32))

    return jax.grad(loss, argnums=(0, 1, 2))(q, k, v)


def kernel_cases(q_len: int, k_len: int) -> dict:
    """name: (function, its arguments for q_len queries against k_len keys, model FLOPs)."""
    sds = jax.ShapeDtypeStruct
    q, latent = sds((1, q_len, H, C + R), BF16), sds((1, k_len, C + R), BF16)
    indices, lse = sds((1, q_len, N), I32), sds((1, q_len, H), F32)
    q_index, k_index, weights = sds((1, q_len, I, J), BF16), sds((1, k_len, J), BF16), sds((1, q_len, I), F32)
    sparse_fwd = 2 * q_len * N * H * (C + R + C)
    sparse_bwd = 2 * q_len * N * H * (3 * (C + R) + 2 * C)
    causal_pairs = q_len * (k_len - q_len) + q_len * (q_len + 1) / 2  # queries are the last q_len positions
    index = 2 * causal_pairs * I * J
    dense = 2 * causal_pairs * H * (C + R)
    return {
        "sparse_mla forward": (functools.partial(sparse_mla_attention, scale=SCALE, kv_lora_rank=C, **TPU),
                               (q, latent, indices), sparse_fwd),
        "sparse_mla forward+backward": (_attention_grad, (q, latent, indices), sparse_fwd + sparse_bwd),
        "indexer_scores forward": (lambda q, k, w: indexer_scores(q, k, w, block_t=128, **TPU),
                                   (q_index, k_index, weights), index),
        "indexer_scores forward+backward": (_scores_grad, (q_index, k_index, weights), 3 * index),
        "indexer_topk": (lambda q, k, w: indexer_topk(q, k, w, topk=N, block_t=128, **TPU),
                         (q_index, k_index, weights), index),
        "sparse_attention_target": (
            lambda q, l, i, s: sparse_attention_target(q, l, i, s, scale=SCALE, **TPU), (q, latent, indices, lse),
            2 * q_len * N * H * (C + R)),
        "dense_attention_target": (lambda q, l: dense_attention_target(q, l, scale=SCALE, block_t=128, **TPU),
                                   (q, latent), 2 * dense),
        # The sparse DSA stage's attention with its KL target: two kernels (two gathers) against one.
        "sparse_mla forward, then sparse_attention_target": (_attention_then_target, (q, latent, indices),
                                                             sparse_fwd + 2 * q_len * N * H * (C + R)),
        "sparse_mla_attention_with_target forward": (_attention_with_target, (q, latent, indices), sparse_fwd),
        "sparse_mla fwd+bwd, then sparse_attention_target": (_sparse_stage_grad(_attention_then_target),
                                                             (q, latent, indices),
                                                             sparse_fwd + sparse_bwd + 2 * q_len * N * H * (C + R)),
        "sparse_mla_attention_with_target fwd+bwd": (_sparse_stage_grad(_attention_with_target),
                                                     (q, latent, indices), sparse_fwd + sparse_bwd),
    }


def long_cases(q_len: int, k_len: int) -> dict:
    sds = jax.ShapeDtypeStruct
    causal_pairs = q_len * (k_len - q_len) + q_len * (q_len + 1) / 2
    dsa = (2 * q_len * N * H * ((C + R + C) + 3 * (C + R) + 2 * C)  # sparse MLA forward + backward
           + 2 * causal_pairs * I * J)  # indexer scores
    dense_fwd = 2 * causal_pairs * H * (QK_DENSE + V_DENSE)
    heads = sds((1, q_len, H, QK_DENSE), BF16)  # GLM-5's expanded q and k (192 + 64), v (256): all 256 wide
    dsa_args = (sds((1, q_len, H, C + R), BF16), sds((1, k_len, C + R), BF16), sds((1, q_len, I, J), BF16),
                sds((1, k_len, J), BF16), sds((1, q_len, I), F32))
    every_key_args = (heads, heads, sds((1, q_len, H, V_DENSE), BF16), *dsa_args)
    return {
        "DSA: indexer top-k + sparse MLA fwd+bwd": (_dsa_training, dsa_args, dsa),
        "DSA sparse stage, two kernels: top-k + sparse MLA fwd+bwd + KL target": (
            _dsa_sparse_stage(_attention_then_target), dsa_args, dsa + 2 * q_len * N * H * (C + R)),
        "DSA sparse stage, target fused: top-k + sparse MLA with target fwd+bwd": (
            _dsa_sparse_stage(_attention_with_target), dsa_args, dsa),
        **({} if k_len > N else {"DSA sparse stage, every key selected (S = T <= N): top-k + flash fwd+bwd + dense "
                                  "KL target": (_every_key_sparse_stage, every_key_args,
                                                3.5 * dense_fwd + 2 * causal_pairs * (I * J + 2 * H * (C + R)))}),
        "dense: flash attention fwd+bwd (causal)": (
            _flash_training, (sds((1, H, q_len, QK_DENSE), BF16), sds((1, H, k_len, QK_DENSE), BF16),
                              sds((1, H, k_len, V_DENSE), BF16)), 3.5 * dense_fwd),
    }


def measure(name: str, chip: str, case, sharding) -> Row:
    """Memory, matmul FLOPs and HBM bytes of the full-size compiled module (every loop trip counted)."""
    row = Row(name, chip, model_flops=case[2])
    try:
        compiled = _compile(case[0], case[1], sharding)
        memory = compiled.memory_analysis()
        row.vmem, row.hbm_temp = _vmem(compiled), memory.temp_size_in_bytes
        row.hbm_io = memory.argument_size_in_bytes + memory.output_size_in_bytes
        stats = hlo_stats(compiled.as_text(), 1)
        row.flops, row.bytes = stats.matmul_flops, stats.hbm_bytes
    except Exception as err:  # a compile failure is a result of this report
        row.error = str(err).splitlines()[0][:160]
    return row


def table(rows: list[Row], title: str) -> str:
    lines = [f"### {title}", "",
             "| kernel | chip | VMEM / kernel (KiB) | HBM args+out (MiB) | HBM temp (MiB) | GFLOP (counted) | "
             "GFLOP (model) | HBM GB | roofline (ms) | bound |",
             "| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | --- |"]
    for r in rows:
        if r.error:
            lines.append(f"| {r.name} | {r.chip} | compile failed: {r.error} ||||||||")
            continue
        seconds, bound = r.roofline()
        lines.append(f"| {r.name} | {r.chip} | {r.vmem / 1024:.0f} | {r.hbm_io / 2**20:.0f} | "
                     f"{r.hbm_temp / 2**20:.0f} | {r.flops / 1e9:.0f} | {r.model_flops / 1e9:.0f} | "
                     f"{r.bytes / 1e9:.1f} | {seconds * 1e3:.2f} | {bound} |")
    return "\n".join(lines)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--chips", nargs="+", default=["v5p", "v6e"], choices=sorted(HBM_BYTES_PER_S))
    parser.add_argument("--seq", type=int, default=4096, help="S = T of the per-kernel table (>= N = 2048)")
    parser.add_argument("--long", type=int, nargs="*", default=[65536],
                        help="S = T of the DSA vs dense comparisons (one table each; none to skip)")
    parser.add_argument("--skip-kernels", action="store_true", help="only the --long tables")
    args = parser.parse_args(argv)
    for name, value in [("--seq", args.seq)] + [("--long", n) for n in args.long]:
        if value < N or value % CHUNK:
            parser.error(f"{name} {value} is invalid: must be >= N = {N} and a multiple of {CHUNK}")
    started = time.time()
    print(f"jax {jax.__version__}, libtpu {_libtpu_version()}, chips {args.chips}; full-size modules, every loop "
          f"trip counted\n")
    kernels = [] if args.skip_kernels else [("Kernels at GLM-5 shapes, S = T = %d, bf16" % args.seq, kernel_cases,
                                             args.seq)]
    sections = kernels + [
        ("DSA vs dense attention, one layer's training step, S = T = %d" % n, long_cases, n) for n in args.long]
    for title, cases, length in sections:
        rows = []
        for chip in args.chips:
            sharding = NamedSharding(Mesh(get_topology(f"{chip}-8").devices()[:1], ("chip",)), PartitionSpec())
            for name, case in cases(length, length).items():
                rows.append(measure(name, chip, case, sharding))
                print(f"  compiled {name} for {chip} ({time.time() - started:.0f} s)", file=sys.stderr)
        print(table(rows, title) + "\n", flush=True)


def _libtpu_version() -> str:
    from importlib import metadata

    try:
        return metadata.version("libtpu")
    except metadata.PackageNotFoundError:
        return "not installed"


if __name__ == "__main__":
    main()
