"""The work the DSA kernels declare (FLOPs, HBM bytes, transcendentals), one formula per operation, shared by the
Triton (GPU) and Mosaic (TPU) versions where their programs do the same work.

FLOPs count 2 per multiply-add of a kernel's dots at its padded sizes, over the blocks its grid really visits;
transcendentals count one exp per score; bytes count every per-program input block read once and every output
written once, plus what a program streams past its own block: the rows it gathers (re-read from HBM by every
query that selects them) or the key blocks it visits. Mosaic kernels carry the cost as a `pl.CostEstimate`;
jax's Triton lowering drops that, so Triton kernels declare it around their call (`KernelCost.declared`).
"""

from __future__ import annotations

import dataclasses
import math

import jax.numpy as jnp
import numpy as np
from jax.experimental import pallas as pl

from pallas_kernels.kernel_cost import declared_cost

# The queries an indexer score call covers, for its declared cost: (position of query 0 as a Python int, or None
# when traced; number of queries; calls that split them in equal chunks, 1 unless chunked by `indexer_topk`).
QuerySpan = tuple[int | None, int, int]


@dataclasses.dataclass(frozen=True)
class KernelCost:
    """What one pallas_call computes and moves, over its whole grid."""

    flops: int
    bytes_accessed: int
    transcendentals: int

    def estimate(self) -> pl.CostEstimate:
        """For a Mosaic kernel's `cost_estimate=`."""
        return pl.CostEstimate(flops=self.flops, transcendentals=self.transcendentals,
                               bytes_accessed=self.bytes_accessed)

    def declared(self):
        """Context manager around a Triton kernel's call: its custom call carries this cost."""
        return declared_cost(self.flops, self.bytes_accessed, self.transcendentals)


def array_bytes(*arrays) -> int:
    """Bytes of arrays (or ShapeDtypeStructs) read or written whole."""
    return sum(math.prod(x.shape) * jnp.dtype(x.dtype).itemsize for x in arrays)


def sparse_mla_forward_flops(heads: int, slots: int, width: int, values: int) -> int:
    """One query's forward: scores [H, W] x [W, N] and values [H, N] x [N, V] (W = key row, V = value width)."""
    return 2 * heads * slots * (width + values)


def sparse_mla_backward_flops(heads: int, slots: int, width: int, values: int) -> int:
    """One query's backward: scores again, do.v ([H, V] x [V, N]), dq ([H, N] x [N, W]), and the per-slot row
    gradients: key part d_logits^T q ([N, H] x [H, W]) and value part p^T do ([N, H] x [H, V])."""
    return 2 * heads * slots * (3 * width + 2 * values)


def selected_scores_backward_flops(heads: int, slots: int, dim: int) -> int:
    """One query's backward of the index scores at its selection: the logits again ([I, J] x [J, N]), dq
    ([I, N] x [N, J]) and the per-slot key gradients ([N, I] x [I, J])."""
    return 3 * 2 * heads * slots * dim


def sparse_target_flops(heads: int, slots: int, width: int) -> int:
    """One query's sparse KL target: the scores alone."""
    return 2 * heads * slots * width


def sparse_target_from_scores_flops(heads: int, slots: int) -> int:
    """One query's sparse KL target from logits already computed (the fused forward): per logit a subtraction
    of its head's lse and an add into the head sum (its exp is a transcendental)."""
    return 2 * heads * slots


def gathered_rows_cost(programs: int, blocks_per_program: int, visited_blocks: int | None, *, block_bytes: int,
                       moved_bytes: int, per_slot_bytes: int, flops: int, transcendentals: int) -> KernelCost:
    """A row-gathering kernel with one program per query, each going through its selected rows in
    `blocks_per_program` blocks and stopping after its last block holding a valid slot: `visited_blocks` blocks
    over all programs (`causal_row_blocks`; None: every block). Bytes: the per-query inputs and outputs once
    (`moved_bytes`), each visited block's gathered rows (`block_bytes`, re-read from HBM by every query that
    selects them) and the per-slot outputs (`per_slot_bytes`, whole arrays) written for the visited blocks;
    per-program `flops` / `transcendentals` (over all its slots) in proportion to the blocks visited."""
    every_block = programs * blocks_per_program
    visited = every_block if visited_blocks is None else visited_blocks

    def share(total: int) -> int:  # work proportional to the slots a program visits
        return total * visited // every_block

    return KernelCost(flops=share(programs * flops), transcendentals=share(programs * transcendentals),
                      bytes_accessed=moved_bytes + share(per_slot_bytes) + visited * block_bytes)


