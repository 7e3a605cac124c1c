"""Targets of the indexer KL loss: the main attention's head-summed, L1-normalised probabilities.

Sparse stage: p[s, n] = sum_h exp(scale * q_h . k_n - lse_h) at each query's selected rows (lse from
`sparse_mla_attention`), L1-normalised over n. One kernel program per query gathers its rows block by
block, so only the [B, S, N] result is ever stored.

Dense warm-up: the same over all visible (causal, same-segment) keys. One program per block of queries
streams the key blocks twice: the first pass builds each head's lse online, the second writes
[block_s, block_t] tiles of the head sum, so no [B, H, S, T] tensor exists (nor an lse in memory). Each
head's probabilities sum to 1 over the visible keys, so the head sum is L1-normalised by dividing by H.

Both return fp32 and are meant to be used under stop_gradient (no custom_vjp).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from pallas_kernels._common import (
    MIN_BLOCK,
    NEG_INF,
    check_block,
    check_cost_offset,
    check_equal,
    check_float_dtype,
    check_q_offset,
    check_rank,
    check_scale,
    check_segments,
    dot_nt,
    gather_rows,
    key_valid,
    pad_axis,
    positions_and_segments,
    resolve_interpret,
    resolve_platform,
    round_up,
    static_q_offset,
    triton_params,
)
from pallas_kernels.dsa_cost import array_bytes, causal_tiles, dense_target_cost, sparse_target_flops
from pallas_kernels.mla_layout import (
    MlaLayout,
    gather_kernel_plan,
    kernel_warps,
    pad_indices,
    split_latent,
    split_queries,
    validate_sparse_inputs,
)
from pallas_kernels.shared_memory import fit_block_and_stages
from pallas_kernels.sparse_mla import (
    gathered_rows_in_specs,
    gathered_rows_kernel_cost,
    per_query_spec,
    row_blocks_to_visit,
    visited_blocks,
)
from pallas_kernels.tpu_indexer import tpu_dense_target
from pallas_kernels.tpu_sparse_mla import tpu_sparse_target

# lse of rows that must add nothing to the head sum (padded heads; dense: rows without a visible key):
# exp(logit - 1e30) = 0.
_PADDED_HEAD_LSE = -NEG_INF
# Query-head rows per dense program (block_s = this // padded heads).
_DENSE_ROWS = 64


def _split_point(width: int) -> int:
    """Kernels see a row as a power-of-two-wide main part plus a padded remainder (576 -> 512 + 64)."""
    main = 1 << (max(width, 1).bit_length() - 1)
    return main // 2 if main == width else main


def _sparse_target_kernel(q_c_ref, q_r_ref, idx_ref, k_c_ref, k_r_ref, lse_ref, out_ref, *, scale, block_n):
    num_keys = k_c_ref.shape[0]
    q_c = q_c_ref[...]
    q_r = q_r_ref[...]
    lse = lse_ref[...]

    def step(j, carry):
        slots = pl.ds(j * block_n, block_n)
        idx = idx_ref[slots]
        valid = (idx >= 0) & (idx < num_keys)
        logits = (dot_nt(q_c, gather_rows(k_c_ref, idx, valid)) + dot_nt(q_r, gather_rows(k_r_ref, idx, valid))) * scale
        p = jnp.where(valid[None, :], jnp.exp(logits - lse[:, None]), 0.0)
        out_ref[slots] = jnp.sum(p, axis=0)
        return carry

    def zero(j, carry):  # blocks past the last valid slot hold no valid slot: 0, without gathering their rows
        out_ref[pl.ds(j * block_n, block_n)] = jnp.zeros((block_n,), jnp.float32)
        return carry

    visited = row_blocks_to_visit(idx_ref, block_n, num_keys)
    lax.fori_loop(0, visited, step, 0)
    lax.fori_loop(visited, idx_ref.shape[0] // block_n, zero, 0)


def sparse_attention_target(q, latent, indices, lse, *, scale, block_n=64, interpret=None, platform=None,
                            cost_q_offset=None):
    """Head-summed attention probabilities at the selected rows, L1-normalised over N; fp32 [B, S, N].

    q [B, S, H, C+R], latent [B, T, C+R], indices int [B, S, N] (-1 = unused), lse fp32 [B, S, H] (from
    `sparse_mla_attention`). Invalid slots get 0; a query without valid slots gets an all-zero row.
    platform: "gpu" (Triton), "tpu" (Mosaic DMA row gathers) or None (TPU kernels on a TPU backend).
    cost_q_offset: as in `sparse_mla_attention` (the declared cost of the Triton kernel, which stops after each
    query's last block holding a valid slot).
    """
    check_rank("q", q, 4, "[B, S, H, C+R]")
    width = q.shape[-1]
    layout = validate_sparse_inputs(q, latent, indices, _split_point(width), block_n)
    check_rank("lse", lse, 3, "[B, S, H]")
    check_float_dtype("lse", lse)
    check_equal("lse.shape", tuple(lse.shape), tuple(q.shape[:3]), "[B, S, H] of q")
    check_scale(scale)
    check_cost_offset(cost_q_offset)
    interpret = resolve_interpret(interpret)
    if resolve_platform(platform) == "tpu":
        p = tpu_sparse_target(q, latent, indices, lse, float(scale), layout, _PADDED_HEAD_LSE, interpret)
    else:
        p = _triton_sparse_target(q, latent, indices, lse, float(scale), layout, interpret, cost_q_offset)
    total = jnp.sum(p, axis=-1, keepdims=True)
    return p / jnp.where(total > 0, total, 1.0)


def _triton_sparse_target(q, latent, indices, lse, scale, layout, interpret, cost_q_offset):
    q_c, q_r = split_queries(q, layout)
    k_c, k_r = split_latent(latent, layout)
    idx = pad_indices(indices, layout)
    lse_p = pad_axis(lse.astype(jnp.float32), 2, layout.heads_padded, value=_PADDED_HEAD_LSE)
    batch, q_len, heads = q_c.shape[:3]
    slots = idx.shape[-1]
    block_n, stages = gather_kernel_plan(layout, q_c.dtype.itemsize)
    out_shape = jax.ShapeDtypeStruct((batch, q_len, slots), jnp.float32)
    call = pl.pallas_call(
        functools.partial(_sparse_target_kernel, scale=scale, block_n=block_n),
        grid=(batch, q_len),
        in_specs=[*gathered_rows_in_specs(q_c, q_r, idx, k_c), per_query_spec(heads)],
        out_specs=per_query_spec(slots),
        out_shape=out_shape,
        interpret=interpret,
        compiler_params=triton_params(num_warps=kernel_warps(layout), num_stages=stages),
    )
    flops = sparse_target_flops(heads, slots, q_c.shape[-1] + q_r.shape[-1])
    cost = gathered_rows_kernel_cost(q_c, q_r, idx, k_c, k_r, [lse_p], [out_shape], flops=flops, block_n=block_n,
                                     visited_blocks=visited_blocks(batch, q_len, layout, block_n, cost_q_offset))
    with cost.declared():
        p = call(q_c, q_r, idx, k_c, k_r, lse_p)
    return p[:, :, : layout.num_slots]


def _row_layout(values, heads_padded: int):
    """Per-query values [block_s] -> per (query, head) row values [block_s * heads_padded]."""
    return jnp.broadcast_to(values[:, None], (values.shape[0], heads_padded)).reshape(-1)


def dense_target_plan(rows: int, layout: MlaLayout, itemsize: int, block_t: int) -> tuple[int, int]:
    """(keys per step, pipeline stages) of the Triton dense target on the target GPU: the block's query rows
    x (Cp+Rp) stay in shared memory, each stage holds block_t key rows, and the fp32 rows x block_t logits
    tile passes through it between layouts (GLM-5 bf16, 64 rows, block_t 64: 72 KiB + 72 KiB per stage +
    16 KiB -> one stage in 227 KiB; two measured 232 KiB with segment ids)."""
    width = layout.latent_padded + layout.rope_padded
    return fit_block_and_stages(
        block_t, lambda block, stages: (rows + stages * block) * width * itemsize + rows * block * 4)


def _dense_target_kernel(q_c_ref, q_r_ref, q_pos_ref, q_seg_ref, k_c_ref, k_r_ref, k_seg_ref, out_ref, *,
                         scale, block_t, num_keys, heads):
    block_s, keys_padded = out_ref.shape
    q_c = q_c_ref[...]  # [block_s * Hp, C]: the block's queries stay on chip for both passes
    q_r = q_r_ref[...]
    rows = q_c.shape[0]
    heads_padded = rows // block_s
    q_pos = q_pos_ref[...]
    row_pos = _row_layout(q_pos, heads_padded)[:, None]
    row_seg = _row_layout(q_seg_ref[...], heads_padded)[:, None]
    num_blocks = keys_padded // block_t
    # Causality: key blocks past the block's last query position are all zero and need no matmul.
    visible_blocks = jnp.clip(jnp.max(q_pos) // block_t + 1, 0, num_blocks)

    def logits_block(j):
        keys = pl.ds(j * block_t, block_t)
        logits = (dot_nt(q_c, k_c_ref[keys, :]) + dot_nt(q_r, k_r_ref[keys, :])) * scale
        k_pos = j * block_t + lax.broadcasted_iota(jnp.int32, (1, block_t), 1)
        return logits, key_valid(row_pos, row_seg, k_pos, k_seg_ref[keys][None, :], num_keys)

    def lse_step(j, carry):  # pass 1: online log-sum-exp per (query, head) row
        row_max, row_sum = carry
        logits, visible = logits_block(j)
        logits = jnp.where(visible, logits, NEG_INF)
        new_max = jnp.maximum(row_max, jnp.max(logits, axis=1))
        p = jnp.where(visible, jnp.exp(logits - new_max[:, None]), 0.0)
        return new_max, row_sum * jnp.exp(row_max - new_max) + jnp.sum(p, axis=1)

    init = (jnp.full((rows,), NEG_INF, jnp.float32), jnp.zeros((rows,), jnp.float32))
    row_max, row_sum = lax.fori_loop(0, visible_blocks, lse_step, init)
    # Padded heads and rows without a visible key get lse = +1e30: their probabilities come out 0.
    counted = (row_sum > 0) & (lax.broadcasted_iota(jnp.int32, (rows,), 0) % heads_padded < heads)
    lse = jnp.where(counted, row_max + jnp.log(jnp.where(counted, row_sum, 1.0)), _PADDED_HEAD_LSE)

    def probability_step(j, carry):  # pass 2: head sum of the probabilities, one [block_s, block_t] tile
        logits, visible = logits_block(j)
        p = jnp.where(visible, jnp.exp(logits - lse[:, None]), 0.0)
        out_ref[:, pl.ds(j * block_t, block_t)] = jnp.sum(p.reshape(block_s, heads_padded, block_t), axis=1) / heads
        return carry

    def zero_step(j, carry):
        out_ref[:, pl.ds(j * block_t, block_t)] = jnp.zeros((block_s, block_t), jnp.float32)
        return carry

    lax.fori_loop(0, visible_blocks, probability_step, 0)
    lax.fori_loop(visible_blocks, num_blocks, zero_step, 0)


def dense_attention_target(q, latent, *, scale, q_segment_ids=None, k_segment_ids=None, q_offset=0,
                           block_s=None, block_t=64, interpret=None, platform=None, cost_q_offset=None):
    """Head-summed dense attention probabilities over all visible keys, L1-normalised; fp32 [B, S, T].

    q [B, S, H, C+R], latent [B, T, C+R]; key t is visible to query s iff t <= q_offset + s and (segment
    ids [B, S] / [B, T] given) the segments match. block_s: queries per program (default: 64 // padded
    H, at least 1); block_t: keys per step (power of two >= 16). A query without visible keys gets 0.
    platform: "gpu" (Triton), "tpu" (Mosaic, `tpu_indexer.py`: a (B, S/block_s, T/block_t) grid, block_s
    rounded up to a multiple of 8 and block_t to 128, default block_s 256 // H) or None (TPU on a TPU backend).
    cost_q_offset: for a traced q_offset, the static offset the declared cost assumes (None: every key tile).
    """
    check_rank("q", q, 4, "[B, S, H, C+R]")
    check_rank("latent", latent, 3, "[B, T, C+R]")
    check_float_dtype("q", q)
    check_equal("latent.dtype", latent.dtype, q.dtype, "q and latent feed the same matmuls")
    batch, q_len, heads, width = q.shape
    k_len = latent.shape[1]
    check_equal("latent.shape[0]", latent.shape[0], batch, "batch of q")
    check_equal("latent.shape[-1]", latent.shape[-1], width, "C+R of q")
    if width < 2 or k_len < 1:
        raise ValueError(f"need rows at least 2 wide and one key; got q.shape={q.shape}, latent.shape={latent.shape}")
    check_scale(scale)
    check_segments(q_segment_ids, k_segment_ids, batch, q_len, k_len)
    check_q_offset(q_offset)
    check_block("block_t", block_t)
    if block_s is not None and (not isinstance(block_s, int) or block_s < 1 or block_s & (block_s - 1)):
        raise ValueError(f"block_s must be None or a power of two >= 1; got {block_s!r}")
    interpret = resolve_interpret(interpret)
    q_pos, q_seg, k_seg = positions_and_segments(q_offset, q_segment_ids, k_segment_ids, batch, q_len, k_len)
    if resolve_platform(platform) == "tpu":
        return tpu_dense_target(q, latent, q_pos, q_seg, k_seg, scale=float(scale), block_s=block_s,
                                block_t=block_t, interpret=interpret,
                                first_position=static_q_offset(q_offset, cost_q_offset))
    layout = MlaLayout(heads=heads, latent_dim=_split_point(width), rope_dim=width - _split_point(width),
                       num_slots=1, block_n=MIN_BLOCK)
    heads_p = layout.heads_padded
    if block_s is None:
        block_s = max(1, _DENSE_ROWS // heads_p)
    block_t, stages = dense_target_plan(block_s * heads_p, layout, q.dtype.itemsize, block_t)
    len_p, keys_p = round_up(q_len, block_s), round_up(k_len, block_t)
    q_pos = pad_axis(q_pos, 0, len_p, value=-1)  # padding queries see no key
    q_seg = pad_axis(q_seg, 1, len_p)
    k_seg = pad_axis(k_seg, 1, keys_p)
    q_c, q_r = (pad_axis(x, 1, len_p).reshape(batch, len_p * heads_p, -1) for x in split_queries(q, layout))
    k_c, k_r = (pad_axis(x, 1, keys_p) for x in split_latent(latent, layout))
    c_dim, r_dim = q_c.shape[-1], q_r.shape[-1]
    rows = block_s * heads_p
    num_blocks = keys_p // block_t
    out_shape = jax.ShapeDtypeStruct((batch, len_p, keys_p), jnp.float32)
    call = pl.pallas_call(
        functools.partial(_dense_target_kernel, scale=float(scale), block_t=block_t, num_keys=k_len, heads=heads),
        grid=(batch, len_p // block_s),
        in_specs=[
            pl.BlockSpec((None, rows, c_dim), lambda b, i: (b, i, 0)),
            pl.BlockSpec((None, rows, r_dim), lambda b, i: (b, i, 0)),
            pl.BlockSpec((block_s,), lambda b, i: (i,)),
            pl.BlockSpec((None, block_s), lambda b, i: (b, i)),
            pl.BlockSpec((None, keys_p, c_dim), lambda b, i: (b, 0, 0)),
            pl.BlockSpec((None, keys_p, r_dim), lambda b, i: (b, 0, 0)),
            pl.BlockSpec((None, keys_p), lambda b, i: (b, 0)),
        ],
        out_specs=pl.BlockSpec((None, block_s, keys_p), lambda b, i: (b, i, 0)),
        out_shape=out_shape,
        interpret=interpret,
        compiler_params=triton_params(num_warps=kernel_warps(layout), num_stages=stages),
    )
    # Both passes visit the key blocks up to each query block's last position (all of them for a traced q_offset).
    tiles = causal_tiles((static_q_offset(q_offset, cost_q_offset), q_len, 1), len_p, block_s, block_t,
                         num_blocks)
    cost = dense_target_cost(batch, tiles, rows, block_t, c_dim + r_dim, q.dtype.itemsize, passes=2,
                             query_bytes=array_bytes(q_c, q_r, q_seg) + batch * array_bytes(q_pos),
                             out_bytes=array_bytes(out_shape))
    with cost.declared():
        target = call(q_c, q_r, q_pos, q_seg, k_c, k_r, k_seg)
    return target[:, :q_len, :k_len]
