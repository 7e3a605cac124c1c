"""Launch settings of the Triton DSA kernels on one GPU: the sparse MLA kernels' warps, pipeline stages, rows per step
and how their backward sums row gradients (per-slot rows + XLA scatter, or atomic adds in the kernel); the indexer
score kernel's keys per step and warps (`--indexer-candidates`); the sparse KL target's (`--target-candidates`).

The shipped settings (`mla_layout.kernel_warps`, `SPARSE_MLA_FORWARD_STAGES`, `SPARSE_MLA_BACKWARD_WARPS`, the
blocks of `gather_kernel_plan` and `backward_plan`) were chosen by this sweep on an H200 (BENCHMARKS.md). It
times the forward and forward+backward of one GLM-5 layer's sparse attention (H 64, C 512, R 64, N 2048, bf16,
S = T = --seq) under each candidate, checks each against the first candidate's (the shipped settings') output
and gradients on the same inputs, and times the backward's scatter-add of per-slot row gradients alone (the XLA
part of the backward). One JSON line per result.

  PYTHONPATH=. python benchmarks/gpu_kernel_sweep.py --out "$OUT/sweep.jsonl"          # on the GPU
  PYTHONPATH=. JAX_PLATFORMS=cpu python benchmarks/gpu_kernel_sweep.py --aot h200     # which candidates compile
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import time

import jax
import jax.numpy as jnp
from jax.experimental import topologies
from jax.sharding import Mesh, NamedSharding, PartitionSpec

import pallas_kernels.sparse_mla as sparse_mla_module
from benchmarks.gpu_kernels import (
    Recorder,
    attention_flops,
    relative_error,
    strided_causal_indices,
    sum_of_squares_grad,
    timed_ms,
)
from pallas_kernels import indexer_scores, indexer_topk, sparse_attention_target, sparse_mla_attention
from pallas_kernels._common import triton_params
from pallas_kernels.gpu_targets import gpu_target_config
from pallas_kernels.mla_layout import _scatter_add_rows

# The modules, not the package's functions of the same names.
indexer_module = importlib.import_module("pallas_kernels.indexer_topk")
target_module = importlib.import_module("pallas_kernels.indexer_kl_target")

# name -> (block_n, forward (warps, stages) or None for the shipped plan, backward (warps, stages) or None,
# row_gradients: how the backward sums row gradients, `sparse_mla_attention`'s argument).
# The first is what ships; the order is the order of interest, since the budget may stop the sweep. The
# backward at 2 stages is not among them: for H200 it asks 311,808 B of shared memory (232,448 there). The
# first sweep (2026-12-04, benchmarks/gpu_runs/2026-12-04_h200_run5_sweep.jsonl) shipped a forward at 8 warps and
# 2 stages and a backward at 8 warps; its winners, 1 stage and 4 warps, ship now.
CANDIDATES = {
    "shipped": (64, None, None, "scatter"),
    "bwd_atomic_rows": (64, None, None, "atomic"),
    "fwd_2_stages": (64, (8, 2), None, "scatter"),
    "bwd_8_warps": (64, None, (8, 1), "scatter"),
    "bwd_atomic_rows_8_warps": (64, None, (8, 1), "atomic"),
    "fwd_4_warps": (64, (4, 1), None, "scatter"),
    "bwd_2_warps": (64, None, (2, 1), "scatter"),
    "fwd_block_32_3_stages": (32, (8, 3), None, "scatter"),
    "fwd_block_128": (128, (8, 1), None, "scatter"),
    "fwd_16_warps": (64, (16, 1), None, "scatter"),
}
# The indexer's Triton score kernel (128 query-head rows x J 128 per program, keys streamed block_t at a time):
# name -> (block_t, warps); the first ships. Timed alone and inside the top-k, at the same S = T.
INDEXER_CANDIDATES = {
    "scores_shipped": (64, 4),
    "scores_8_warps": (64, 8),
    "scores_keys_128": (128, 4),
    "scores_keys_128_8_warps": (128, 8),
    "scores_keys_256_8_warps": (256, 8),
}
# The sparse KL target's Triton kernel (the DSA sparse stage's; it gathers rows like the sparse MLA forward):
# name -> (warps, pipeline stages or None for its plan's); the first ships.
TARGET_CANDIDATES = {
    "target_shipped": (8, None),
    "target_1_stage": (8, 1),
    "target_4_warps": (4, None),
}


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--seq", type=int, default=8192)
    parser.add_argument("--topk", type=int, default=2048)
    parser.add_argument("--heads", type=int, default=64)
    parser.add_argument("--candidates", default=",".join(CANDIDATES), help=f"from {', '.join(CANDIDATES)}")
    parser.add_argument("--indexer-candidates", default="", help="score kernel settings to time after the sparse "
                        f"MLA ones, from {', '.join(INDEXER_CANDIDATES)}")
    parser.add_argument("--target-candidates", default="", help="sparse KL target kernel settings to time last, "
                        f"from {', '.join(TARGET_CANDIDATES)}")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--budget-s", type=float, default=150.0, help="no candidate starts after this")
    parser.add_argument("--aot", default=None, help="compile for this GPU target (h100, h200) here, time nothing")
    parser.add_argument("--out", default=None)
    args = parser.parse_args(argv)
    unknown = [name for name in args.candidates.split(",") if name not in CANDIDATES]
    unknown += [name for name in filter(None, args.indexer_candidates.split(",")) if name not in INDEXER_CANDIDATES]
    unknown += [name for name in filter(None, args.target_candidates.split(",")) if name not in TARGET_CANDIDATES]
    if unknown:
        valid = [*CANDIDATES, *INDEXER_CANDIDATES, *TARGET_CANDIDATES]
        parser.error(f"unknown candidates {unknown}; valid: {', '.join(valid)}")
    return args


@contextlib.contextmanager
def launch_settings(forward, backward):
    """The kernels' Triton settings replaced inside the block: forward / backward (warps, stages) or None."""
    names = ("_forward_call", "_backward_call", "triton_params")
    originals = {name: getattr(sparse_mla_module, name) for name in names}
    active = []

    def tagged(which, settings):
        def call(*args, **kwargs):
            active.append(settings)
            try:
                return originals[which](*args, **kwargs)
            finally:
                active.pop()
        return call

    def params(*, num_warps, num_stages):
        if active and active[-1] is not None:
            num_warps, num_stages = active[-1]
        return triton_params(num_warps=num_warps, num_stages=num_stages)

    sparse_mla_module._forward_call = tagged("_forward_call", forward)
    sparse_mla_module._backward_call = tagged("_backward_call", backward)
    sparse_mla_module.triton_params = params
    try:
        yield
    finally:
        for name, fn in originals.items():
            setattr(sparse_mla_module, name, fn)


