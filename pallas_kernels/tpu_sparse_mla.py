"""Mosaic TPU versions of sparse MLA attention (forward + backward) and of the sparse KL target.

Same math and contract as `sparse_mla.py` / `indexer_kl_target.py`; what differs is how a query's selected
rows reach the kernel. Mosaic has no pointer gathers, so the latent stays in HBM (memory_space ANY) and
each program (one query, its H heads as matmul rows) copies its selected rows into a VMEM scratch with one
DMA per row, block_n rows per block, reading the row numbers as scalars from its [N/block_n, block_n]
block of indices in SMEM. Invalid slots (-1 or >= T) copy row 0 and are masked in the logits. The gathers
are double-buffered: block j+1's DMAs are started before block j is computed. A program stops after its query's
last block holding a valid slot (`row_block_counts`, an SMEM input): the top-k puts unused slots last, so queries
that see fewer than N keys skip their trailing blocks' DMAs and FLOPs. The forward can also write the
sparse KL target (`tpu_sparse_mla_with_target`) from the logits it keeps in VMEM, so the rows are gathered once
for both; `tpu_sparse_target` is the stand-alone target, which gathers them again.

TPU layout: the latent row is one lane-padded width W = C+R rounded up to 128 (GLM-5: 576 -> 640), values
are its first V = min(C rounded up to 128, W) columns, heads are padded to a multiple of 16 (bf16 sublane
tile); every block's last two dims equal the array's. In HBM, bf16 rows travel as pairs of columns packed in
uint32 words (`latent_rows`): 1536 bytes per GLM-5 row instead of a (2, 128)-tiled 2560. Per-head vectors
(lse, shift) travel as [.., Hp, 1]. The backward writes each query's head-summed per-slot row gradients (in
the latent's dtype) straight to HBM, block by block (two VMEM buffers), and reuses
`sparse_mla.chunked_backward` for the bounded query chunks and the scatter.
"""

from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from pallas_kernels._common import NEG_INF, dot_nn, dot_nt, dot_tn, pad_axis, round_up, tpu_interpret
from pallas_kernels.dsa_cost import (
    array_bytes,
    causal_row_blocks,
    chunk_row_blocks,
    gathered_rows_cost,
    sparse_mla_backward_flops,
    sparse_mla_forward_flops,
    sparse_target_flops,
    sparse_target_from_scores_flops,
)
from pallas_kernels.mla_layout import MlaLayout, backward_shift, chunked_backward, pad_indices
from pallas_kernels.uninitialized import uninitialized

LANES = 128
HEAD_MULTIPLE = 16  # bf16 packs 16 rows per (16, 128) VMEM tile


@dataclasses.dataclass(frozen=True)
class TpuSizes:
    """Padded TPU sizes of one call: heads Hp, row width W, value width V (the first V columns of a row)."""

    heads: int
    width: int
    values: int

    @classmethod
    def of(cls, layout: MlaLayout) -> TpuSizes:
        width = round_up(layout.latent_dim + layout.rope_dim, LANES)
        return cls(heads=round_up(layout.heads, HEAD_MULTIPLE), width=width,
                   values=min(round_up(layout.latent_dim, LANES), width))


def pad_queries(q: jax.Array, sizes: TpuSizes) -> jax.Array:
    """[B, S, H, X] -> [B, S, Hp, X], zero padded heads: the kernels widen each query block to the rows' W in VMEM
    (`wide_queries`), so no padded copy of the queries is made in HBM."""
    return pad_axis(q, 2, sizes.heads)


def wide_queries(q: jax.Array, width: int) -> jax.Array:
    """A query block [Hp, X] as [Hp, width], zero columns appended (they leave every dot product unchanged)."""
    if q.shape[1] == width:
        return q
    return jnp.concatenate([q, jnp.zeros((q.shape[0], width - q.shape[1]), q.dtype)], axis=1)


