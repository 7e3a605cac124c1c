"""The dense KL target from flash attention's own statistics (Mosaic, TPU): where the top-k keeps every visible
key, the indexer KL's target is the head mean of the main attention's probabilities over all of them,

    target[s, t] = (1 / H) sum_h exp(scale * q_h[s] . k_h[t] - lse_h[s])   (t visible to s, else 0),

and the flash forward kernel already computed each (head, query) row's lse (`tpu_flash_attention`). So one pass over the
expanded-form queries and keys the flash kernel read ([B, H, L, K]) gives the target: no online softmax, and no
absorbed-form queries ([B, S, H, C+R], padded and copied for the latent-row kernels of `tpu_indexer`).

Grid (B, L / block, L / block, H / heads_per_step): a program computes one [block, block] tile of the target for
a group of heads, accumulating the head sum in VMEM across the last grid axis, and writes it at the last group.
The tile is computed keys-major ([block_t, block_s]: key rows, query lanes), so each head's lse row [1, block_s]
broadcasts along sublanes with no relayout; it is transposed once when written. Tiles above the diagonal are
written as zeros without a matmul, and their index maps repeat the last visible tile's blocks, so no DMA fetches
them. Causality and segments follow the flash kernel's: key t is visible to query s iff t <= s and their
segment ids are equal.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from pallas_kernels._common import dot_nt, tpu_interpret

# Heads per grid step: 4 heads' [512, 256] bf16 query and key blocks, double-buffered, plus the fp32 tile, its
# accumulator and temporaries stay near 10 MiB of VMEM (v5p's scoped default is 16).
HEADS_PER_STEP = 4


def _last_visible_block(i):
    """The last key block query block i sees (blocks are square, positions are the rows' indices)."""
    return i


def _target_kernel(q_ref, k_ref, lse_ref, q_seg_ref, k_seg_ref, out_ref, acc_ref, *, scale, heads):
    block = out_ref.shape[0]
    i, t, group = pl.program_id(1), pl.program_id(2), pl.program_id(3)

    @pl.when(group == 0)
    def _():
        acc_ref[...] = jnp.zeros(acc_ref.shape, jnp.float32)

    @pl.when(t <= _last_visible_block(i))
    def _():
        k_pos = t * block + lax.broadcasted_iota(jnp.int32, (block, block), 0)
        q_pos = i * block + lax.broadcasted_iota(jnp.int32, (block, block), 1)
        visible = (k_pos <= q_pos) & (k_seg_ref[...] == q_seg_ref[...])  # [block_t, 1] vs [1, block_s]

        def head(h, acc):
            logits = dot_nt(k_ref[h], q_ref[h]) * scale  # [block_t, block_s]
            return acc + jnp.where(visible, jnp.exp(logits - lse_ref[h]), 0.0)

        acc_ref[...] += lax.fori_loop(0, q_ref.shape[0], head, jnp.zeros((block, block), jnp.float32))

    @pl.when(group == pl.num_programs(3) - 1)
    def _():
        out_ref[...] = jnp.transpose(acc_ref[...]) / heads


def flash_target_cost(batch: int, heads: int, length: int, dim: int, block: int, itemsize: int):
    """(flops, bytes, transcendentals) of `tpu_flash_target`: per tile on or below the diagonal, each head's
    [block, K] query and key blocks and their [block, block] logits and exps; the lse rows and segment ids with
    them; the whole [L, L] fp32 target written."""
    blocks = length // block
    tiles = batch * blocks * (blocks + 1) // 2
    per_tile_head = 2 * block * dim * itemsize + block * 4
    flops = tiles * heads * 2 * block * block * dim
    bytes_accessed = tiles * (heads * per_tile_head + 2 * block * 4) + batch * length * length * 4
    return flops, bytes_accessed, tiles * heads * block * block


def tpu_flash_target(q, k, lse, segments, *, scale: float, block: int, interpret: bool = False):
    """q, k [B, H, L, K] (the flash kernel's padded operands), lse [B, H, L] fp32 (its per-row log-sum-exp of
    scale * q.k over the visible keys), segments [B, L] int32 -> fp32 [B, L, L], the head-mean probabilities
    (zero where t is not visible to s). L a multiple of `block`, itself a multiple of 128."""
    batch, heads, length, dim = q.shape
    per_step = HEADS_PER_STEP if heads % HEADS_PER_STEP == 0 else heads
    last_group = heads // per_step - 1

    def group_of(i, t, g):  # past the diagonal: the last visible tile's group, so its blocks are not re-fetched
        return jnp.where(t <= _last_visible_block(i), g, last_group)

    def head_spec(rows):
        return pl.BlockSpec((None, per_step, rows, dim), lambda b, i, t, g: (b, group_of(i, t, g), i, 0))

    in_specs = [
        head_spec(block),
        pl.BlockSpec((None, per_step, block, dim),
                     lambda b, i, t, g: (b, group_of(i, t, g), jnp.minimum(t, _last_visible_block(i)), 0)),
        pl.BlockSpec((None, per_step, 1, block), lambda b, i, t, g: (b, group_of(i, t, g), 0, i)),
        pl.BlockSpec((None, 1, block), lambda b, i, t, g: (b, 0, i)),
        pl.BlockSpec((None, block, 1), lambda b, i, t, g: (b, jnp.minimum(t, _last_visible_block(i)), 0)),
    ]
    out_shape = jax.ShapeDtypeStruct((batch, length, length), jnp.float32)
    call = pl.pallas_call(
        functools.partial(_target_kernel, scale=float(scale), heads=heads),
        grid=(batch, length // block, length // block, heads // per_step),
        in_specs=in_specs,
        out_specs=pl.BlockSpec((None, block, block), lambda b, i, t, g: (b, i, t)),
        out_shape=out_shape,
        scratch_shapes=[pltpu.VMEM((block, block), jnp.float32)],
        compiler_params=pltpu.CompilerParams(
            dimension_semantics=("parallel", "parallel", "parallel", "arbitrary")),
        cost_estimate=pl.CostEstimate(**dict(zip(
            ("flops", "bytes_accessed", "transcendentals"),
            flash_target_cost(batch, heads, length, dim, block, q.dtype.itemsize)))),
        interpret=tpu_interpret(interpret),
    )
    segments = segments.astype(jnp.int32)
    return call(q, k, lse[:, :, None, :], segments[:, None, :], segments[:, :, None])
