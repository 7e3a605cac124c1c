"""Causal flash attention on TPU (Mosaic) whose statistics stay one fp32 number per (head, query) row in HBM.

jax's kernels (`jax.experimental.pallas.ops.tpu.flash_attention`) keep l, m and di as 128-lane rows in HBM: the
forward writes two [B, H, L, 128] fp32 arrays (as large as its bf16 output at head dim 256), the backward
broadcasts them back to 128 lanes (di to the key block), copies them into the kernels' layout and re-reads
them with every block pair: ~145 GB of the v6e-256 step's 2.58 TB of HBM traffic (benchmarks/BENCHMARKS.md,
issue 24). Here the forward writes the log-sum-exp lse = m + log l as [B, H, 1, L] (queries on lanes), the
backward reads lse and di = rowsum(o * do) in that form, and every kernel computes its tiles keys-major
([block_k, block_q]: key rows, query lanes), so a query block's lse or di row broadcasts along sublanes with no
relayout. The forward runs queries-major (its online softmax reduces over keys along lanes) and transposes its
lse column once per query block.

Blocks are square (block_q = block_k = `block`): query block i sees key blocks 0..i. Steps past the diagonal
(forward and dq: key blocks after i; dk/dv: query blocks before t) compute nothing and their index maps repeat a
visible block, so no DMA fetches them. Key t is visible to query s iff t <= s and their segment ids are equal
(padding tokens carry their own id: they see only each other, and every row sees itself, so no row is empty).

  forward: grid (B, H, L / block, L / block), online softmax in VMEM; o [B, H, L, D], lse [B, H, 1, L]
  dk, dv:  grid (B, H, key blocks, query blocks): p^T = exp(s^T - lse), dv += p^T do, ds^T = p^T (dp^T - di),
           dk += ds^T q
  dq:      grid (B, H, query blocks, key blocks): the same p^T and ds^T, dq += (ds^T)^T k

Where one head's whole dq fits in VMEM as fp32 ([L, D]: at most FUSED_DQ_BYTES, 2048 tokens at D 256 and
below), the backward is one kernel: the dk/dv kernel's steps also add (ds^T)^T k into that head's dq, written once
after its last step, so p^T and ds^T are computed once instead of twice (5 matmuls per block pair instead of 7)
and the dq kernel's reads of q, k, v and do go too. dq's sum over key blocks runs in the same order either way.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from pallas_kernels._common import dot_nn, dot_nt, dot_tn, tpu_interpret

# A finite "minus infinity" (jax's choice): a row with no visible key in a block keeps exp(mask - mask) = 1 there
# until its first visible key, whose rescaling factor exp(mask - m) = 0 then clears it.
MASK_VALUE = -0.7 * float(jnp.finfo(jnp.float32).max)
LANES = 128
# One head's fp32 dq accumulator the fused backward keeps in VMEM, at most: 4 MiB (L x D = 4096 x 256), which with
# the dq block written back (double-buffered) and the streamed tiles stays within v5p's default 16 MiB.
FUSED_DQ_BYTES = 4 * 2**20


def _visible(rows_block, cols_block, block: int, row_is_key: bool, row_seg, col_seg):
    """[block, block] visibility of a tile whose rows are block `rows_block` and columns block `cols_block` (grid
    indices) of the sequence (keys-major when `row_is_key`)."""
    rows = rows_block * block + lax.broadcasted_iota(jnp.int32, (block, block), 0)
    cols = cols_block * block + lax.broadcasted_iota(jnp.int32, (block, block), 1)
    causal = rows <= cols if row_is_key else cols <= rows
    return causal & (row_seg == col_seg)


def _flash_forward_kernel(q_seg_ref, k_seg_ref, q_ref, k_ref, v_ref, o_ref, lse_ref, m_ref, l_ref, acc_ref, *, scale):
    block = q_ref.shape[0]
    i, t = pl.program_id(2), pl.program_id(3)

    @pl.when(t == 0)
    def _():
        m_ref[...] = jnp.full(m_ref.shape, MASK_VALUE, jnp.float32)
        l_ref[...] = jnp.zeros(l_ref.shape, jnp.float32)
        acc_ref[...] = jnp.zeros(acc_ref.shape, jnp.float32)

    @pl.when(t <= i)
    def _():
        s = dot_nt(q_ref[...], k_ref[...]) * scale  # [block_q, block_k]
        s = jnp.where(_visible(i, t, block, False, q_seg_ref[...], k_seg_ref[...]), s, MASK_VALUE)
        m_prev = m_ref[:, :1]  # [block_q, 1]
        m_next = jnp.maximum(m_prev, jnp.max(s, axis=1, keepdims=True))
        p = jnp.exp(s - m_next)
        alpha = jnp.exp(m_prev - m_next)
        l_ref[...] = jnp.broadcast_to(alpha * l_ref[:, :1] + jnp.sum(p, axis=1, keepdims=True), l_ref.shape)
        m_ref[...] = jnp.broadcast_to(m_next, m_ref.shape)
        acc_ref[...] = acc_ref[...] * alpha + dot_nn(p.astype(v_ref.dtype), v_ref[...])

    @pl.when(t == i)
    def _():
        o_ref[...] = (acc_ref[...] / l_ref[:, :1]).astype(o_ref.dtype)
        lse = m_ref[...] + jnp.log(l_ref[...])  # [block_q, LANES], every lane the same
        lse_ref[...] = jnp.transpose(lse)[:1, :]  # [1, block_q]


def _probabilities_t(q_seg_ref, k_seg_ref, q_ref, k_ref, v_ref, do_ref, lse_ref, di_ref, t, i, scale):
    """Keys-major p^T and ds^T [block_k, block_q] of key block t against query block i (fp32)."""
    block = q_ref.shape[0]
    s_t = dot_nt(k_ref[...], q_ref[...]) * scale
    visible = _visible(t, i, block, True, k_seg_ref[...], q_seg_ref[...])
    p_t = jnp.where(visible, jnp.exp(s_t - lse_ref[...]), 0.0)
    ds_t = p_t * (dot_nt(v_ref[...], do_ref[...]) - di_ref[...])
    return p_t, ds_t


def _flash_dkv_kernel(q_seg_ref, k_seg_ref, q_ref, k_ref, v_ref, do_ref, lse_ref, di_ref, *refs, scale, with_dq):
    """dk, dv of key block t over query blocks i; `with_dq` (the fused backward) each step also adds its
    (ds^T)^T k into the head's whole dq (refs: dk, dv, dq, then their fp32 accumulators, dq's [L, D])."""
    dk_ref, dv_ref, dq_ref, dk_acc, dv_acc, dq_acc = refs if with_dq else (*refs[:2], None, *refs[2:], None)
    t, i = pl.program_id(2), pl.program_id(3)
    last = pl.num_programs(3) - 1

    if with_dq:
        @pl.when((t == 0) & (i == 0))
        def _():
            dq_acc[...] = jnp.zeros(dq_acc.shape, jnp.float32)

    @pl.when(i == 0)
    def _():
        dk_acc[...] = jnp.zeros(dk_acc.shape, jnp.float32)
        dv_acc[...] = jnp.zeros(dv_acc.shape, jnp.float32)

    @pl.when(i >= t)
    def _():
        p_t, ds_t = _probabilities_t(q_seg_ref, k_seg_ref, q_ref, k_ref, v_ref, do_ref, lse_ref, di_ref, t, i, scale)
        dv_acc[...] += dot_nn(p_t.astype(do_ref.dtype), do_ref[...])
        dk_acc[...] += dot_nn(ds_t.astype(q_ref.dtype), q_ref[...])
        if with_dq:
            block = q_ref.shape[0]
            rows = pl.ds(pl.multiple_of(i * block, block), block)
            dq_acc[rows, :] += dot_tn(ds_t.astype(k_ref.dtype), k_ref[...])

    @pl.when(i == last)
    def _():
        dk_ref[...] = (dk_acc[...] * scale).astype(dk_ref.dtype)
        dv_ref[...] = dv_acc[...].astype(dv_ref.dtype)

    if with_dq:
        @pl.when((t == last) & (i == last))
        def _():
            dq_ref[...] = (dq_acc[...] * scale).astype(dq_ref.dtype)


def fused_backward(length: int, dim: int) -> bool:
    """Whether `flash_backward` runs as one kernel: one head's fp32 dq [length, dim] within FUSED_DQ_BYTES."""
    return length * dim * 4 <= FUSED_DQ_BYTES