def latent_rows(latent: jax.Array, sizes: TpuSizes) -> jax.Array:
    """The rows the kernels gather, each one (1, P) tile that one DMA copies whole: [B, T, 1, P].

    fp32 (and other non-bf16) rows are the zero-padded [B, T, W]. A bf16 row in a (1, W) tile would be
    stored with (2, 128) tiles, every word half padding: twice its bytes read per gather. So bf16 rows are
    packed into uint32 words instead, column i in the low half of word i and column i + P in the high half
    (P = W rounded up to 256, halved: GLM-5 576 -> 384 words, 1536 bytes, not 2560); `unpack_rows` undoes it.
    """
    if latent.dtype != jnp.bfloat16:
        padded = pad_axis(latent, 2, sizes.width)
        return padded.reshape(*padded.shape[:2], 1, sizes.width)
    words = round_up(sizes.width, 2 * LANES) // 2
    padded = pad_axis(latent, 2, 2 * words)
    pairs = jnp.stack([padded[..., :words], padded[..., words:]], axis=-1)  # [B, T, P, 2]: low half first
    return lax.bitcast_convert_type(pairs, jnp.uint32)[:, :, None, :]


def unpack_rows(rows: jax.Array, width: int, dtype) -> jax.Array:
    """Gathered rows [n, P] as [n, width] in `dtype`: bf16 rows out of `latent_rows`' uint32 words (a bf16 value
    is the high half of the fp32 with the same bits, so the conversion is exact), other rows as they are."""
    if rows.dtype != jnp.uint32:
        return rows
    low = lax.bitcast_convert_type(rows << 16, jnp.float32)
    high = lax.bitcast_convert_type(rows & jnp.uint32(0xFFFF0000), jnp.float32)
    return jnp.concatenate([low, high], axis=1)[:, :width].astype(dtype)


def block_indices(indices: jax.Array, layout: MlaLayout) -> jax.Array:
    """int [B, S, N] -> int32 [B, S, Np / block_n, block_n], padded with -1."""
    idx = pad_indices(indices, layout)
    return idx.reshape(*idx.shape[:2], -1, layout.block_n)


def row_block_counts(idx: jax.Array, num_keys: int) -> jax.Array:
    """int32 [B, S, 1, 1]: per query, the number of row blocks up to its last block holding a valid slot (0: none).
    The programs gather and compute only those: the indexer's top-k puts unused slots (-1) last, so a query
    with fewer visible keys than N (near a sequence's start) skips its trailing blocks, rows and FLOPs alike.
    idx: [B, S, Np/block_n, block_n]."""
    has_valid = ((idx >= 0) & (idx < num_keys)).any(-1)
    last = jnp.max(jnp.where(has_valid, jnp.arange(1, idx.shape[2] + 1, dtype=jnp.int32), 0), axis=-1)
    return last.astype(jnp.int32)[:, :, None, None]


def valid_slots(idx_ref, j, num_keys: int) -> jax.Array:
    """[1, block_n] mask of block j's slots that name a row in [0, T)."""
    idx = idx_ref[pl.ds(j, 1), :]
    return (idx >= 0) & (idx < num_keys)


