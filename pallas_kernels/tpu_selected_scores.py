"""Mosaic TPU backward of the lightning indexer's scores at a selection (the sparse KL's gradient): per query,
the selected index-key rows are DMA'd from HBM into VMEM block by block (`tpu_sparse_mla.for_each_row_block`),
the per-head logits are recomputed there, and dq, dw and the per-slot key-row gradients leave the program; the
[B, S, N, J] gathered rows and the [B, S, N, I] fp32 logits and their gradients never exist in HBM. The
per-slot rows are scatter-added into the fp32 dk outside, over bounded query chunks
(`mla_layout.chunked_backward`, as the sparse MLA backward does).

Per query (scale = J^-0.5, l[i, n] = scale q[i].k[n], g = d scores, zero on unused slots):
dl[i, n] = g[n] w[i] (l[i, n] > 0); dq[i] = scale sum_n dl[i, n] k[n]; dw[i] = sum_n g[n] relu(l[i, n]);
dk_slot[n] = scale sum_i dl[i, n] q[i]. Its reference is `selected_scores.gathered_scores` differentiated by
jax (`gathered_scores_backward`); there is no Triton version (the model keeps that jnp path on GPU).

Layout: heads padded to a multiple of 16 (zero queries and weights), J to a multiple of 128 lanes (zero
columns), N to a multiple of block_n (slots -1, cotangent 0). Rows travel as `tpu_sparse_mla.latent_rows`
(bf16 packed in uint32 words). Numerics: logits and every sum in fp32; q is cast to the keys' dtype as the
reference does, and dl is rounded to it for the two gradient products (bf16 MXU operands, as the sparse MLA
backward's d logits); fp32 keys multiply at HIGHEST precision.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from pallas_kernels._common import (
    check_block,
    check_cost_offset,
    check_equal,
    check_float_dtype,
    check_int_dtype,
    check_rank,
    dot_nn,
    dot_nt,
    dot_tn,
    pad_axis,
    resolve_interpret,
    resolve_platform,
    round_up,
)
from pallas_kernels.dsa_cost import chunk_row_blocks, selected_scores_backward_flops
from pallas_kernels.mla_layout import chunked_backward
from pallas_kernels.tpu_sparse_mla import (
    HEAD_MULTIPLE,
    LANES,
    QueryWindow,
    TpuSizes,
    for_each_row_block,
    gather_call,
    latent_rows,
    row_block_counts,
    valid_slots,
    wait_row_gradients,
)
from pallas_kernels.uninitialized import uninitialized


def _backward_kernel(idx_smem, count_smem, idx_ref, keys_hbm, q_ref, w_ref, g_ref, dq_ref, dw_ref, dk_hbm, buf, sem,
                     dk_buf, dk_sem, *, scale):
    num_keys = keys_hbm.shape[1]
    num_blocks, block_n = idx_ref.shape
    batch, query = pl.program_id(0), pl.program_id(1)
    q = q_ref[...]  # [Ip, Jp], the keys' dtype
    w = w_ref[...]  # [Ip, 1] fp32
    precision = lax.Precision.HIGHEST if q.dtype == jnp.float32 else None

    def dk_copy(j, slot):  # one block of per-slot key gradients, VMEM -> HBM rows [query, slot] of [B, S Np, Jp]
        first = pl.multiple_of((query * num_blocks + j) * block_n, block_n)  # a tile-aligned offset, for Mosaic
        return pltpu.make_async_copy(dk_buf.at[slot], dk_hbm.at[batch, pl.ds(first, block_n)], dk_sem.at[slot])

    def body(j, rows, carry):
        dq, dw = carry
        slot = lax.rem(j, 2)
        # Unused slots gathered row 0: their cotangent is zeroed, so they add nothing anywhere.
        g = jnp.where(valid_slots(idx_ref, j, num_keys), g_ref[pl.ds(j, 1), :], 0.0)  # [1, block_n]
        logits = dot_nt(q, rows, precision) * scale  # [Ip, block_n]
        dw = dw + jnp.sum(g * jnp.maximum(logits, 0.0), axis=1, keepdims=True)
        d_logits = jnp.where(logits > 0, g * w, 0.0).astype(rows.dtype)

        @pl.when(j >= 2)
        def _():
            dk_copy(j - 2, slot).wait()  # the buffer's previous block has left VMEM

        dk_buf[slot] = (scale * dot_tn(d_logits, q, precision)).astype(dk_buf.dtype)  # [block_n, Jp]
        dk_copy(j, slot).start()
        return dq + dot_nn(d_logits, rows, precision), dw

    init = (jnp.zeros(q.shape, jnp.float32), jnp.zeros(w.shape, jnp.float32))
    dq, dw = for_each_row_block(idx_smem, count_smem, keys_hbm, buf, sem, body, init, q)
    wait_row_gradients(dk_copy, count_smem[0, 0])
    dq_ref[...] = (scale * dq).astype(dq_ref.dtype)
    dw_ref[...] = dw


def _check_inputs(q_index, k_index, weights, indices, d_scores, block_n: int, bwd_query_chunk: int) -> None:
    check_rank("q_index", q_index, 4, "[B, S, I, J]")
    check_rank("k_index", k_index, 3, "[B, T, J]")
    check_rank("weights", weights, 3, "[B, S, I]")
    check_rank("indices", indices, 3, "[B, S, N]")
    check_rank("d_scores", d_scores, 3, "[B, S, N]")
    for name, x in (("q_index", q_index), ("k_index", k_index), ("weights", weights), ("d_scores", d_scores)):
        check_float_dtype(name, x)
    check_int_dtype("indices", indices)
    batch, q_len, heads, dim = q_index.shape
    check_equal("k_index.shape[0]", k_index.shape[0], batch, "batch of q_index")
    check_equal("k_index.shape[-1]", k_index.shape[-1], dim, "q_index and k_index share the indexer dim J")
    check_equal("weights.shape", tuple(weights.shape), (batch, q_len, heads), "[B, S, I] of q_index")
    check_equal("indices.shape[:2]", tuple(indices.shape[:2]), (batch, q_len), "[B, S] of q_index")
    check_equal("d_scores.shape", tuple(d_scores.shape), tuple(indices.shape), "the scores' [B, S, N]")
    check_block("block_n", block_n)
    if not isinstance(bwd_query_chunk, int) or isinstance(bwd_query_chunk, bool) or bwd_query_chunk < 0:
        raise ValueError(f"bwd_query_chunk must be an int >= 0 (0: all queries at once); got {bwd_query_chunk!r}")


def selected_scores_backward(q_index, k_index, weights, indices, d_scores, *, block_n: int = 64,
                             bwd_query_chunk: int = 0, interpret: bool | None = None, platform: str | None = None,
                             cost_q_offset: int | None = None):
    """(dq [B, S, I, J] in q_index.dtype, dw [B, S, I] in weights.dtype, dk [B, T, J] in k_index.dtype) of the
    index scores at the selection `indices` [B, S, N] (-1 or >= T: unused slot) for their cotangent d_scores
    [B, S, N]: `gathered_scores_backward` on the Mosaic TPU kernel. The key gradient sums the query chunks of
    `bwd_query_chunk` (0: one chunk) in fp32 and is rounded once. Only `platform` "tpu" has a kernel.
    Each query's program stops after its last block of block_n slots holding a valid one. cost_q_offset: for
    the declared cost only, query s sits at position cost_q_offset + s of a causal self-selection
    (`dsa_cost.causal_row_blocks`); None counts every block."""
    _check_inputs(q_index, k_index, weights, indices, d_scores, block_n, bwd_query_chunk)
    check_cost_offset(cost_q_offset)
    if resolve_platform(platform) != "tpu":
        raise ValueError(f"selected_scores_backward has a Mosaic TPU kernel only; got platform={platform!r} "
                         "(elsewhere use pallas_kernels.selected_scores.gathered_scores_backward)")
    interpret = resolve_interpret(interpret)
    batch, q_len, heads, dim = q_index.shape
    dtype = k_index.dtype
    sizes = TpuSizes(heads=round_up(heads, HEAD_MULTIPLE), width=round_up(dim, LANES),
                     values=round_up(dim, LANES))
    slots = round_up(indices.shape[2], block_n)
    chunk = min(bwd_query_chunk or q_len, q_len)
    q_p = pad_axis(pad_axis(q_index.astype(dtype), 3, sizes.width), 2, sizes.heads)
    w_p = pad_axis(weights.astype(jnp.float32), 2, sizes.heads)[..., None]
    # Every per-query array in the kernel's arrangement before the chunk loop (a reshape that changes the TPU
    # tiling is a copy, which inside the loop would copy the whole array every chunk): the indices and their
    # cotangents as row blocks, the indices padded to whole chunks, their row-block counts made once.
    blocks = (batch, round_up(q_len, chunk), slots // block_n, block_n)
    idx = pad_axis(pad_axis(indices.astype(jnp.int32), 2, slots, value=-1), 1, blocks[1], value=-1).reshape(blocks)
    counts = row_block_counts(idx, k_index.shape[1])
    g = pad_axis(pad_axis(d_scores.astype(jnp.float32), 2, slots), 1, blocks[1]).reshape(blocks)
    rows = latent_rows(k_index, sizes)  # made once, outside the chunk loop
    kernel = functools.partial(_backward_kernel, scale=dim**-0.5)
    visited = batch * chunk_row_blocks(cost_q_offset, q_len, indices.shape[2], block_n, chunk)

    def chunk_kernel(start, dq_parts, q_parts, idx, keys_parts, g):
        # The chunk's queries are read from and their dq, dw written into the full-length arrays in place.
        del keys_parts  # the padded keys size dk only
        q_c, w_c = q_parts
        dq, dw, dk = gather_call(
            kernel, idx, rows, [q_c, w_c, g],
            # dk rows as [B, chunk Np, Jp], the scatter's shape: XLA fuses their conversion to fp32 into it.
            [(q_c.shape, dtype, False), (w_c.shape, jnp.float32, False),
             ((batch, chunk * slots, sizes.width), dtype, True)],
            scratch=[pltpu.VMEM((2, block_n, sizes.width), dtype), pltpu.SemaphoreType.DMA((2,))],
            interpret=interpret, transcendentals=0, visited_blocks=visited,
            flops=selected_scores_backward_flops(sizes.heads, slots, sizes.width),
            window=QueryWindow(start, chunk, counts, dq_parts))
        return (dq, dw), (dk,)

    (dq, dw), (dk,) = chunked_backward(chunk_kernel, (q_p, w_p), (pad_axis(k_index, 2, sizes.width),), idx, g,
                                       chunk=chunk, dq_init=lambda shape, dtype: uninitialized(shape, dtype, g,
                                                                                                interpret))
    return (dq[:, :, :heads, :dim].astype(q_index.dtype), dw[:, :, :heads, 0].astype(weights.dtype),
            dk[..., :dim].astype(dtype))
