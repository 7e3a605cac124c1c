"""Every Triton (GPU) entry point, forward and backward, compiled ahead of time for H100 and H200 by XLA's GPU
compiler and its Triton compiler, on a machine without a GPU (the CUDA plugin describes the device from
`pallas_kernels/gpu_targets`). Interpret mode runs none of Triton's compiler, so shared-memory limits, tile
layouts and unsupported ops show up only here. Each compiled module must hold the expected Pallas Triton
kernels and no Mosaic kernel, and each kernel's shared memory (as Triton allocates it) must fit the device.

Compiled: GLM-5's shapes (H 64, C 512, R 64, N 2048, indexer 32 x 128, flash attention's head dims 256) in bf16
for H100 (for H200 the sparse MLA backward, the kernel nearest the shared-memory limit), and the
interpret tests' kind of small odd shapes in fp32 and bf16 for H100 (H200 has the same SM and shared memory,
so its kernels are the same), and fp32 at GLM-5's shapes for H100, where the row and key blocks shrink to fit.
Not the sparse MLA backward in fp32 at GLM-5's shapes: its resident fp32 queries and output gradient alone
(272 KiB) exceed the 227 KiB per block; nor the top-k, whose fp32 scores kernel is `indexer_scores`'s.

Each kernel must also declare its cost (`kernels_without_cost` of `glm5_jax.parallel.hlo_stats` empty), and the
FLOPs it declares must equal the hand count below: 2 per multiply-add of its dots at its padded sizes, over the
blocks its grid visits (causal skipping included)."""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import pytest
from gpu_compile import lower_for, require_cuda_plugin, triton_kernel_names, triton_shared_memory

from glm5_jax.parallel.hlo_stats import hlo_stats
from pallas_kernels import (
    causal_flash_attention,
    dense_attention_target,
    indexer_scores,
    indexer_topk,
    sparse_attention_target,
    sparse_mla_attention,
)
from pallas_kernels.gpu_flash_attention import triton_flash_plan
from pallas_kernels.indexer_kl_target import dense_target_plan
from pallas_kernels.indexer_topk import scores_plan
from pallas_kernels.mla_layout import MlaLayout
from pallas_kernels.shared_memory import shared_memory_limit


@dataclasses.dataclass(frozen=True)
class Shapes:
    batch: int
    q_len: int
    k_len: int
    heads: int
    latent_dim: int  # C
    rope_dim: int  # R
    slots: int  # N
    block_n: int
    bwd_query_chunk: int
    index_heads: int  # I
    index_dim: int  # J
    block_t: int
    qk_dim: int  # the expanded form's per-head key (nope + rope) and value dims, for flash attention
    v_dim: int


# GLM-5 at its training sequence length; the kernels' grids grow with S, their programs do not.
GLM5 = Shapes(batch=1, q_len=4096, k_len=4096, heads=64, latent_dim=512, rope_dim=64, slots=2048, block_n=64,
              bwd_query_chunk=256, index_heads=32, index_dim=128, block_t=64, qk_dim=256, v_dim=256)
# Odd sizes as in the interpret tests: padded heads, C, R, N, I, J; N not a multiple of block_n; T of block_t.
SMALL = Shapes(batch=2, q_len=9, k_len=40, heads=4, latent_dim=24, rope_dim=8, slots=20, block_n=16,
               bwd_query_chunk=4, index_heads=3, index_dim=24, block_t=16, qk_dim=12, v_dim=8)