def _flash_dq_kernel(q_seg_ref, k_seg_ref, q_ref, k_ref, v_ref, do_ref, lse_ref, di_ref, dq_ref, dq_acc, *, scale):
    i, t = pl.program_id(2), pl.program_id(3)

    @pl.when(t == 0)
    def _():
        dq_acc[...] = jnp.zeros(dq_acc.shape, jnp.float32)

    @pl.when(t <= i)
    def _():
        _, ds_t = _probabilities_t(q_seg_ref, k_seg_ref, q_ref, k_ref, v_ref, do_ref, lse_ref, di_ref, t, i, scale)
        dq_acc[...] += dot_tn(ds_t.astype(k_ref.dtype), k_ref[...])

    @pl.when(t == i)
    def _():
        dq_ref[...] = (dq_acc[...] * scale).astype(dq_ref.dtype)


def flash_costs(batch: int, heads: int, length: int, dim: int, block: int, itemsize: int) -> dict:
    """(flops, bytes, transcendentals) each kernel declares: FLOPs of the block pairs on or below the diagonal;
    per pair the blocks streamed past the resident ones; the resident blocks, statistics and outputs once."""
    blocks = length // block
    pairs = batch * heads * blocks * (blocks + 1) // 2
    tile = block * dim * itemsize  # one [block, D] block of q, k, v, o or do
    rows = batch * heads * blocks * tile  # one whole [B, H, L, D] array
    stats = batch * heads * length * 4  # one [B, H, L] fp32 row array
    exps = pairs * block * block
    matmul = lambda count: count * 2 * pairs * block * block * dim  # noqa: E731
    dkv_bytes = 2 * pairs * tile + 2 * pairs * block * 4 + 4 * rows
    return {"forward": (matmul(2), 2 * pairs * tile + 2 * rows + stats, exps),
            "dkv": (matmul(4), dkv_bytes, exps),
            "dq": (matmul(3), 2 * pairs * tile + 3 * rows + 2 * stats, exps),
            "fused_backward": (matmul(5), dkv_bytes + rows, exps)}  # dk/dv's, and dq written once