def for_each_row_block(idx_smem, count_smem, lat_hbm, buf, sem, body, init, like):
    """carry = body(j, rows [block_n, W], carry) for the first count_smem[0, 0] blocks j of this query's selected
    rows (`row_block_counts`: the later ones hold no valid slot), the rows in the width and dtype of `like` (the
    query block [Hp, W]).

    Rows are DMA'd from HBM one by one into buf [2, block_n, 1, P]; block j+1's copies are in flight while
    block j is computed. All copies of one buffer signal its semaphore; each wait consumes one row's worth.
    lat_hbm is `latent_rows`' [B, T, 1, P]: a row is its own (1, P) tile, so row n of a block lands at offset n
    of an untiled dimension. Mosaic rejects single-row copies into a [.., block_n, W] buffer, whose second-minor
    dimension is tiled by 8 (16 for packed bf16): the offset n is not tile-aligned.
    """
    block_n = idx_smem.shape[1]
    num_blocks = count_smem[0, 0]
    num_keys = lat_hbm.shape[1]
    batch = pl.program_id(0)

    def row_copy(row, slot, n):
        return pltpu.make_async_copy(lat_hbm.at[batch, pl.ds(row, 1)], buf.at[slot, pl.ds(n, 1)], sem.at[slot])

    def start(j, slot):
        def start_row(n, carry):
            row = idx_smem[j, n]
            row_copy(jnp.where((row >= 0) & (row < num_keys), row, 0), slot, n).start()
            return carry

        lax.fori_loop(0, block_n, start_row, 0)

    def wait(slot):
        def wait_row(n, carry):
            row_copy(0, slot, n).wait()
            return carry

        lax.fori_loop(0, block_n, wait_row, 0)

    @pl.when(num_blocks > 0)
    def _():
        start(0, 0)

    def step(j, carry):
        slot = lax.rem(j, 2)

        @pl.when(j + 1 < num_blocks)
        def _():
            start(j + 1, 1 - slot)

        wait(slot)
        return body(j, unpack_rows(buf[slot, :, 0, :], like.shape[1], like.dtype), carry)

    return lax.fori_loop(0, num_blocks, step, init)


@dataclasses.dataclass(frozen=True)
class QueryWindow:
    """A gather_call over queries [start, start + length) of full-length per-query arrays (a backward chunk):
    the programs read their blocks in place and write their per-query outputs into `outputs` (full-length
    buffers, aliased), so no chunk of an input is copied out and no output chunk copied back in. A per-query
    input `length` queries long holds only the window's (one laid out at 128x its size, such as [.., Hp, 1],
    is better sliced per chunk than kept whole). start: int32 scalar (traced: the chunk loop's); counts:
    `row_block_counts` of the full indices, made once."""

    start: jax.Array
    length: int
    counts: jax.Array
    outputs: tuple[jax.Array, ...] = ()


def _gather_cost(idx, latent, per_query, out_shapes, *, flops: int, transcendentals: int,
                 visited_blocks: int | None, programs: int) -> pl.CostEstimate:
    """What one call computes and moves, for XLA's scheduler and cost analysis (it cannot see into Mosaic):
    `visited_blocks` row blocks over the `programs` (one per query; None: every block), each gathering block_n
    rows of P as stored (a (1, P) tile of a type narrower than 32 bits is padded to whole 32-bit words, which
    the DMA reads), and the per-program `flops` / `transcendentals` and HBM outputs (per-slot rows) in
    proportion; each program's blocks of the per-query inputs and outputs once."""
    batch, q_len, num_blocks, block_n = idx.shape
    block_bytes = block_n * latent.shape[-1] * max(latent.dtype.itemsize, 4)
    outputs = [(math.prod(shape) * jnp.dtype(dtype).itemsize, hbm) for shape, dtype, hbm in out_shapes]

    def share(size: int, queries: int) -> float:  # a window's programs move their queries' share of an array
        return size * min(1, programs / (batch * queries))

    moved = (sum(share(array_bytes(x), x.shape[1]) for x in (idx, *per_query))
             + sum(share(size, q_len) for size, hbm in outputs if not hbm))
    return gathered_rows_cost(
        programs, num_blocks, visited_blocks, block_bytes=block_bytes, moved_bytes=round(moved),
        per_slot_bytes=sum(size for size, hbm in outputs if hbm), flops=flops,
        transcendentals=transcendentals).estimate()