def entry_points(shape: Shapes, dtype) -> dict:
    """name: (function, abstract arguments, Pallas Triton kernels in its compiled module)."""
    b, s, t, h = shape.batch, shape.q_len, shape.k_len, shape.heads
    width, ih, ij = shape.latent_dim + shape.rope_dim, shape.index_heads, shape.index_dim
    sds = jax.ShapeDtypeStruct
    q, latent = sds((b, s, h, width), dtype), sds((b, t, width), dtype)
    indices, lse = sds((b, s, shape.slots), jnp.int32), sds((b, s, h), jnp.float32)
    q_index, k_index, weights = sds((b, s, ih, ij), dtype), sds((b, t, ij), dtype), sds((b, s, ih), jnp.float32)
    q_seg, k_seg = sds((b, s), jnp.int32), sds((b, t), jnp.int32)
    compiled = dict(platform="gpu", interpret=False)
    scale = width**-0.5
    attention = functools.partial(sparse_mla_attention, scale=scale, kv_lora_rank=shape.latent_dim,
                                  block_n=shape.block_n, bwd_query_chunk=shape.bwd_query_chunk, **compiled)
    masks = lambda qs, ks: dict(q_segment_ids=qs, k_segment_ids=ks, q_offset=t - s)  # noqa: E731

    def attention_loss(q, latent, indices, **options):  # gradients through out and lse
        out, lse = attention(q, latent, indices, **options)
        return jnp.sum(out.astype(jnp.float32)) + jnp.sum(jnp.sin(lse))

    def atomic_attention_loss(q, latent, indices):
        return attention_loss(q, latent, indices, row_gradients="atomic")

    def scores(q, k, w, qs, ks):
        return indexer_scores(q, k, w, block_t=shape.block_t, **masks(qs, ks), **compiled)

    def scores_loss(q, k, w, qs, ks):
        return jnp.sum(jnp.sin(scores(q, k, w, qs, ks)))

    def topk(q, k, w, qs, ks):
        return indexer_topk(q, k, w, topk=shape.slots, block_t=shape.block_t, **masks(qs, ks), **compiled)

    def sparse_target(q, latent, indices, lse):
        return sparse_attention_target(q, latent, indices, lse, scale=scale, block_n=shape.block_n, **compiled)

    def dense_target(q, latent, qs, ks):
        return dense_attention_target(q, latent, scale=scale, block_t=shape.block_t, **masks(qs, ks), **compiled)

    def flash_loss(q, k, v, segments):
        return jnp.sum(jnp.sin(causal_flash_attention(q, k, v, segments, scale=scale, **compiled)))

    grad = lambda fn, n: jax.grad(fn, argnums=tuple(range(n)))  # noqa: E731
    flash_q, flash_v = sds((b, s, h, shape.qk_dim), dtype), sds((b, s, h, shape.v_dim), dtype)
    index_args = (q_index, k_index, weights, q_seg, k_seg)
    return {
        "sparse_mla_forward": (attention, (q, latent, indices), 1),
        "sparse_mla_backward": (grad(attention_loss, 2), (q, latent, indices), 2),  # forward + backward kernel
        "sparse_mla_backward_atomic": (grad(atomic_attention_loss, 2), (q, latent, indices), 2),
        "indexer_scores": (scores, index_args, 1),
        "indexer_scores_with_backward": (grad(scores_loss, 3), index_args, 1),  # jnp backward
        "indexer_topk": (topk, index_args, len(_topk_bands(shape))),  # one scores kernel per causal band
        "sparse_attention_target": (sparse_target, (q, latent, indices, lse), 1),
        "dense_attention_target": (dense_target, (q, latent, q_seg, k_seg), 1),  # both passes in one program
        "flash_attention": (grad(flash_loss, 3), (flash_q, flash_q, flash_v, q_seg), 2),  # forward + backward
    }


def _pow2(n: int, minimum: int = 1) -> int:
    return max(minimum, 1 << (n - 1).bit_length())


