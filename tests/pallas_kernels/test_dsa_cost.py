"""The DSA kernels' cost formulas against counts made by hand (the GPU and TPU compile tiers check that the
compiled kernels declare them)."""

from __future__ import annotations

import jax.numpy as jnp

from pallas_kernels.dsa_cost import (
    KernelCost,
    array_bytes,
    causal_row_blocks,
    causal_tiles,
    dense_target_cost,
    gathered_rows_cost,
    indexer_scores_cost,
    sparse_mla_backward_flops,
    sparse_mla_forward_flops,
    sparse_target_flops,
    sparse_target_from_scores_flops,
)


def test_causal_tiles_count_the_key_blocks_up_to_each_query_blocks_last_position():
    # 10 queries at positions 0..9 in blocks of 4 (the last block holds 2), keys in blocks of 4 of 3:
    # last positions 3, 7, 9 -> 1, 2 and 3 key blocks.
    assert causal_tiles((0, 10, 1), 12, 4, 4, 3) == 6
    # From position 5: last positions 8, 12 (capped at 3 blocks), 14 -> 3 + 3 + 3.
    assert causal_tiles((5, 10, 1), 12, 4, 4, 3) == 9
    # A traced offset counts every tile of the call: 3 query blocks x 3 key blocks.
    assert causal_tiles((None, 10, 1), 12, 4, 4, 3) == 9
    # Two calls of 8 (padded) queries share the 6 tiles: 3 each. From position 4 with 4 key blocks,
    # 2 + 3 + 4 = 9 tiles over 2 calls: 5 each (rounded up).
    assert causal_tiles((0, 10, 2), 8, 4, 4, 3) == 3
    assert causal_tiles((4, 10, 2), 8, 4, 4, 4) == 5


def test_causal_row_blocks_count_the_blocks_each_query_can_fill():
    # N 40 slots in blocks of 16 (3 blocks); queries at positions 0..5 fill 1..6 slots: one block each.
    assert causal_row_blocks(0, 6, 40, 16) == 6
    # Positions 14..17 fill 15, 16, 17, 18 slots: 1, 1, 2, 2 blocks; from 40 on every query fills all 3.
    assert causal_row_blocks(14, 4, 40, 16) == 6
    assert causal_row_blocks(40, 5, 40, 16) == 15
    # GLM-5 at S = T = 4096, N 2048, blocks of 64: 64 x (1 + ... + 32) + 2048 x 32 of 4096 x 32 (75.8%).
    assert causal_row_blocks(0, 4096, 2048, 64) == 64 * 528 + 2048 * 32
    # Unknown positions (a traced offset, decoding): every block of every query.
    assert causal_row_blocks(None, 7, 40, 16) == 21


def test_sparse_mla_flops_per_query():
    heads, slots, width, values = 2, 3, 5, 4
    # Forward: scores [2, 5] x [5, 3] and values [2, 3] x [3, 4].
    assert sparse_mla_forward_flops(heads, slots, width, values) == 2 * (2 * 5 * 3 + 2 * 3 * 4)
    # Backward: scores, do.v [2, 4] x [4, 3], dq [2, 3] x [3, 5], key rows [3, 2] x [2, 5],
    # value rows [3, 2] x [2, 4].
    assert sparse_mla_backward_flops(heads, slots, width, values) == 2 * (30 + 24 + 30 + 30 + 24)
    assert sparse_target_flops(heads, slots, width) == 2 * 30
    # From logits already computed (the forward with the target): subtract the lse, add into the head sum.
    assert sparse_target_from_scores_flops(heads, slots) == 2 * 2 * 3


def test_costs_add_per_program_work_and_streamed_bytes():
    # 6 programs of 4 blocks (100 bytes of rows each); per-slot outputs of 480 bytes written for visited blocks.
    gathered = gathered_rows_cost(6, 4, None, block_bytes=100, moved_bytes=1000, per_slot_bytes=480, flops=8,
                                  transcendentals=4)
    assert gathered == KernelCost(flops=48, bytes_accessed=1000 + 480 + 24 * 100, transcendentals=24)
    # Stopping after 10 of the 24 blocks: work, rows and per-slot outputs in proportion, per-query bytes whole.
    stopped = gathered_rows_cost(6, 4, 10, block_bytes=100, moved_bytes=1000, per_slot_bytes=480, flops=8,
                                 transcendentals=4)
    assert stopped == KernelCost(flops=20, bytes_accessed=1000 + 200 + 10 * 100, transcendentals=10)
    # 2 batch rows x 5 tiles of [8, J 16] x [16, 4 keys]; each tile reads 4 keys of 16 bf16 and 4 segment ids.
    scores = indexer_scores_cost(2, 5, 8, 4, 16, 2, query_bytes=300, out_bytes=400)
    assert scores == KernelCost(flops=2 * 5 * 2 * 8 * 4 * 16, bytes_accessed=300 + 10 * 4 * (32 + 4) + 400,
                                transcendentals=0)
    dense = dense_target_cost(2, 5, 8, 4, 16, 2, passes=2, query_bytes=300, out_bytes=400)
    assert dense == KernelCost(flops=20 * 2 * 8 * 4 * 16, bytes_accessed=300 + 20 * 4 * (32 + 4) + 400,
                               transcendentals=20 * 8 * 4)
    assert array_bytes(jnp.zeros((3, 4), jnp.bfloat16), jnp.zeros((2,), jnp.int32)) == 24 + 8