@contextlib.contextmanager
def kernel_launch(module, warps: int, stages: int | None = None):
    """A kernel module's Triton warps (and stages, unless None) replaced inside the block."""
    original = module.triton_params

    def params(*, num_warps, num_stages):
        return triton_params(num_warps=warps, num_stages=num_stages if stages is None else stages)

    module.triton_params = params
    try:
        yield
    finally:
        module.triton_params = original


def indexer_inputs(args):
    keys = jax.random.split(jax.random.key(args.seq + 1), 3)
    return (jax.random.normal(keys[0], (1, args.seq, 32, 128), jnp.bfloat16),
            jax.random.normal(keys[1], (1, args.seq, 128), jnp.bfloat16),
            jax.random.normal(keys[2], (1, args.seq, 32), jnp.float32))


def time_indexer_candidate(args, rec: Recorder, name: str, data, reference):
    """The causal index scores alone and the top-k (which runs the same kernel per query chunk) under one setting;
    returns the top-k's indices for the next candidates to compare with."""
    block_t, warps = INDEXER_CANDIDATES[name]
    jax.clear_caches()
    with kernel_launch(indexer_module, warps):
        scores = jax.jit(lambda a, b, c: indexer_scores(a, b, c, block_t=block_t)).lower(*data).compile()
        select = jax.jit(lambda a, b, c: indexer_topk(a, b, c, topk=args.topk, block_t=block_t)[0]
                         ).lower(*data).compile()
    scores_ms = timed_ms(scores, *data, repeats=args.repeats)
    topk_ms = timed_ms(select, *data, repeats=args.repeats)
    indices = select(*data)
    flops = 2 * args.seq * (args.seq + 1) / 2 * 32 * 128  # the causal half of the score tiles
    same = {} if reference is None else {"indices_equal_first": bool(jnp.all(indices == reference))}
    rec.emit(check="sweep_indexer", candidate=name, seq=args.seq, block_t=block_t, warps=warps,
             scores_ms=round(scores_ms, 3), scores_tflops=round(flops / scores_ms / 1e9, 1),
             topk_ms=round(topk_ms, 3), **same)
    return indices


def target_inputs(args, data):
    """The sparse MLA inputs and the lse of their forward, which the target kernel takes."""
    q, latent, indices = data
    lse = jax.jit(lambda a, b: sparse_mla_attention(a, b, indices, scale=576 ** -0.5, kv_lora_rank=512)[1])(q, latent)
    return q, latent, indices, lse