def gather_call(kernel, idx, latent, per_query, out_shapes, *, scratch=(), interpret: bool, flops: int,
                transcendentals: int, visited_blocks: int | None = None, window: QueryWindow | None = None):
    """pallas_call over grid (B, S) for a row-gathering kernel (S: the window's length, when given).

    Kernel arguments: idx (SMEM), the query's row-block count [1, 1] (SMEM, `row_block_counts`), idx (VMEM),
    latent (`latent_rows`, [B, T, 1, P], HBM), the per-query inputs, the outputs, then the row buffer
    [2, block_n, 1, P], its DMA semaphores and `scratch`.
    idx: [B, S, Np/block_n, block_n]; per-query inputs and outputs are [B, S, a, b] arrays read/written one
    [a, b] block per program, or HBM outputs (memory_space ANY) when given as (shape, dtype, "hbm").
    flops / transcendentals: per program, over all Np slots. visited_blocks: the row blocks the declared cost
    counts over the whole grid (`dsa_cost.causal_row_blocks`; None: every block).
    window: the programs cover only the window's queries of idx and the per-query arrays, and the per-query
    outputs are written into `window.outputs` in place (their out_shapes give the full shapes).
    """
    batch, q_len, _, block_n = idx.shape
    counts = row_block_counts(idx, latent.shape[1]) if window is None else window.counts
    programs = q_len if window is None else window.length

    def per_query_spec(shape, memory_space=None):
        def query_block(b, s, *start):  # query s of the grid is query start + s of a full-length array
            local = window is None or shape[1] == window.length
            return (b, s if local else s + start[0][0], 0, 0)

        kwargs = {} if memory_space is None else dict(memory_space=memory_space)
        return pl.BlockSpec((None, None, *shape[2:]), query_block, **kwargs)

    in_specs = [per_query_spec(idx.shape, pltpu.SMEM), per_query_spec(counts.shape, pltpu.SMEM),
                per_query_spec(idx.shape), pl.BlockSpec(memory_space=pl.ANY),
                *(per_query_spec(x.shape) for x in per_query)]
    out_specs = [pl.BlockSpec(memory_space=pl.ANY) if hbm else per_query_spec(shape)
                 for shape, _, hbm in out_shapes]
    inputs = [idx, counts, idx, latent, *per_query]
    scratch_shapes = [pltpu.VMEM((2, block_n, 1, latent.shape[-1]), latent.dtype), pltpu.SemaphoreType.DMA((2,)),
                      *scratch]
    params = dict(compiler_params=pltpu.CompilerParams(dimension_semantics=("parallel", "parallel")),
                  cost_estimate=_gather_cost(idx, latent, [counts, *per_query], out_shapes, flops=flops,
                                             transcendentals=transcendentals, visited_blocks=visited_blocks,
                                             programs=batch * programs),
                  interpret=tpu_interpret(interpret))
    out_shape = [jax.ShapeDtypeStruct(shape, dtype) for shape, dtype, _ in out_shapes]
    if window is None:
        return pl.pallas_call(kernel, grid=(batch, q_len), in_specs=in_specs, out_specs=out_specs,
                              out_shape=out_shape, scratch_shapes=scratch_shapes, **params)(*inputs)

    named = kernel
    while isinstance(named, functools.partial):
        named = named.func

    @functools.wraps(named)  # the kernel's own name in the jaxpr (remat policies and tests pick kernels by it)
    def windowed_kernel(start_ref, *refs):  # the buffers aliased to the outputs come after the inputs
        del start_ref
        kernel(*refs[: len(inputs)], *refs[len(inputs) + len(window.outputs):])

    start = jnp.reshape(window.start, (1,)).astype(jnp.int32)
    buffers = [pl.BlockSpec(memory_space=pl.ANY)] * len(window.outputs)  # written through the aliased outputs
    grid_spec = pltpu.PrefetchScalarGridSpec(num_scalar_prefetch=1, grid=(batch, window.length),
                                             in_specs=[*in_specs, *buffers], out_specs=out_specs,
                                             scratch_shapes=scratch_shapes)
    first_buffer = 1 + len(inputs)  # flat positions: the scalar prefetch operand first
    aliases = {first_buffer + i: i for i in range(len(window.outputs))}
    return pl.pallas_call(windowed_kernel, grid_spec=grid_spec, out_shape=out_shape, input_output_aliases=aliases,
                          **params)(start, *inputs, *window.outputs)