def causal_row_blocks(first_position: int | None, num_queries: int, num_slots: int, block_n: int) -> int:
    """Row blocks of block_n slots the row-gathering kernels visit for `num_queries` queries of one batch row:
    each program stops after its last block holding a valid slot. A causal self-selection (query s at
    `first_position` + s picks keys at positions up to its own, unused slots last, as the indexer's top-k
    returns them) fills at most min(N, position + 1) slots; None (position unknown) counts every block."""
    full = -(-num_slots // block_n)
    if first_position is None:
        return num_queries * full
    positions = np.arange(first_position, first_position + num_queries)
    return int(np.minimum(-(-(positions + 1) // block_n), full).sum())


def chunk_row_blocks(cost_q_offset: int | None, q_len: int, num_slots: int, block_n: int, chunk: int) -> int:
    """Row blocks one call of `mla_layout.chunked_backward`'s loop body declares per batch row: the queries' total
    (`causal_row_blocks`) spread evenly over the chunks, rounded up (one compiled body serves every chunk)."""
    calls = -(-q_len // min(chunk, q_len))
    return -(-causal_row_blocks(cost_q_offset, q_len, num_slots, block_n) // calls)


def causal_tiles(span: QuerySpan, call_queries: int, block_s: int, block_t: int, key_blocks: int) -> int:
    """(query block, key block) tiles one call of a causally skipping kernel computes, per batch row.

    A block of block_s queries visits the key blocks up to its last query's position (query s sits at
    span[0] + s; padding queries see no key). span[2] calls of `call_queries` (padded) queries each cover the
    span[1] queries in order (indexer top-k's query chunks under `lax.map`, which share one compiled call):
    their total is spread evenly over the calls, rounded up. A traced first position (None) counts every
    tile: an upper bound.
    """
    first_position, num_queries, calls = span
    if first_position is None:
        return call_queries // block_s * key_blocks
    total = 0
    for start in range(0, min(num_queries, calls * call_queries), block_s):
        last = min(start + block_s, num_queries) - 1
        total += min(key_blocks, (first_position + last) // block_t + 1)
    return -(-total // calls)


def indexer_scores_cost(batch: int, tiles: int, rows: int, block_t: int, head_dim: int, itemsize: int,
                        query_bytes: int, out_bytes: int) -> KernelCost:
    """Indexer scores: per visited tile, a block's `rows` (queries x indexer heads) against block_t keys,
    [rows, J] x [J, block_t]; the keys (and their segment ids) are read once per tile that uses them.
    query_bytes: the per-query inputs (queries, weights, positions, segments), read once."""
    key_bytes = block_t * (head_dim * itemsize + 4)
    return KernelCost(flops=batch * tiles * 2 * rows * block_t * head_dim, transcendentals=0,
                      bytes_accessed=query_bytes + batch * tiles * key_bytes + out_bytes)


def dense_target_cost(batch: int, tiles: int, rows: int, block_t: int, width: int, itemsize: int, passes: int,
                      query_bytes: int, out_bytes: int) -> KernelCost:
    """Dense KL target: per pass and visited tile, [rows, W] x [W, block_t] logits and one exp per logit; the
    keys (and segment ids) are read once per tile and pass that uses them."""
    tile_visits = passes * batch * tiles
    return KernelCost(flops=tile_visits * 2 * rows * block_t * width,
                      transcendentals=tile_visits * rows * block_t,
                      bytes_accessed=query_bytes + tile_visits * block_t * (width * itemsize + 4) + out_bytes)