def _round_up(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple


def _causal_tiles(first: int, queries: int, block_s: int, block_t: int, key_blocks: int) -> int:
    """Key blocks visited by the query blocks of `queries` queries at positions first, first + 1, ...: each
    block visits those up to its last query's position."""
    return sum(min(key_blocks, (first + min(start + block_s, queries) - 1) // block_t + 1)
               for start in range(0, queries, block_s))


def _topk_bands(shape: Shapes) -> list[tuple[int, int, int]]:
    """(first query, queries, keys) of indexer_topk's bands: its query chunks of 256 (rounded to block_s) grouped
    into at most 8 bands of whole chunks (a divisor of their count), each scoring the keys up to its last query;
    one band of every key where the first would already see them all."""
    b, s, t = shape.batch, shape.q_len, shape.k_len
    block_s = max(1, 128 // _pow2(shape.index_heads))
    chunk = _round_up(min(256, s), block_s)
    chunks = -(-s // chunk)
    count = max(d for d in range(1, min(chunks, 8) + 1) if chunks % d == 0)
    length = chunks // count * chunk
    if (t - s) + length >= t:
        return [(0, s, t)]
    return [(i * length, min(length, s - i * length), min(t, (t - s) + (i + 1) * length)) for i in range(count)]


def expected_kernel_flops(shape: Shapes, dtype, name: str) -> int:
    """Matmul FLOPs of the Pallas kernels of one entry point, counted by hand from what each program computes."""
    b, s, t = shape.batch, shape.q_len, shape.k_len
    heads, c_dim, r_dim = _pow2(shape.heads, 16), _pow2(shape.latent_dim, 16), _pow2(shape.rope_dim, 16)
    slots = _round_up(shape.slots, shape.block_n)
    # Sparse MLA, per query: scores H x N x (C+R) and values H x N x C; backward: scores, do.v (C), dq (C+R),
    # key row gradients (C+R) and value row gradients (C). The backward runs in query chunks, one compiled call
    # for all: the padding queries of the last chunk select nothing, so each call declares the real queries'
    # row blocks spread evenly over the calls, rounded up.
    forward = b * s * 2 * heads * slots * (2 * c_dim + r_dim)
    blocks, calls = slots // shape.block_n, -(-s // min(shape.bwd_query_chunk, s))
    if name == "sparse_mla_backward_atomic":  # one call over the whole sequence
        calls = 1
    backward = b * calls * -(-s * blocks // calls) * shape.block_n * 2 * heads * (5 * c_dim + 3 * r_dim)
    # Indexer: block_s queries x I heads per program, J wide, against each visited block of keys.
    index_heads, index_dim = _pow2(shape.index_heads), _pow2(shape.index_dim, 16)
    block_s = max(1, 128 // index_heads)
    itemsize = jnp.dtype(dtype).itemsize
    block_t = scores_plan(block_s * index_heads, index_dim, itemsize, shape.block_t)[0]
    key_blocks = _round_up(t, block_t) // block_t
    per_tile = 2 * block_s * index_heads * block_t * index_dim
    scores = b * _causal_tiles(t - s, s, block_s, block_t, key_blocks) * per_tile
    # indexer_topk: a band's query chunks share one compiled call; each declares the band's mean.
    chunk = _round_up(min(256, s), block_s)
    topk = 0
    for first, queries, keys in _topk_bands(shape):
        calls = -(-queries // chunk)
        tiles = _causal_tiles(t - s + first, queries, block_s, block_t, _round_up(keys, block_t) // block_t)
        topk += b * calls * -(-tiles // calls) * per_tile
    # Targets: a 2^k + rest split of the row (576 -> 512 + 64); the dense one makes two passes over its keys.
    width = shape.latent_dim + shape.rope_dim
    main = 1 << (width.bit_length() - 1)
    split = main // 2 if main == width else main
    target_c, target_r = _pow2(split, 16), _pow2(width - split, 16)
    sparse_target = b * s * 2 * heads * slots * (target_c + target_r)
    dense_s = max(1, 64 // heads)
    layout = MlaLayout(heads=shape.heads, latent_dim=split, rope_dim=width - split, num_slots=1, block_n=16)
    dense_t = dense_target_plan(dense_s * heads, layout, itemsize, shape.block_t)[0]
    dense = 2 * b * _causal_tiles(t - s, s, dense_s, dense_t, _round_up(t, dense_t) // dense_t) * (
        2 * dense_s * heads * dense_t * (target_c + target_r))
    # Flash attention (self-attention over S): query block i visits the key blocks up to its last row, with its
    # dots at the head dim padded to a power of two; the fused backward visits each pair of its (square) blocks
    # on or below the diagonal twice, 4 dots for dk / dv and 3 for dq.
    plan = triton_flash_plan(b, s, shape.heads, max(shape.qk_dim, shape.v_dim), itemsize)
    flash_dim, query_blocks = _pow2(plan.dim), plan.length // plan.block_q
    key_blocks = sum((i + 1) * plan.block_q // plan.block_k for i in range(query_blocks))
    flash = b * shape.heads * key_blocks * 2 * 2 * plan.block_q * plan.block_k * flash_dim
    bwd_blocks = plan.length // plan.block_bwd
    flash += b * shape.heads * bwd_blocks * (bwd_blocks + 1) // 2 * 7 * 2 * plan.block_bwd ** 2 * flash_dim
    return {"flash_attention": flash, "sparse_mla_forward": forward, "sparse_mla_backward": forward + backward,
            "sparse_mla_backward_atomic": forward + backward, "indexer_scores": scores,
            "indexer_scores_with_backward": scores, "indexer_topk": topk, "sparse_attention_target": sparse_target,
            "dense_attention_target": dense}[name]


SHAPES = {"glm5": GLM5, "small": SMALL}
DTYPES = {"bf16": jnp.bfloat16, "fp32": jnp.float32}
NAMES = sorted(entry_points(SMALL, jnp.float32))


def _params():
    # The backward that adds row gradients atomically: at GLM-5 for H200, and at odd sizes (padded rows, the
    # spare row of invalid slots) in fp32. H200 has H100's SM and shared memory per block (test_shared_memory.py):
    # its Triton kernels are H100's, so only this one, as close to the limit as the scattering backward (212,992
    # bytes both), is compiled for it here (and every kernel of the training step, for an H200 cluster, in
    # tests/parallel/test_compile_cli.py).
    for target, shape, dtype in (("h200", "glm5", "bf16"), ("h100", "small", "fp32")):
        name = "sparse_mla_backward_atomic"
        yield pytest.param(target, shape, dtype, name, id=f"{target}-{shape}-{dtype}-{name}")
    for name in (name for name in NAMES if name != "sparse_mla_backward_atomic"):
        yield pytest.param("h100", "glm5", "bf16", name, id=f"h100-glm5-bf16-{name}")
        # fp32: its blocks shrink to fit (see module docstring). Not the top-k: its scores kernel is
        # indexer_scores's, compiled in fp32 here, and its causal bands are compiled in bf16 (8 kernels, 67 s).
        if name not in ("sparse_mla_backward", "indexer_topk"):
            yield pytest.param("h100", "glm5", "fp32", name, id=f"h100-glm5-fp32-{name}")
        for dtype in DTYPES if name != "flash_attention" else ("fp32",):  # jax's kernels: odd sizes once
            yield pytest.param("h100", "small", dtype, name, id=f"h100-small-{dtype}-{name}")


@pytest.mark.slow
@pytest.mark.gpu_aot
@pytest.mark.parametrize("target,shape,dtype,name", list(_params()))
def test_triton_kernel_compiles_for_gpu(target, shape, dtype, name):
    require_cuda_plugin()
    fn, args, kernels = entry_points(SHAPES[shape], DTYPES[dtype])[name]
    lowered = lower_for(fn, args, target)
    text = lowered.compile().as_text()
    names = triton_kernel_names(text)
    assert len(names) == kernels, names
    assert "tpu_custom_call" not in text and "mosaic_gpu" not in text
    # The atomic backward sums the row gradients in its kernel: no per-slot rows for XLA to scatter.
    assert (" scatter(" in text) == (name == "sparse_mla_backward"), name
    stats = hlo_stats(text, 1)
    assert stats.kernels_without_cost == {}
    assert stats.kernel_flops == expected_kernel_flops(SHAPES[shape], DTYPES[dtype], name)
    if name != "indexer_scores_with_backward":  # its backward is jnp matmuls outside the kernel
        assert stats.matmul_flops == stats.kernel_flops
    shared_memory = triton_shared_memory(lowered)
    assert len(shared_memory) == len(set(names)), shared_memory  # by kernel name
    assert max(shared_memory.values()) <= shared_memory_limit(target), shared_memory
