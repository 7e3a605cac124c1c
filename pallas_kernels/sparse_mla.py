"""Sparse MLA attention for DSA: each query attends, with all its heads, to its own N selected latent rows.

Absorbed (MQA) form: q [B, S, H, C+R] against latent rows [C+R] shared by every head; values are the first
C columns of the same rows. All heads of one query share its N rows, so one kernel program handles one
query and its heads form the matmul rows: [H, C+R] x [C+R, block_n] per block of selected rows, with an
online softmax over the blocks (fp32 statistics and accumulators). A program stops after its query's last block
holding a valid slot (`row_blocks_to_visit`): near a sequence's start a query has fewer visible keys than N,
and the indexer's top-k puts the unused slots last.

Backward (custom_vjp) runs over bounded query chunks: the kernel recomputes the probabilities from the
saved lse, accumulates dq per query, and writes each (query, slot) key/value gradient row [C+R] reduced
over heads (summed in fp32, stored in the latent's dtype); those rows are scatter-added into fp32 d(latent)
with `.at[].add` outside the kernel, chunk by chunk, so a row selected by many queries sums all its
contributions and nothing of size S x T or S x N x (C+R) exists for the whole sequence. With
row_gradients="atomic" the kernel instead adds each block's fp32 rows into fp32 d(latent) with atomic adds,
over the whole sequence in one call (no per-slot rows, no scatter).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from pallas_kernels._common import (
    NEG_INF,
    atomic_add_rows,
    check_cost_offset,
    check_positive_int,
    check_scale,
    dot_nn,
    dot_nt,
    dot_tn,
    gather_rows,
    pad_axis,
    resolve_interpret,
    resolve_platform,
    round_up,
    triton_params,
)
from pallas_kernels.dsa_cost import (
    array_bytes,
    causal_row_blocks,
    chunk_row_blocks,
    gathered_rows_cost,
    sparse_mla_backward_flops,
    sparse_mla_forward_flops,
)
from pallas_kernels.mla_layout import (
    SPARSE_MLA_BACKWARD_WARPS,
    SPARSE_MLA_FORWARD_STAGES,
    MlaLayout,
    backward_plan,
    backward_query_chunk,
    backward_shift,
    chunked_backward,
    gather_kernel_plan,
    kernel_warps,
    pad_indices,
    sliced_chunks,
    split_latent,
    split_queries,
    validate_sparse_inputs,
)
from pallas_kernels.tpu_sparse_mla import tpu_sparse_mla


def row_blocks_to_visit(idx_ref, block_n: int, num_keys: int) -> jax.Array:
    """int32: the number of this query's blocks of block_n slots up to its last one holding a valid slot (0:
    none). The programs gather and compute only those: the indexer's top-k puts unused slots (-1) last, so a
    query with fewer visible keys than N (near a sequence's start) skips its trailing blocks. Reads the indices
    alone (4 bytes per slot against a row of C+R per slot), exact for any slot order."""

    def visit(j, last):
        idx = idx_ref[pl.ds(j * block_n, block_n)]
        has_valid = jnp.max(((idx >= 0) & (idx < num_keys)).astype(jnp.int32)) > 0
        return jnp.where(has_valid, j + 1, last)

    return lax.fori_loop(0, idx_ref.shape[0] // block_n, visit, jnp.int32(0))


def _forward_kernel(q_c_ref, q_r_ref, idx_ref, k_c_ref, k_r_ref, out_ref, lse_ref, *, scale, block_n):
    num_keys = k_c_ref.shape[0]
    q_c = q_c_ref[...]
    q_r = q_r_ref[...]
    heads, width = q_c.shape

    def step(j, carry):
        row_max, row_sum, acc = carry
        idx = idx_ref[pl.ds(j * block_n, block_n)]
        valid = (idx >= 0) & (idx < num_keys)
        k_c = gather_rows(k_c_ref, idx, valid)
        k_r = gather_rows(k_r_ref, idx, valid)
        logits = (dot_nt(q_c, k_c) + dot_nt(q_r, k_r)) * scale
        logits = jnp.where(valid[None, :], logits, NEG_INF)
        new_max = jnp.maximum(row_max, jnp.max(logits, axis=1))
        # where(), not exp alone: while a row has seen no valid slot, logits - new_max is 0 there.
        p = jnp.where(valid[None, :], jnp.exp(logits - new_max[:, None]), 0.0)
        rescale = jnp.exp(row_max - new_max)
        row_sum = row_sum * rescale + jnp.sum(p, axis=1)
        acc = acc * rescale[:, None] + dot_nn(p.astype(k_c.dtype), k_c)
        return new_max, row_sum, acc

    init = (jnp.full((heads,), NEG_INF, jnp.float32), jnp.zeros((heads,), jnp.float32),
            jnp.zeros((heads, width), jnp.float32))
    row_max, row_sum, acc = lax.fori_loop(0, row_blocks_to_visit(idx_ref, block_n, num_keys), step, init)
    has_valid = row_sum > 0
    safe_sum = jnp.where(has_valid, row_sum, 1.0)
    out_ref[...] = (acc / safe_sum[:, None]).astype(out_ref.dtype)
    lse_ref[...] = jnp.where(has_valid, row_max + jnp.log(safe_sum), NEG_INF)


def per_query_spec(*block):
    """BlockSpec of a [B, S, *block] array read one (batch, query) block per program of the (B, S) grid."""
    return pl.BlockSpec((None, None, *block), lambda b, s: (b, s) + (0,) * len(block))


def gathered_rows_in_specs(q_c, q_r, idx, k_c) -> list:
    """The inputs every row-gathering Triton kernel starts with: the query's latent and rope parts, its
    indices, and the whole key rows of its batch (latent and rope parts), which the kernel gathers from."""
    heads, width = q_c.shape[2:]
    rope, num_keys = q_r.shape[-1], k_c.shape[1]
    per_batch = lambda b, s: (b, 0, 0)
    return [per_query_spec(heads, width), per_query_spec(heads, rope), per_query_spec(idx.shape[-1]),
            pl.BlockSpec((None, num_keys, width), per_batch), pl.BlockSpec((None, num_keys, rope), per_batch)]


def gathered_rows_kernel_cost(q_c, q_r, idx, k_c, k_r, per_query, out_shape, *, flops: int, block_n: int,
                              visited_blocks: int | None, per_slot=()):
    """Cost of a Triton row-gathering call over grid (B, S): `visited_blocks` blocks of block_n slots over all
    programs (None: every block; `dsa_cost.causal_row_blocks`), each gathering its rows of C+R, with the
    per-program `flops` (over all Np slots) and one exp per (head, slot) in proportion; per-query inputs and
    outputs once, per-slot outputs (`per_slot`, [B, S, Np, *]) written for the visited blocks."""
    heads, slots = q_c.shape[2], idx.shape[-1]
    block_bytes = block_n * (k_c.shape[-1] * k_c.dtype.itemsize + k_r.shape[-1] * k_r.dtype.itemsize)
    return gathered_rows_cost(idx.shape[0] * idx.shape[1], slots // block_n, visited_blocks,
                              block_bytes=block_bytes, moved_bytes=array_bytes(q_c, q_r, idx, *per_query, *out_shape),
                              per_slot_bytes=array_bytes(*per_slot), flops=flops, transcendentals=heads * slots)


def visited_blocks(batch: int, q_len: int, layout: MlaLayout, block_n: int, cost_q_offset: int | None) -> int:
    """Row blocks a (B, S) grid of queries at positions cost_q_offset + s visits (`causal_row_blocks`)."""
    return batch * causal_row_blocks(cost_q_offset, q_len, layout.num_slots, block_n)


def _forward_call(q_c, q_r, idx, k_c, k_r, *, scale, layout: MlaLayout, interpret: bool, cost_q_offset):
    batch, q_len, heads, width = q_c.shape
    block_n, stages = gather_kernel_plan(layout, q_c.dtype.itemsize, max_stages=SPARSE_MLA_FORWARD_STAGES)
    out_shape = [jax.ShapeDtypeStruct(q_c.shape, q_c.dtype), jax.ShapeDtypeStruct((batch, q_len, heads), jnp.float32)]
    call = pl.pallas_call(
        functools.partial(_forward_kernel, scale=scale, block_n=block_n),
        grid=(batch, q_len),
        in_specs=gathered_rows_in_specs(q_c, q_r, idx, k_c),
        out_specs=[per_query_spec(heads, width), per_query_spec(heads)],
        out_shape=out_shape,
        interpret=interpret,
        compiler_params=triton_params(num_warps=kernel_warps(layout), num_stages=stages),
    )
    flops = sparse_mla_forward_flops(heads, idx.shape[-1], width + q_r.shape[-1], width)
    cost = gathered_rows_kernel_cost(q_c, q_r, idx, k_c, k_r, [], out_shape, flops=flops, block_n=block_n,
                                     visited_blocks=visited_blocks(batch, q_len, layout, block_n, cost_q_offset))
    with cost.declared():
        return call(q_c, q_r, idx, k_c, k_r)


def _backward_kernel(q_c_ref, q_r_ref, idx_ref, k_c_ref, k_r_ref, do_ref, lse_ref, shift_ref, *out_refs, scale,
                     block_n, column_parts, atomic_rows):
    # The C columns are handled in `column_parts` static slices (`backward_plan`): each block's
    # fp32 row gradients then pass through shared memory one [block_n, C / parts] part at a time.
    # out_refs end with dq (latent, rope parts) and the row gradients: per slot [N, *] in the latent's dtype, or
    # with atomic_rows fp32 d(latent) [T + 1, *] (the aliased zero inputs come first), added to in place.
    dq_c_ref, dq_r_ref, dk_c_ref, dk_r_ref = out_refs[-4:]
    num_keys, width = k_c_ref.shape
    part_width = width // column_parts
    parts = [slice(i * part_width, (i + 1) * part_width) for i in range(column_parts)]
    q_c = [q_c_ref[:, cols] for cols in parts]
    d_out = [do_ref[:, cols] for cols in parts]
    q_r = q_r_ref[...]
    lse = lse_ref[...]
    shift = shift_ref[...]

    def step(j, carry):
        dq_c, dq_r = carry
        slots = pl.ds(j * block_n, block_n)
        idx = idx_ref[slots]
        valid = (idx >= 0) & (idx < num_keys)
        k_c = [gather_rows(k_c_ref, idx, valid, cols) for cols in parts]
        k_r = gather_rows(k_r_ref, idx, valid)
        logits = dot_nt(q_r, k_r)
        d_values = 0.0
        for q_part, do_part, k_part in zip(q_c, d_out, k_c):
            logits = logits + dot_nt(q_part, k_part)
            d_values = d_values + dot_nt(do_part, k_part)
        p = jnp.where(valid[None, :], jnp.exp(logits * scale - lse[:, None]), 0.0)
        # d loss / d logit = p * (do.v - (do.out - d lse)); `shift` holds do.out - d lse per head.
        d_logits = (p * (d_values - shift[:, None])).astype(k_r.dtype)
        dq_c = tuple(acc + dot_nn(d_logits, k_part) for acc, k_part in zip(dq_c, k_c))
        dq_r = dq_r + dot_nn(d_logits, k_r)
        # Per-slot row gradients, already summed over heads: key part of all C+R columns plus value part,
        # added in fp32; stored in the latent's dtype, or added atomically to fp32 d(latent).
        p_lo = p.astype(k_r.dtype)
        row_parts = [(dk_c_ref, cols, scale * dot_tn(d_logits, q_part) + dot_tn(p_lo, do_part))
                     for cols, q_part, do_part in zip(parts, q_c, d_out)]
        row_parts.append((dk_r_ref, slice(None), scale * dot_tn(d_logits, q_r)))
        for ref, cols, rows in row_parts:
            if atomic_rows:  # an invalid slot's gradient is exactly 0 (p = 0): it goes to the spare row T
                atomic_add_rows(ref, jnp.where(valid, idx, num_keys), rows, cols)
            else:
                ref[slots, cols] = rows.astype(ref.dtype)
        return dq_c, dq_r

    init = (tuple(jnp.zeros(x.shape, jnp.float32) for x in q_c), jnp.zeros(q_r.shape, jnp.float32))
    # Slots past the last visited block keep whatever their output holds: all invalid, the scatter drops them.
    dq_c, dq_r = lax.fori_loop(0, row_blocks_to_visit(idx_ref, block_n, num_keys), step, init)
    for cols, acc in zip(parts, dq_c):
        dq_c_ref[:, cols] = (scale * acc).astype(dq_c_ref.dtype)
    dq_r_ref[...] = (scale * dq_r).astype(dq_r_ref.dtype)


def _backward_call(q_c, q_r, idx, k_c, k_r, d_out, lse, shift, *, scale, layout: MlaLayout, interpret: bool,
                   visited_row_blocks, atomic_rows: bool = False):
    """One query chunk's backward; visited_row_blocks: the blocks its declared cost counts (per call).
    Returns dq's parts and the row gradients: per (query, slot) [B, S, Np, *] in the latent's dtype, or with
    atomic_rows already summed into fp32 d(latent) [B, T + 1, *] (row T: the invalid slots' zeros)."""
    batch, q_len, heads, width = q_c.shape
    rope, slots, num_keys = q_r.shape[-1], idx.shape[-1], k_c.shape[1]
    block_n, column_parts = backward_plan(layout, q_c.dtype.itemsize)
    per_slot = [jax.ShapeDtypeStruct((batch, q_len, slots, width), k_c.dtype),
                jax.ShapeDtypeStruct((batch, q_len, slots, rope), k_r.dtype)]
    accumulators, aliases = [], {}
    if atomic_rows:
        accumulators = [jnp.zeros((batch, num_keys + 1, width), jnp.float32),
                        jnp.zeros((batch, num_keys + 1, rope), jnp.float32)]
        aliases = {8: 2, 9: 3}  # the zero accumulators (inputs 8, 9) become the row-gradient outputs
        row_specs = [pl.BlockSpec((None, num_keys + 1, width), lambda b, s: (b, 0, 0)),
                     pl.BlockSpec((None, num_keys + 1, rope), lambda b, s: (b, 0, 0))]
        row_outputs = [jax.ShapeDtypeStruct(x.shape, x.dtype) for x in accumulators]
    else:
        row_specs, row_outputs = [per_query_spec(slots, width), per_query_spec(slots, rope)], per_slot
    out_shape = [jax.ShapeDtypeStruct(q_c.shape, q_c.dtype), jax.ShapeDtypeStruct(q_r.shape, q_r.dtype), *row_outputs]
    call = pl.pallas_call(
        functools.partial(_backward_kernel, scale=scale, block_n=block_n, column_parts=column_parts,
                          atomic_rows=atomic_rows),
        grid=(batch, q_len),
        in_specs=[*gathered_rows_in_specs(q_c, q_r, idx, k_c), per_query_spec(heads, width),
                  per_query_spec(heads), per_query_spec(heads), *row_specs[:len(accumulators)]],
        out_specs=[per_query_spec(heads, width), per_query_spec(heads, rope), *row_specs],
        out_shape=out_shape,
        input_output_aliases=aliases,
        interpret=interpret,
        compiler_params=triton_params(num_warps=SPARSE_MLA_BACKWARD_WARPS, num_stages=1),
    )
    flops = sparse_mla_backward_flops(heads, slots, width + rope, width)
    # Atomic adds are costed as the fp32 rows they send (what the per-slot rows would write, in fp32).
    sent = [jax.ShapeDtypeStruct(x.shape, jnp.float32) for x in per_slot] if atomic_rows else per_slot
    cost = gathered_rows_kernel_cost(q_c, q_r, idx, k_c, k_r, [d_out, lse, shift], out_shape[:2], flops=flops,
                                     block_n=block_n, visited_blocks=visited_row_blocks, per_slot=sent)
    with cost.declared():
        return call(q_c, q_r, idx, k_c, k_r, d_out, lse, shift, *accumulators)


@functools.partial(jax.custom_vjp, nondiff_argnums=(3, 4, 5, 6, 7, 8))
def _sparse_mla(q, latent, indices, scale, layout, bwd_query_chunk, interpret, cost_q_offset, row_gradients):
    return _sparse_mla_fwd(q, latent, indices, scale, layout, bwd_query_chunk, interpret, cost_q_offset,
                           row_gradients)[0]


def _sparse_mla_fwd(q, latent, indices, scale, layout, bwd_query_chunk, interpret, cost_q_offset, row_gradients):
    q_c, q_r = split_queries(q, layout)
    k_c, k_r = split_latent(latent, layout)
    out, lse = _forward_call(q_c, q_r, pad_indices(indices, layout), k_c, k_r, scale=scale, layout=layout,
                             interpret=interpret, cost_q_offset=cost_q_offset)
    out = out[:, :, : layout.heads, : layout.latent_dim]
    lse = lse[:, :, : layout.heads]
    return (out, lse), (q, latent, indices, out, lse)


def _sparse_mla_bwd(scale, layout, bwd_query_chunk, interpret, cost_q_offset, row_gradients, residuals, cotangents):
    q, latent, indices, out, lse = residuals
    d_out, d_lse = cotangents
    do_c = split_queries(d_out.astype(q.dtype), layout)[0]
    block_n = backward_plan(layout, q.dtype.itemsize)[0]
    # The backward's block can exceed the forward's (`backward_plan`): pad the slots to a multiple of it.
    slots = pad_axis(indices.astype(jnp.int32), 2, round_up(layout.num_slots, block_n), value=-1)
    lse_padded = pad_axis(lse, 2, layout.heads_padded)
    shift = pad_axis(backward_shift(out, d_out, d_lse), 2, layout.heads_padded)
    if row_gradients == "atomic":  # the whole sequence in one call: no per-slot rows, no scatter
        dq_c, dq_r, dlat_c, dlat_r = _backward_call(
            *split_queries(q, layout), slots, *split_latent(latent, layout), do_c, lse_padded, shift, scale=scale,
            layout=layout, interpret=interpret, atomic_rows=True,
            visited_row_blocks=visited_blocks(q.shape[0], q.shape[1], layout, block_n, cost_q_offset))
        return _gradients(q, latent, layout, dq_c, dq_r, dlat_c[:, :-1], dlat_r[:, :-1])
    visited = q.shape[0] * chunk_row_blocks(cost_q_offset, q.shape[1], layout.num_slots, block_n, bwd_query_chunk)

    def chunk_kernel(q_parts, idx, latent_parts, do, lse_c, shift_c):
        dq_c, dq_r, dk_c, dk_r = _backward_call(*q_parts, idx, *latent_parts, do, lse_c, shift_c, scale=scale,
                                                layout=layout, interpret=interpret, visited_row_blocks=visited)
        return (dq_c, dq_r), (dk_c, dk_r)

    (dq_c, dq_r), (dlat_c, dlat_r) = chunked_backward(
        sliced_chunks(chunk_kernel, bwd_query_chunk), split_queries(q, layout), split_latent(latent, layout), slots,
        do_c, lse_padded, shift, chunk=bwd_query_chunk)
    return _gradients(q, latent, layout, dq_c, dq_r, dlat_c, dlat_r)


def _gradients(q, latent, layout: MlaLayout, dq_c, dq_r, dlat_c, dlat_r):
    """(dq, d(latent), None) in the inputs' dtypes from the kernels' padded parts."""
    heads, c_dim, r_dim = layout.heads, layout.latent_dim, layout.rope_dim
    dq = jnp.concatenate([dq_c[:, :, :heads, :c_dim], dq_r[:, :, :heads, :r_dim]], axis=-1)
    dlatent = jnp.concatenate([dlat_c[..., :c_dim], dlat_r[..., :r_dim]], axis=-1)
    return dq.astype(q.dtype), dlatent.astype(latent.dtype), None


_sparse_mla.defvjp(_sparse_mla_fwd, _sparse_mla_bwd)


def validate_sparse_call(q, latent, indices, scale, kv_lora_rank, block_n, bwd_query_chunk, interpret,
                         cost_q_offset=None):
    """(MlaLayout, bwd_query_chunk resolved, interpret resolved) of a sparse MLA call, or a ValueError naming
    the bad argument."""
    layout = validate_sparse_inputs(q, latent, indices, kv_lora_rank, block_n)
    check_scale(scale)
    if bwd_query_chunk is None:
        bwd_query_chunk = backward_query_chunk(latent.shape[1], layout.num_slots, jnp.dtype(latent.dtype).itemsize)
    check_positive_int("bwd_query_chunk", bwd_query_chunk)
    check_cost_offset(cost_q_offset)
    return layout, bwd_query_chunk, resolve_interpret(interpret)


ROW_GRADIENTS = ("scatter", "atomic")


def check_row_gradients(row_gradients: str, platform: str) -> None:
    if row_gradients not in ROW_GRADIENTS:
        raise ValueError(f"row_gradients={row_gradients!r} is invalid: must be one of {ROW_GRADIENTS}")
    if platform == "tpu" and row_gradients != "scatter":
        raise ValueError(f"row_gradients={row_gradients!r} is Triton's (GPU) only; the TPU kernels scatter")


def sparse_mla_attention(q, latent, indices, *, scale, kv_lora_rank, block_n=64, bwd_query_chunk=None,
                         interpret=None, platform=None, cost_q_offset=None, row_gradients="scatter"):
    """Sparse MLA attention over each query's selected latent rows; returns (out, lse).

    q: [B, S, H, C+R] absorbed queries; latent: [B, T, C+R] (keys = whole rows, values = first C columns);
    indices: int [B, S, N] selected rows, shared by all heads; -1 (or any value outside [0, T)) marks an
    unused slot. Valid indices of one query must be distinct (a repeated row would count twice).
    out: [B, S, H, C] in q.dtype (0 for a query without valid slots); lse: fp32 [B, S, H] (NEG_INF there).
    block_n: selected rows per online-softmax step (power of two >= 16; N is padded to a multiple).
    bwd_query_chunk: queries per backward step; bounds the per-slot gradient buffer to
    B * bwd_query_chunk * N * (C+R) values in the latent's dtype (GLM-5 bf16, 512: 1.3 GB per sequence). Each
    step's scatter reads and writes the fp32 d(latent) [B, T, C+R] once, so at long T a larger chunk moves fewer
    bytes per query (S = T = 65536 on v5p: 1.36, 1.05, 0.87 GB of scatter per 256 queries at 256, 512, 1024).
    None: `mla_layout.backward_query_chunk` picks it from T and N (512 up to 64K keys for GLM-5).
    Differentiable in q and latent, through out and lse.
    platform: "gpu" (Triton), "tpu" (Mosaic, `tpu_sparse_mla.py`) or None (TPU kernels on a TPU backend).
    Each query's programs stop after its last block of slots holding a valid one (the indexer's top-k puts
    unused slots last). cost_q_offset: for the kernels' declared cost only, query s sits at
    position cost_q_offset + s of a causal self-selection, so it fills at most that position + 1 slots
    (`dsa_cost.causal_row_blocks`); None counts every block.
    row_gradients (Triton only): how the backward sums each selected row's gradients into d(latent).
    "scatter": per-slot rows written by the kernel in query chunks, then sorted and scatter-added by XLA;
    "atomic": the kernel adds them into fp32 d(latent) with atomic adds over the whole sequence at once (no
    per-slot buffer, no scatter; bwd_query_chunk unused). Both sum in fp32 in an order that varies between runs
    on a GPU (XLA's scatter-add is atomic there too).
    """
    layout, bwd_query_chunk, interpret = validate_sparse_call(q, latent, indices, scale, kv_lora_rank, block_n,
                                                              bwd_query_chunk, interpret, cost_q_offset)
    check_row_gradients(row_gradients, resolve_platform(platform))
    if resolve_platform(platform) == "tpu":
        return tpu_sparse_mla(q, latent, indices, float(scale), layout, bwd_query_chunk, interpret, cost_q_offset)
    return _sparse_mla(q, latent, indices, float(scale), layout, bwd_query_chunk, interpret, cost_q_offset,
                       row_gradients)