def _cost(entry) -> pl.CostEstimate:
    return pl.CostEstimate(flops=entry[0], bytes_accessed=entry[1], transcendentals=entry[2])


def _rows(block: int, dim: int, index):
    return pl.BlockSpec((None, None, block, dim), lambda b, h, x, y: (b, h, index(x, y), 0))


def _specs(block: int, dim: int, query_index, key_index, keys_major: bool):
    """In-specs of (q_seg, k_seg, q, k, v) for index maps giving each step's (query block, key block); the
    segment ids of the tile's rows as a column, of its columns as a row (`_segments`)."""
    as_lanes = lambda index: pl.BlockSpec((None, 1, block), lambda b, h, x, y: (b, 0, index(x, y)))  # noqa: E731
    as_rows = lambda index: pl.BlockSpec((None, block, 1), lambda b, h, x, y: (b, index(x, y), 0))  # noqa: E731
    segments = [as_lanes(query_index), as_rows(key_index)] if keys_major else [as_rows(query_index),
                                                                                 as_lanes(key_index)]
    return [*segments, _rows(block, dim, query_index), _rows(block, dim, key_index), _rows(block, dim, key_index)]


def _stat_spec(block: int, query_index):
    return pl.BlockSpec((None, None, 1, block), lambda b, h, x, y: (b, h, 0, query_index(x, y)))


def _segments(segments, keys_major: bool):
    """(query, key) segment ids [B, 1, L] (on lanes) or [B, L, 1] (on sublanes), as `_specs` reads them."""
    segments = segments.astype(jnp.int32)
    lanes, sublanes = segments[:, None, :], segments[:, :, None]
    return (lanes, sublanes) if keys_major else (sublanes, lanes)


def flash_forward(q, k, v, segments, *, scale: float, block: int, interpret: bool = False):
    """q, k [B, H, L, D], v [B, H, L, D] (D a multiple of 128, L of `block`), segments [B, L] int32 ->
    (o [B, H, L, D] in q's dtype, lse fp32 [B, H, L])."""
    batch, heads, length, dim = q.shape
    blocks = length // block
    query = lambda i, t: i  # noqa: E731
    key = lambda i, t: jnp.minimum(t, i)  # noqa: E731  past the diagonal: the last visible block, not re-fetched
    call = pl.pallas_call(
        functools.partial(_flash_forward_kernel, scale=float(scale)),
        grid=(batch, heads, blocks, blocks),
        in_specs=_specs(block, dim, query, key, keys_major=False),
        out_specs=[pl.BlockSpec((None, None, block, dim), lambda b, h, i, t: (b, h, i, 0)), _stat_spec(block, query)],
        out_shape=[jax.ShapeDtypeStruct(q.shape, q.dtype),
                   jax.ShapeDtypeStruct((batch, heads, 1, length), jnp.float32)],
        scratch_shapes=[pltpu.VMEM((block, LANES), jnp.float32), pltpu.VMEM((block, LANES), jnp.float32),
                        pltpu.VMEM((block, dim), jnp.float32)],
        compiler_params=pltpu.CompilerParams(dimension_semantics=("parallel", "parallel", "parallel", "arbitrary")),
        cost_estimate=_cost(flash_costs(batch, heads, length, dim, block, q.dtype.itemsize)["forward"]),
        interpret=tpu_interpret(interpret),
    )
    out, lse = call(*_segments(segments, keys_major=False), q, k, v)
    return out, lse[:, :, 0, :]