def _forward_kernel(idx_smem, count_smem, idx_ref, lat_hbm, q_ref, out_ref, lse_ref, *refs, scale, values, heads,
                    width):
    """One query's out [Hp, V] and lse [Hp, 1]; with the KL target (refs = target_ref, buf, sem, scores), also
    sum_h exp(logit - lse_h) / H at every slot, from the logits kept in `scores` [Np/block_n, Hp, block_n]
    (fp32, GLM-5: 512 KiB) as the row blocks arrive: the rows are gathered once for both. `heads`: the real H."""
    target_ref, buf, sem, scores = refs if len(refs) == 4 else (None, *refs, None)
    num_keys = lat_hbm.shape[1]
    q = wide_queries(q_ref[...], width)  # [Hp, W]
    heads_padded = q.shape[0]

    def body(j, rows, carry):
        row_max, row_sum, acc = carry
        valid = valid_slots(idx_ref, j, num_keys)
        logits = jnp.where(valid, dot_nt(q, rows) * scale, NEG_INF)  # [Hp, block_n]
        if scores is not None:
            scores[j] = logits
        new_max = jnp.maximum(row_max, jnp.max(logits, axis=1, keepdims=True))
        # where(), not exp alone: while a row has seen no valid slot, logits - new_max is 0 there.
        p = jnp.where(valid, jnp.exp(logits - new_max), 0.0)
        rescale = jnp.exp(row_max - new_max)
        row_sum = row_sum * rescale + jnp.sum(p, axis=1, keepdims=True)
        acc = acc * rescale + dot_nn(p.astype(rows.dtype), rows[:, :values])
        return new_max, row_sum, acc

    init = (jnp.full((heads_padded, 1), NEG_INF, jnp.float32), jnp.zeros((heads_padded, 1), jnp.float32),
            jnp.zeros((heads_padded, values), jnp.float32))
    row_max, row_sum, acc = for_each_row_block(idx_smem, count_smem, lat_hbm, buf, sem, body, init, q)
    has_valid = row_sum > 0
    safe_sum = jnp.where(has_valid, row_sum, 1.0)
    out_ref[...] = (acc / safe_sum).astype(out_ref.dtype)
    lse = jnp.where(has_valid, row_max + jnp.log(safe_sum), NEG_INF)
    lse_ref[...] = lse
    if target_ref is None:
        return
    # Padded heads and a query without valid slots take lse +1e30, so exp() gives them 0 everywhere; invalid
    # slots hold logits -1e30, 0 as well. Each real head sums to 1 over the valid slots: dividing by H
    # L1-normalises the head sum.
    counted = has_valid & (lax.broadcasted_iota(jnp.int32, (heads_padded, 1), 0) < heads)
    target_lse = jnp.where(counted, lse, -NEG_INF)

    def write_target(j, carry):
        p = jnp.exp(scores[j] - target_lse)  # [Hp, block_n]
        target_ref[pl.ds(j, 1), :] = jnp.sum(p, axis=0, keepdims=True) * (1.0 / heads)
        return carry

    def zero_target(j, carry):  # blocks past the last valid slot: no probability
        target_ref[pl.ds(j, 1), :] = jnp.zeros((1, target_ref.shape[1]), target_ref.dtype)
        return carry

    visited = count_smem[0, 0]
    lax.fori_loop(0, visited, write_target, 0)
    lax.fori_loop(visited, scores.shape[0], zero_target, 0)


