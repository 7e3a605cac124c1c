"""Causal attention of every head over every visible key, on NVIDIA GPUs: jax's Triton flash attention kernels
(`jax.experimental.pallas.ops.gpu.attention`) behind `flash_attention.causal_flash_attention`.

The GPU side of the TPU path in `flash_attention.py`: for layers whose top-k keeps every visible key and for the
dense warm-up, where the sparse MLA kernels would gather every visible latent row per query (O(S x T) row
reads), flash attention streams key blocks past query blocks in MLA's expanded form.

Inputs arrive in the kernels' layout: q, k, v [B, L, H, D] with one head dim D for all three (the caller pads
the smaller ones with zeros) and L a multiple of the blocks `triton_flash_plan` chose; segment_ids [B, L]. The
forward is jax's `mha`; the backward runs jax's fused dk/dv + dq kernel (`mha_backward_kernel`) through a
`pallas_call` of our own, with delta = rowsum(o * do) in XLA, so that each kernel declares its own cost (jax's
Triton lowering keeps none; `kernel_cost.declared_cost`): FLOPs of the blocks on or below the diagonal that the
kernels visit, at the head dim padded to a power of two as they compute it, and HBM bytes counting each key (or
query) block as often as it is re-read.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from pallas_kernels._common import next_power_of_two, triton_params
from pallas_kernels.kernel_cost import declared_cost
from pallas_kernels.shared_memory import fits

MIN_BLOCK = 16  # Triton's smallest dot tile
FORWARD_BLOCKS = ((128, 64), (64, 64), (64, 32), (32, 32), (16, 16))  # (query, key) blocks, tried in order
BACKWARD_BLOCKS = (64, 32, 16)  # one size for the fused backward's four blocks (its loops must tile alike)
FORWARD_STAGES = (2, 1)


@dataclasses.dataclass(frozen=True)
class TritonFlashPlan:
    batch: int
    heads: int
    length: int  # padded sequence, a multiple of block_q
    dim: int  # head dim of q, k and v as stored
    itemsize: int
    block_q: int
    block_k: int
    stages: int
    block_bwd: int

    @property
    def dim_padded(self) -> int:
        """The head dim the kernels' dots run at (jax's kernels mask loads past `dim`)."""
        return next_power_of_two(self.dim)

    def _rows(self, rows: int, width: int, itemsize: int) -> int:
        return self.batch * self.heads * rows * width * itemsize

    def forward_key_blocks(self) -> int:
        """Key blocks the forward visits per batch row and head: query block i those up to its last row."""
        per_query_block = self.block_q // self.block_k
        blocks = self.length // self.block_q
        return per_query_block * blocks * (blocks + 1) // 2

    def backward_pairs(self) -> int:
        """(query block, key block) pairs on or below the diagonal at the backward's block, per row and head."""
        blocks = self.length // self.block_bwd
        return blocks * (blocks + 1) // 2

    def forward_cost(self) -> tuple[int, int, int]:
        """q.k and p.v per visited tile; q read and o, lse written once, k and v read per visited tile."""
        tiles = self.batch * self.heads * self.forward_key_blocks()
        flops = tiles * 2 * (2 * self.block_q * self.block_k * self.dim_padded)
        streamed = 2 * self._rows(self.forward_key_blocks() * self.block_k, self.dim, self.itemsize)
        once = 2 * self._rows(self.length, self.dim, self.itemsize) + self._rows(self.length, 1, 4)
        return flops, streamed + once, tiles * self.block_q * self.block_k

    def backward_cost(self) -> tuple[int, int, int]:
        """The fused kernel: per key block its q, do, lse and delta rows of every later query block (4 dots per
        pair), then per query block the k and v rows of every earlier key block (3 dots); k, v, q and do read
        once more and dq, dk, dv written."""
        pairs = self.batch * self.heads * self.backward_pairs()
        tile = self.block_bwd * self.block_bwd
        flops = pairs * 7 * 2 * tile * self.dim_padded
        per_pair = self.block_bwd * (4 * self.dim * self.itemsize + 2 * 4)
        once = 7 * self._rows(self.length, self.dim, self.itemsize)
        return flops, pairs * per_pair + once, pairs * 2 * tile


def _forward_bytes(dim: int, itemsize: int, block_q: int, block_k: int, stages: int) -> int:
    """Shared memory of the forward, an upper bound: the q tile and `stages` buffers of the k and v tiles."""
    return itemsize * dim * (block_q + 2 * stages * block_k)


def _backward_bytes(dim: int, itemsize: int, block: int) -> int:
    """Shared memory of the fused backward, an upper bound: resident k, v (or q, do) tiles and two pipelined
    buffers of the streamed pair, plus the statistics rows (16 KiB margin)."""
    return itemsize * dim * 6 * block + 16 * 1024