def time_target_candidate(args, rec: Recorder, name: str, data, reference):
    """The sparse KL target under one launch setting; returns it for the next candidates to compare with."""
    warps, stages = TARGET_CANDIDATES[name]
    jax.clear_caches()
    with kernel_launch(target_module, warps, stages):
        target = jax.jit(lambda q, l, i, s: sparse_attention_target(q, l, i, s, scale=576 ** -0.5)
                         ).lower(*data).compile()
    ms = timed_ms(target, *data, repeats=args.repeats)
    result = target(*data)
    same = {} if reference is None else {"target_vs_first": relative_error(result, reference)}
    rec.emit(check="sweep_target", candidate=name, seq=args.seq, warps=warps, stages=stages, target_ms=round(ms, 3),
             **same)
    return result


def inputs(args):
    keys = jax.random.split(jax.random.key(args.seq), 2)
    q = jax.random.normal(keys[0], (1, args.seq, args.heads, 576), jnp.bfloat16)
    latent = jax.random.normal(keys[1], (1, args.seq, 576), jnp.bfloat16)
    return q, latent, strided_causal_indices(args.seq, min(args.topk, args.seq))


def aot_sharding(target: str) -> NamedSharding:
    """Replicated on one compile-only `target` GPU described by the CUDA plugin (no GPU needed)."""
    devices = topologies.get_topology_desc(platform="cuda", target_config=gpu_target_config(target),
                                           topology="1x1x1").devices
    return NamedSharding(Mesh(devices[:1], ("gpu",)), PartitionSpec())


def compile_for(target: str, fn, shapes) -> float:
    """Seconds to lower and compile fn over abstract `shapes` (ShapeDtypeStructs) for `target`."""
    sharding = aot_sharding(target)
    args = [jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sharding) for x in shapes]
    start = time.perf_counter()
    with jax.default_device(sharding.mesh.devices.flat[0]):  # Triton kernels are built for the default device
        jax.jit(fn).trace(*args).lower().compile()
    return time.perf_counter() - start


def compile_only(args, rec: Recorder, name: str) -> None:
    """Compile the candidate's forward+backward for args.aot here (no GPU): does it fit?"""
    block_n, forward, backward, row_gradients = CANDIDATES[name]

    def loss(q, latent, indices):
        out = sparse_mla_attention(q, latent, indices, scale=576 ** -0.5, kv_lora_rank=512, block_n=block_n,
                                   platform="gpu", row_gradients=row_gradients)[0]
        return jnp.sum(jnp.square(out.astype(jnp.float32)))

    shapes = [jax.ShapeDtypeStruct((1, args.seq, args.heads, 576), jnp.bfloat16),
              jax.ShapeDtypeStruct((1, args.seq, 576), jnp.bfloat16),
              jax.ShapeDtypeStruct((1, args.seq, args.topk), jnp.int32)]
    with launch_settings(forward, backward):
        seconds = compile_for(args.aot, jax.grad(loss, argnums=(0, 1)), shapes)
    rec.emit(check="sweep_aot", target=args.aot, candidate=name, compiled=True, compile_s=round(seconds, 1))


def compile_target_only(args, rec: Recorder, name: str) -> None:
    """Compile the sparse KL target under a launch setting for args.aot here."""
    warps, stages = TARGET_CANDIDATES[name]
    shapes = [jax.ShapeDtypeStruct((1, args.seq, args.heads, 576), jnp.bfloat16),
              jax.ShapeDtypeStruct((1, args.seq, 576), jnp.bfloat16),
              jax.ShapeDtypeStruct((1, args.seq, args.topk), jnp.int32),
              jax.ShapeDtypeStruct((1, args.seq, args.heads), jnp.float32)]
    with kernel_launch(target_module, warps, stages):
        seconds = compile_for(args.aot, lambda q, l, i, s: sparse_attention_target(q, l, i, s, scale=576 ** -0.5,
                                                                                 platform="gpu"), shapes)
    rec.emit(check="sweep_aot", target=args.aot, candidate=name, compiled=True, compile_s=round(seconds, 1))


def compile_indexer_only(args, rec: Recorder, name: str) -> None:
    """Compile the indexer top-k under a score kernel setting for args.aot here."""
    block_t, warps = INDEXER_CANDIDATES[name]
    shapes = [jax.ShapeDtypeStruct(x.shape, x.dtype) for x in jax.eval_shape(lambda: indexer_inputs(args))]
    with kernel_launch(indexer_module, warps):
        seconds = compile_for(args.aot, lambda a, b, c: indexer_topk(a, b, c, topk=args.topk, block_t=block_t,
                                                                      platform="gpu"), shapes)
    rec.emit(check="sweep_aot", target=args.aot, candidate=name, compiled=True, compile_s=round(seconds, 1))