def _backward_kernel(idx_smem, count_smem, idx_ref, lat_hbm, q_ref, do_ref, lse_ref, shift_ref, dq_ref, dk_hbm, buf,
                     sem, dk_buf, dk_sem, *, scale, values, width):
    num_keys = lat_hbm.shape[1]
    num_blocks, block_n = idx_ref.shape
    batch, query = pl.program_id(0), pl.program_id(1)
    q = wide_queries(q_ref[...], width)  # [Hp, W]
    d_out = do_ref[...]  # [Hp, V]
    lse = lse_ref[...]  # [Hp, 1]
    shift = shift_ref[...]  # [Hp, 1]: do.out - d lse

    def dk_copy(j, slot):  # one block of per-slot row gradients, VMEM -> HBM rows [query, slot] of [B, S Np, W]
        first = pl.multiple_of((query * num_blocks + j) * block_n, block_n)  # a tile-aligned offset, for Mosaic
        return pltpu.make_async_copy(dk_buf.at[slot], dk_hbm.at[batch, pl.ds(first, block_n)], dk_sem.at[slot])

    def body(j, rows, dq):
        slot = lax.rem(j, 2)
        valid = valid_slots(idx_ref, j, num_keys)
        p = jnp.where(valid, jnp.exp(dot_nt(q, rows) * scale - lse), 0.0)  # [Hp, block_n]
        # d loss / d logit = p * (do.v - (do.out - d lse)).
        d_logits = (p * (dot_nt(d_out, rows[:, :values]) - shift)).astype(rows.dtype)

        @pl.when(j >= 2)
        def _():
            dk_copy(j - 2, slot).wait()  # the buffer's previous block has left VMEM

        # Per-slot row gradients, summed over heads: key part over all W columns plus value part, added in
        # fp32 and rounded once to the buffer's dtype (lane-aligned halves: V is a multiple of 128).
        dk_key = scale * dot_tn(d_logits, q)  # [block_n, W]
        dk_buf[slot, :, :values] = (dk_key[:, :values] + dot_tn(p.astype(d_out.dtype), d_out)).astype(dk_buf.dtype)
        if values < dk_key.shape[1]:
            dk_buf[slot, :, values:] = dk_key[:, values:].astype(dk_buf.dtype)
        dk_copy(j, slot).start()
        return dq + dot_nn(d_logits, rows)

    dq = for_each_row_block(idx_smem, count_smem, lat_hbm, buf, sem, body, jnp.zeros(q.shape, jnp.float32), q)
    wait_row_gradients(dk_copy, count_smem[0, 0])
    dq_ref[...] = (scale * dq[:, : dq_ref.shape[1]]).astype(dq_ref.dtype)  # [Hp, X]: the zero columns dropped


def wait_row_gradients(dk_copy, visited) -> None:
    """Wait for the per-slot row-gradient copies still in flight: those of the last two visited blocks. Blocks
    past them were never written (their slots are unused: the scatter drops their rows)."""
    for back in (2, 1):
        j = visited - back

        @pl.when(j >= 0)
        def _():
            dk_copy(j, lax.rem(j, 2)).wait()


def _forward(q, latent, indices, scale, layout: MlaLayout, interpret: bool, with_target: bool = False,
             cost_q_offset: int | None = None):
    """(out, lse), and with_target the KL target [B, S, N] fp32 (L1-normalised head sum) from the same program."""
    sizes = TpuSizes.of(layout)
    q_p = pad_queries(q, sizes)
    batch, q_len = q.shape[:2]
    idx = block_indices(indices, layout)
    outputs = [((batch, q_len, sizes.heads, sizes.values), q.dtype, False),
               ((batch, q_len, sizes.heads, 1), jnp.float32, False)]
    flops = sparse_mla_forward_flops(sizes.heads, layout.slots_padded, sizes.width, sizes.values)
    transcendentals, scratch = sizes.heads * layout.slots_padded, []
    if with_target:
        outputs.append((idx.shape, jnp.float32, False))
        flops += sparse_target_from_scores_flops(sizes.heads, layout.slots_padded)
        transcendentals += sizes.heads * layout.slots_padded
        scratch.append(pltpu.VMEM((idx.shape[2], sizes.heads, layout.block_n), jnp.float32))
    results = gather_call(
        functools.partial(_forward_kernel, scale=scale, values=sizes.values, heads=layout.heads, width=sizes.width),
        idx, latent_rows(latent, sizes), [q_p], outputs, scratch=scratch, interpret=interpret, flops=flops,
        transcendentals=transcendentals,
        visited_blocks=batch * causal_row_blocks(cost_q_offset, q_len, layout.num_slots, layout.block_n))
    out, lse = results[0][:, :, : layout.heads, : layout.latent_dim], results[1][:, :, : layout.heads, 0]
    if not with_target:
        return out, lse
    target = results[2]
    return out, lse, target.reshape(*target.shape[:2], -1)[:, :, : layout.num_slots]