def flash_backward(q, k, v, segments, lse, d_out, di, *, scale: float, block: int, interpret: bool = False):
    """(dq, dk, dv) of `flash_forward` for the output cotangent d_out [B, H, L, D], given its lse and
    di = rowsum(o * d_out) (fp32 [B, H, L] each)."""
    batch, heads, length, dim = q.shape
    blocks = length // block
    costs = flash_costs(batch, heads, length, dim, block, q.dtype.itemsize)
    q_seg, k_seg = _segments(segments, keys_major=True)
    stats = (lse[:, :, None, :].astype(jnp.float32), di[:, :, None, :].astype(jnp.float32))
    semantics = pltpu.CompilerParams(dimension_semantics=("parallel", "parallel", "parallel", "arbitrary"))

    # dk, dv: steps (key block t, query block i); query blocks before t repeat block t (fetched once).
    query = lambda t, i: jnp.maximum(i, t)  # noqa: E731
    key = lambda t, i: t  # noqa: E731
    key_rows = pl.BlockSpec((None, None, block, dim), lambda b, h, t, i: (b, h, t, 0))
    if fused_backward(length, dim):  # dq too, summed over the key blocks in VMEM: the key blocks run in order
        return _fused_backward(q, k, v, q_seg, k_seg, d_out, stats, scale, block, query, key, key_rows,
                               costs["fused_backward"], interpret)
    dk, dv = pl.pallas_call(
        functools.partial(_flash_dkv_kernel, scale=float(scale), with_dq=False),
        grid=(batch, heads, blocks, blocks),
        in_specs=[*_specs(block, dim, query, key, keys_major=True), _rows(block, dim, query),
                  _stat_spec(block, query), _stat_spec(block, query)],
        out_specs=[key_rows, key_rows],
        out_shape=[jax.ShapeDtypeStruct(k.shape, k.dtype), jax.ShapeDtypeStruct(v.shape, v.dtype)],
        scratch_shapes=[pltpu.VMEM((block, dim), jnp.float32), pltpu.VMEM((block, dim), jnp.float32)],
        compiler_params=semantics, cost_estimate=_cost(costs["dkv"]), interpret=tpu_interpret(interpret),
    )(q_seg, k_seg, q, k, v, d_out, *stats)

    # dq: steps (query block i, key block t); key blocks past i repeat block i.
    query = lambda i, t: i  # noqa: E731
    key = lambda i, t: jnp.minimum(t, i)  # noqa: E731
    dq = pl.pallas_call(
        functools.partial(_flash_dq_kernel, scale=float(scale)),
        grid=(batch, heads, blocks, blocks),
        in_specs=[*_specs(block, dim, query, key, keys_major=True), _rows(block, dim, query),
                  _stat_spec(block, query), _stat_spec(block, query)],
        out_specs=pl.BlockSpec((None, None, block, dim), lambda b, h, i, t: (b, h, i, 0)),
        out_shape=jax.ShapeDtypeStruct(q.shape, q.dtype),
        scratch_shapes=[pltpu.VMEM((block, dim), jnp.float32)],
        compiler_params=semantics, cost_estimate=_cost(costs["dq"]), interpret=tpu_interpret(interpret),
    )(q_seg, k_seg, q, k, v, d_out, *stats)
    return dq, dk, dv


def _fused_backward(q, k, v, q_seg, k_seg, d_out, stats, scale, block, query, key, key_rows, cost, interpret):
    """(dq, dk, dv) by one kernel: the dk/dv kernel's steps, each adding its part of dq (`with_dq`)."""
    batch, heads, length, dim = q.shape
    blocks = length // block
    dk, dv, dq = pl.pallas_call(
        functools.partial(_flash_dkv_kernel, scale=float(scale), with_dq=True),
        grid=(batch, heads, blocks, blocks),
        in_specs=[*_specs(block, dim, query, key, keys_major=True), _rows(block, dim, query),
                  _stat_spec(block, query), _stat_spec(block, query)],
        out_specs=[key_rows, key_rows, pl.BlockSpec((None, None, length, dim), lambda b, h, t, i: (b, h, 0, 0))],
        out_shape=[jax.ShapeDtypeStruct(k.shape, k.dtype), jax.ShapeDtypeStruct(v.shape, v.dtype),
                   jax.ShapeDtypeStruct(q.shape, q.dtype)],
        scratch_shapes=[pltpu.VMEM((block, dim), jnp.float32), pltpu.VMEM((block, dim), jnp.float32),
                        pltpu.VMEM((length, dim), jnp.float32)],
        compiler_params=pltpu.CompilerParams(dimension_semantics=("parallel", "parallel", "arbitrary", "arbitrary")),
        cost_estimate=_cost(cost), interpret=tpu_interpret(interpret),
    )(q_seg, k_seg, q, k, v, d_out, *stats)
    return dq, dk, dv