def time_candidate(args, rec: Recorder, name: str, data, reference) -> tuple:
    block_n, forward, backward, row_gradients = CANDIDATES[name]
    q, latent, indices = data

    def attend(a, b):
        return sparse_mla_attention(a, b, indices, scale=576 ** -0.5, kv_lora_rank=512, block_n=block_n,
                                    row_gradients=row_gradients)[0]

    jax.clear_caches()  # the settings are read while tracing: no trace of another candidate may be reused
    with launch_settings(forward, backward):
        fwd = jax.jit(attend).lower(q, latent).compile()
        grads = sum_of_squares_grad(attend).lower(q, latent).compile()
    fwd_ms = timed_ms(fwd, q, latent, repeats=args.repeats)
    all_ms = timed_ms(grads, q, latent, repeats=args.repeats)
    out, (dq, dlatent) = fwd(q, latent), grads(q, latent)
    triples = args.heads * float(jnp.sum(indices >= 0))
    flops_fwd, flops_all = attention_flops(triples, 512, 64)
    errors = {}
    if reference is not None:
        errors = {f"{what}_vs_first": relative_error(got, want)
                  for what, got, want in zip(("out", "dq", "dlatent"), (out, dq, dlatent), reference)}
    rec.emit(check="sweep", candidate=name, seq=args.seq, block_n=block_n, forward=forward, backward=backward,
             row_gradients=row_gradients,
             forward_ms=round(fwd_ms, 3), forward_tflops=round(flops_fwd / fwd_ms / 1e9, 1),
             fwd_bwd_ms=round(all_ms, 3), fwd_bwd_tflops=round(flops_all / all_ms / 1e9, 1), **errors)
    return out, dq, dlatent


def time_scatter(args, rec: Recorder, data) -> None:
    """The backward's XLA scatter-add of one query chunk's per-slot row gradients into fp32 d(latent), as
    `chunked_backward` runs it (sort, then a sorted scatter), times the number of chunks of the sequence."""
    q, latent, indices = data
    chunk = min(sparse_mla_module.backward_query_chunk(args.seq, indices.shape[-1], 2), args.seq)
    rows = indices[:, :chunk].reshape(1, -1)
    rows = jnp.where(rows >= 0, rows, args.seq)  # unused slots out of range, dropped (as chunked_backward does)
    values = jax.random.normal(jax.random.key(1), (1, rows.shape[1], 576), jnp.bfloat16)
    acc = jnp.zeros((1, args.seq, 576), jnp.float32)
    scatter = jax.jit(_scatter_add_rows).lower(acc, rows, values).compile()
    chunk_ms = timed_ms(scatter, acc, rows, values, repeats=args.repeats)
    rec.emit(check="sweep_scatter", seq=args.seq, query_chunk=chunk, chunk_ms=round(chunk_ms, 3),
             sequence_ms=round(chunk_ms * -(-args.seq // chunk), 2))


def time_group(args, rec: Recorder, start: float, check: str, names, timer, data) -> None:
    """Times each named candidate in turn, each compared with the group's first, until the budget is spent."""
    reference = None
    for name in names:
        if time.perf_counter() - start > args.budget_s:
            rec.emit(check=check, candidate=name, skipped="time budget spent")
            continue
        with rec.guard(check, candidate=name):
            result = timer(args, rec, name, data, reference)
            reference = result if reference is None else reference


def main(argv=None) -> None:
    args = parse_args(argv)
    rec = Recorder(args.out)
    start = time.perf_counter()
    names = args.candidates.split(",")
    indexer_names = list(filter(None, args.indexer_candidates.split(",")))
    target_names = list(filter(None, args.target_candidates.split(",")))
    if args.aot:
        for compile_one, group in ((compile_only, names), (compile_indexer_only, indexer_names),
                                   (compile_target_only, target_names)):
            for name in group:
                with rec.guard("sweep_aot", candidate=name):
                    compile_one(args, rec, name)
        return
    rec.emit(check="environment", jax=jax.__version__, device=jax.devices()[0].device_kind)
    data = inputs(args)
    time_group(args, rec, start, "sweep", names, time_candidate, data)
    with rec.guard("sweep_scatter"):
        time_scatter(args, rec, data)
    if indexer_names:
        time_group(args, rec, start, "sweep_indexer", indexer_names, time_indexer_candidate, indexer_inputs(args))
    if target_names:
        time_group(args, rec, start, "sweep_target", target_names, time_target_candidate, target_inputs(args, data))


if __name__ == "__main__":
    main()