def triton_flash_plan(batch: int, seq: int, heads: int, dim: int, itemsize: int,
                      shared_memory: int | None = None) -> TritonFlashPlan:
    """Blocks and stages that fit the GPU's shared memory per block (`shared_memory`, bytes; default: the
    default target's), largest first; the sequence padded to a multiple of the query block (at least 16)."""
    padded_dim = next_power_of_two(dim)
    limit = dict(limit=shared_memory)
    block_q, block_k, stages = next(
        ((q, k, s) for q, k in FORWARD_BLOCKS for s in FORWARD_STAGES
         if fits(_forward_bytes(padded_dim, itemsize, q, k, s), **limit)),
        (MIN_BLOCK, MIN_BLOCK, 1))
    block_bwd = next((b for b in BACKWARD_BLOCKS if fits(_backward_bytes(padded_dim, itemsize, b), **limit)),
                     MIN_BLOCK)
    # A short sequence keeps its blocks no larger than itself, rounded up to a power of two of at least 16.
    cap = next_power_of_two(seq, MIN_BLOCK)
    block_q, block_k, block_bwd = min(block_q, cap), min(block_k, cap), min(block_bwd, cap)
    length = -(-seq // block_q) * block_q
    return TritonFlashPlan(batch, heads, length, dim, itemsize, block_q, block_k, stages, block_bwd)


def _attention_module():
    # Imported on use: only the GPU path needs jax's Triton attention module.
    from jax.experimental.pallas.ops.gpu import attention

    return attention


def _forward(q, k, v, segments, scale, plan, interpret):
    attention = _attention_module()
    blocks = attention.BlockSizes(block_q=plan.block_q, block_k=plan.block_k)
    with declared_cost(*plan.forward_cost()):
        return attention.mha(q, k, v, segments, sm_scale=scale, causal=True, block_sizes=blocks,
                             num_stages=plan.stages, interpret=interpret, return_residuals=True)


@functools.partial(jax.custom_vjp, nondiff_argnums=(4, 5, 6))
def triton_flash(q, k, v, segments, scale, plan, interpret):
    """softmax(scale * q.k) v over the keys each query sees (causal within its segment), [B, L, H, D]."""
    return _forward(q, k, v, segments, scale, plan, interpret)[0]


def _flash_fwd(q, k, v, segments, scale, plan, interpret):
    out, lse = _forward(q, k, v, segments, scale, plan, interpret)
    return out, (q, k, v, segments, out, lse)


def _flash_bwd(scale, plan, interpret, residuals, d_out):
    attention = _attention_module()
    q, k, v, segments, out, lse = residuals
    # A row sum, not a contraction: XLA would count an einsum's [D] products as matmul FLOPs.
    delta = jnp.swapaxes(jnp.sum(out.astype(jnp.float32) * d_out.astype(jnp.float32), axis=-1), 1, 2)
    block, length, dim = plan.block_bwd, plan.length, plan.dim_padded
    rows = lambda b, h, _: (b, 0, h, 0)  # noqa: E731  a whole [L, D] slab of one batch row and head
    stats = pl.BlockSpec((None, None, length), lambda b, h, _: (b, h, 0))
    tile = lambda b, h, i: (b, i, h, 0)  # noqa: E731  the i-th block of rows
    kernel = functools.partial(attention.mha_backward_kernel, sm_scale=scale, causal=True, block_q_dkv=block,
                               block_kv_dkv=block, block_q_dq=block, block_kv_dq=block, head_dim=plan.dim)
    with declared_cost(*plan.backward_cost()):
        dq, dk, dv = pl.pallas_call(
            kernel,
            grid=(plan.batch, plan.heads, length // block),
            in_specs=[*(pl.BlockSpec((None, length, None, dim), rows) for _ in range(3)),
                      pl.BlockSpec((None, length), lambda b, h, _: (b, 0)),
                      *(pl.BlockSpec((None, length, None, dim), rows) for _ in range(2)), stats, stats],
            out_specs=[pl.BlockSpec((None, block, None, dim), tile) for _ in range(3)],
            out_shape=[jax.ShapeDtypeStruct(x.shape, x.dtype) for x in (q, k, v)],
            compiler_params=triton_params(num_warps=4 if block < 128 else 8, num_stages=2),
            interpret=interpret,
            name="mha_backward",
        )(q, k, v, segments, out, d_out.astype(out.dtype), lse, delta)
    return dq, dk, dv, None


triton_flash.defvjp(_flash_fwd, _flash_bwd)