@functools.partial(jax.custom_vjp, nondiff_argnums=(3, 4, 5, 6, 7))
def tpu_sparse_mla(q, latent, indices, scale, layout, bwd_query_chunk, interpret, cost_q_offset=None):
    """The TPU kernels behind `sparse_mla_attention(..., platform="tpu")` (inputs already validated)."""
    return _forward(q, latent, indices, scale, layout, interpret, cost_q_offset=cost_q_offset)


def _tpu_sparse_mla_fwd(q, latent, indices, scale, layout, bwd_query_chunk, interpret, cost_q_offset):
    out, lse = _forward(q, latent, indices, scale, layout, interpret, cost_q_offset=cost_q_offset)
    return (out, lse), (q, latent, indices, out, lse)


def _tpu_sparse_mla_bwd(scale, layout, bwd_query_chunk, interpret, cost_q_offset, residuals, cotangents):
    q, latent, indices, out, lse = residuals
    d_out, d_lse = cotangents
    sizes = TpuSizes.of(layout)
    kernel = functools.partial(_backward_kernel, scale=scale, values=sizes.values, width=sizes.width)
    visited = q.shape[0] * chunk_row_blocks(cost_q_offset, q.shape[1], layout.num_slots, layout.block_n,
                                            bwd_query_chunk)
    rows = latent_rows(latent, sizes)  # made once, outside the chunk loop
    chunk = min(bwd_query_chunk, q.shape[1])
    # Every per-query array in the kernels' arrangement before the chunk loop (a reshape that changes the TPU
    # tiling is a copy, which inside the loop would copy the whole array every chunk), the indices as row blocks
    # padded to whole chunks, their row-block counts made once.
    idx = block_indices(pad_axis(indices, 1, round_up(q.shape[1], chunk), value=-1), layout)
    counts = row_block_counts(idx, latent.shape[1])

    def chunk_kernel(start, dq_parts, q_parts, idx, latent_parts, do, lse_p, shift_p):
        # The chunk's queries are read from and their dq written into the full-length arrays in place; lse and
        # shift are sliced per chunk: as the kernel's [.., Hp, 1] columns they would take 128x their bytes.
        (q_p,), (dq_p,) = q_parts, dq_parts
        del latent_parts  # the [B, T, W] padded latent sizes d(latent) only

        def column(x):
            return lax.dynamic_slice_in_dim(x, start, chunk, axis=1)[..., None]

        dq, dk = gather_call(
            kernel, idx, rows, [q_p, do, column(lse_p), column(shift_p)],
            # dk rows as [B, chunk Np, W], the scatter's shape: XLA then fuses their conversion to fp32 into it.
            [(q_p.shape, q_p.dtype, False),
             ((idx.shape[0], chunk * layout.slots_padded, sizes.width), latent.dtype, True)],
            scratch=[pltpu.VMEM((2, layout.block_n, sizes.width), latent.dtype), pltpu.SemaphoreType.DMA((2,))],
            interpret=interpret, transcendentals=sizes.heads * layout.slots_padded,
            flops=sparse_mla_backward_flops(sizes.heads, layout.slots_padded, sizes.width, sizes.values),
            visited_blocks=visited, window=QueryWindow(start, chunk, counts, (dq_p,)))
        return (dq,), (dk,)

    do_p = pad_axis(pad_axis(d_out.astype(q.dtype), 3, sizes.values), 2, sizes.heads)
    shift = backward_shift(out, d_out, d_lse)
    (dq,), (dlatent,) = chunked_backward(
        chunk_kernel, (pad_queries(q, sizes),), (pad_axis(latent, 2, sizes.width),), idx, do_p,
        pad_axis(lse, 2, sizes.heads), pad_axis(shift, 2, sizes.heads),
        chunk=bwd_query_chunk, dq_init=lambda shape, dtype: uninitialized(shape, dtype, lse, interpret))
    width = q.shape[-1]
    return (dq[:, :, : layout.heads, :width].astype(q.dtype), dlatent[..., :width].astype(latent.dtype), None)


tpu_sparse_mla.defvjp(_tpu_sparse_mla_fwd, _tpu_sparse_mla_bwd)


@functools.partial(jax.custom_vjp, nondiff_argnums=(3, 4, 5, 6, 7))
def tpu_sparse_mla_with_target(q, latent, indices, scale, layout, bwd_query_chunk, interpret, cost_q_offset=None):
    """`tpu_sparse_mla` that also returns the sparse KL target from the same program (one gather of the rows);
    the target is a constant: its cotangent is dropped and the backward is `tpu_sparse_mla`'s."""
    return _forward(q, latent, indices, scale, layout, interpret, with_target=True, cost_q_offset=cost_q_offset)


def _tpu_sparse_mla_with_target_fwd(q, latent, indices, scale, layout, bwd_query_chunk, interpret, cost_q_offset):
    out, lse, target = _forward(q, latent, indices, scale, layout, interpret, with_target=True,
                                cost_q_offset=cost_q_offset)
    return (out, lse, target), (q, latent, indices, out, lse)


def _tpu_sparse_mla_with_target_bwd(scale, layout, bwd_query_chunk, interpret, cost_q_offset, residuals,
                                    cotangents):
    d_out, d_lse, _ = cotangents
    return _tpu_sparse_mla_bwd(scale, layout, bwd_query_chunk, interpret, cost_q_offset, residuals, (d_out, d_lse))


tpu_sparse_mla_with_target.defvjp(_tpu_sparse_mla_with_target_fwd, _tpu_sparse_mla_with_target_bwd)


def _target_kernel(idx_smem, count_smem, idx_ref, lat_hbm, q_ref, lse_ref, out_ref, buf, sem, *, scale, width):
    num_keys = lat_hbm.shape[1]
    q = wide_queries(q_ref[...], width)  # [Hp, W]
    lse = lse_ref[...]  # [Hp, 1]; padded heads +1e30, so their probabilities are 0

    def body(j, rows, carry):
        valid = valid_slots(idx_ref, j, num_keys)
        p = jnp.where(valid, jnp.exp(dot_nt(q, rows) * scale - lse), 0.0)
        out_ref[pl.ds(j, 1), :] = jnp.sum(p, axis=0, keepdims=True)
        return carry

    for_each_row_block(idx_smem, count_smem, lat_hbm, buf, sem, body, 0, q)

    def zero(j, carry):  # blocks past the last valid slot
        out_ref[pl.ds(j, 1), :] = jnp.zeros((1, out_ref.shape[1]), out_ref.dtype)
        return carry

    lax.fori_loop(count_smem[0, 0], idx_ref.shape[0], zero, 0)


def tpu_sparse_target(q, latent, indices, lse, scale, layout: MlaLayout, padded_head_lse: float, interpret: bool):
    """Head sum of exp(scale q_h.k_n - lse_h) at the selected rows, fp32 [B, S, N], not normalised."""
    sizes = TpuSizes.of(layout)
    idx = block_indices(indices, layout)
    lse_p = pad_axis(lse.astype(jnp.float32), 2, sizes.heads, value=padded_head_lse)[..., None]
    kernel = functools.partial(_target_kernel, scale=scale, width=sizes.width)
    (p,) = gather_call(kernel, idx, latent_rows(latent, sizes), [pad_queries(q, sizes), lse_p],
                        [(idx.shape, jnp.float32, False)], interpret=interpret,
                        flops=sparse_target_flops(sizes.heads, layout.slots_padded, sizes.width),
                        transcendentals=sizes.heads * layout.slots_padded)
    return p.reshape(*p.shape[:2], -1)[:, :, : layout.num_slots]
