"""What the Triton and the Mosaic (TPU) sparse MLA kernels share: the padded layout of queries, latent rows and
indices, its input checks, and the chunked backward that scatter-adds per-slot row gradients into d(latent).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from jax import lax

from pallas_kernels._common import (
    MIN_BLOCK,
    check_block,
    check_equal,
    check_float_dtype,
    check_int_dtype,
    check_rank,
    next_power_of_two,
    pad_axis,
    round_up,
)
from pallas_kernels.shared_memory import MAX_STAGES, fit_block_and_stages, fits


@dataclasses.dataclass(frozen=True)
class MlaLayout:
    """Real and kernel (power-of-two padded) sizes of one sparse MLA call."""

    heads: int
    latent_dim: int
    rope_dim: int
    num_slots: int
    block_n: int

    @property
    def heads_padded(self) -> int:
        return next_power_of_two(self.heads, MIN_BLOCK)

    @property
    def latent_padded(self) -> int:
        return next_power_of_two(self.latent_dim, MIN_BLOCK)

    @property
    def rope_padded(self) -> int:
        return next_power_of_two(self.rope_dim, MIN_BLOCK)

    @property
    def slots_padded(self) -> int:
        return round_up(self.num_slots, self.block_n)


def validate_sparse_inputs(q, latent, indices, kv_lora_rank: int, block_n: int) -> MlaLayout:
    """Checks shapes/dtypes of a sparse MLA call and returns its layout (raises ValueError)."""
    check_rank("q", q, 4, "[B, S, H, C+R]")
    check_rank("latent", latent, 3, "[B, T, C+R]")
    check_rank("indices", indices, 3, "[B, S, N]")
    check_float_dtype("q", q)
    check_float_dtype("latent", latent)
    check_int_dtype("indices", indices)
    check_equal("latent.dtype", latent.dtype, q.dtype, "q and latent feed the same matmuls")
    batch, q_len, heads, width = q.shape
    check_equal("latent.shape[-1]", latent.shape[-1], width, "q and latent rows are both C+R wide")
    check_equal("latent.shape[0]", latent.shape[0], batch, "batch of q")
    check_equal("indices.shape[:2]", tuple(indices.shape[:2]), (batch, q_len), "[B, S] of q")
    if not isinstance(kv_lora_rank, int) or not 0 < kv_lora_rank < width:
        raise ValueError(f"kv_lora_rank must be an int in (0, {width}) (the C of C+R={width}); "
                         f"got {kv_lora_rank!r}")
    check_block("block_n", block_n)
    if indices.shape[2] < 1 or latent.shape[1] < 1:
        raise ValueError(f"need at least one selected slot and one key; got indices.shape={indices.shape}, "
                         f"latent.shape={latent.shape}")
    return MlaLayout(heads=heads, latent_dim=kv_lora_rank, rope_dim=width - kv_lora_rank,
                     num_slots=indices.shape[2], block_n=block_n)


def split_queries(q: jax.Array, layout: MlaLayout) -> tuple[jax.Array, jax.Array]:
    """[B, S, H, C+R] -> latent part [B, S, Hp, Cp] and rope part [B, S, Hp, Rp], zero padded."""
    q_c = pad_axis(pad_axis(q[..., : layout.latent_dim], 3, layout.latent_padded), 2, layout.heads_padded)
    q_r = pad_axis(pad_axis(q[..., layout.latent_dim:], 3, layout.rope_padded), 2, layout.heads_padded)
    return q_c, q_r


def split_latent(latent: jax.Array, layout: MlaLayout) -> tuple[jax.Array, jax.Array]:
    """[B, T, C+R] -> keys/values [B, T, Cp] and rope keys [B, T, Rp], zero padded."""
    return (pad_axis(latent[..., : layout.latent_dim], 2, layout.latent_padded),
            pad_axis(latent[..., layout.latent_dim:], 2, layout.rope_padded))


def pad_indices(indices: jax.Array, layout: MlaLayout) -> jax.Array:
    return pad_axis(indices.astype(jnp.int32), 2, layout.slots_padded, value=-1)


def kernel_warps(layout: MlaLayout) -> int:
    """Warps of the Triton row-gathering forwards (sparse MLA, sparse KL target). At GLM-5's 64 x 512 on an H200
    (S = T = 8192) the sparse MLA forward took 13.0 ms at 8 warps, 20.2 at 4 and 27.7 at 16."""
    return 8 if layout.heads_padded * layout.latent_padded >= 64 * 512 else 4


# Warps of the Triton sparse MLA backward, whatever the layout: on an H200 (GLM-5 bf16, S = T = 8192; timed by
# benchmarks/gpu_kernel_sweep.py, 2026-12-04) forward+backward took 63.8 ms with it at 4 warps, 80.4 at 8 and
# 210.7 at 16 (the forward the same 13.0 ms in each).
SPARSE_MLA_BACKWARD_WARPS = 4
# Pipeline stages of the Triton sparse MLA forward: Triton's pipelining of its gathered rows bought nothing there
# (11.9 ms at 1 stage, 13.0 at 2, same run); the sparse KL target keeps the plan's stages (not timed).
SPARSE_MLA_FORWARD_STAGES = 1


def gather_kernel_plan(layout: MlaLayout, itemsize: int, max_stages: int = MAX_STAGES) -> tuple[int, int]:
    """(rows gathered per step, pipeline stages) of the Triton row-gathering kernels (sparse MLA forward,
    sparse KL target) on the target GPU: the query's Hp x (Cp+Rp) block stays in shared memory, and each
    stage holds one block of gathered rows (GLM-5 bf16, block_n 64: 72 KiB + 72 KiB per stage -> 2 stages
    in 227 KiB). The block is layout.block_n unless that does not fit even in one stage (fp32 at GLM-5)."""
    width = layout.latent_padded + layout.rope_padded
    return fit_block_and_stages(
        layout.block_n, lambda block, stages: (layout.heads_padded + stages * block) * width * itemsize,
        max_stages=max_stages)


# Below 64 gathered rows per step, Triton keeps the sparse MLA backward's resident queries and d_out twice in
# shared memory (compiled for sm_90: 296,960 / 315,392 / 212,992 bytes at blocks 16 / 32 / 64 for GLM-5 bf16).
FULL_BACKWARD_BLOCK = 64


def backward_plan(layout: MlaLayout, itemsize: int) -> tuple[int, int]:
    """(slots per step, column parts of C) of the Triton backward on the target GPU: the largest block not
    above layout.block_n, computed in the fewest column parts, that fits; a block below 64 that does not fit
    is raised to 64 first (the backward pads the indices to its own block), where the tiles are held once.

    Shared memory: queries Hp x (Cp+Rp) and d_out Hp x Cp stay for the whole loop (twice below a block of 64),
    plus the larger of the block's gathered rows block x (Cp+Rp) and (after them) the d logits Hp x block with
    one fp32 block x Cp/parts row-gradient part, which Triton converts between layouts in shared memory.
    GLM-5 bf16, block 64: 136 KiB + 72 KiB at two parts. When nothing fits (fp32 at GLM-5: the resident tiles
    alone are 272 KiB), the smallest block and most parts: the compiler then reports how much the kernel asks
    for.
    """
    c_dim, heads = layout.latent_padded, layout.heads_padded
    width = c_dim + layout.rope_padded
    resident = heads * (width + c_dim) * itemsize
    most_parts = max(1, c_dim // MIN_BLOCK)

    def footprint(block: int, parts: int) -> int:
        held = resident * (2 if block < FULL_BACKWARD_BLOCK else 1)
        return held + max(block * width * itemsize, heads * block * itemsize + block * c_dim // parts * 4)

    def fewest_parts(block: int) -> int:
        parts = 1
        while parts < most_parts and not fits(footprint(block, parts)):
            parts *= 2
        return parts

    block = layout.block_n
    if block < FULL_BACKWARD_BLOCK and not fits(footprint(block, fewest_parts(block))):
        block = FULL_BACKWARD_BLOCK
    while True:
        parts = fewest_parts(block)
        if fits(footprint(block, parts)) or block == MIN_BLOCK:
            return block, parts
        block //= 2


# Queries per backward step when the caller names none (`backward_query_chunk`).
MIN_BWD_QUERY_CHUNK, MAX_BWD_QUERY_CHUNK = 512, 2048
ACCUMULATOR_SHARE = 8  # each step's fp32 d(latent) traffic is at most 1/8 of its per-slot row gradients'


def backward_query_chunk(num_keys: int, num_slots: int, itemsize: int) -> int:
    """Queries per backward step of a sparse MLA call that names none: the smallest power of two from 512 (at
    most 2048) at which the step's read and write of the whole fp32 d(latent) [T, W] (the scatter's
    accumulator) is at most an eighth of the per-slot row gradients the step writes and reads back ([chunk, N,
    W] in the latent's dtype). GLM-5 (N 2048, bf16): 512 up to T = 65,536, 1024 to 131,072, 2048 beyond (at
    202,752 one layer's DSA training step moves 3888 GB instead of 4121 on v5p; the per-slot buffer grows from
    1.3 to 5.4 GB per sequence)."""
    chunk = MIN_BWD_QUERY_CHUNK
    while (chunk < MAX_BWD_QUERY_CHUNK
           and ACCUMULATOR_SHARE * 2 * num_keys * 4 > 2 * chunk * num_slots * itemsize):
        chunk *= 2
    return chunk


def _scatter_add_rows(acc: jax.Array, rows: jax.Array, values: jax.Array) -> jax.Array:
    """acc[b, rows[b, m]] += values[b, m] for every m, duplicates summed in acc's dtype (fp32, whatever the
    values' dtype); out-of-range rows dropped.

    The rows are sorted here and the values read in that order by the scatter itself: XLA:TPU sorts an
    unsorted scatter's indices anyway when acc does not fit on chip, but then converts bf16 values to fp32
    in HBM first; a sorted scatter reads them once, in their own dtype."""

    def one_batch(a, r, v):
        sorted_rows, order = lax.sort_key_val(r, lax.iota(jnp.int32, r.shape[0]))
        return a.at[sorted_rows].add(v[order].astype(a.dtype), mode="drop", indices_are_sorted=True)

    return jax.vmap(one_batch)(acc, rows, values)


def backward_shift(out, d_out, d_lse):
    """do.out - d lse per (query, head), fp32 [B, S, H]: d loss / d logit = p * (do.v - shift)."""
    return jnp.sum(out.astype(jnp.float32) * d_out.astype(jnp.float32), axis=-1) - d_lse


def chunked_backward(chunk_kernel, q_parts, latent_parts, idx, *per_query, chunk: int, dq_init=None):
    """A row-gathering backward over bounded query chunks; shared by the Triton and the TPU sparse MLA kernels
    and the TPU backward of the index scores at a selection (`tpu_selected_scores`).

    q_parts: padded queries, each [B, S, Hp, *]; latent_parts: padded latent, each [B, T, *]; idx int32
    [B, S, Np] (-1 = unused; or any [B, S, ...] arrangement of the Np slots, such as the TPU kernels' blocks);
    per_query: the other per-query inputs [B, S, ...] (sparse MLA: d_out [B, S, Hp, *], lse and shift fp32
    [B, S, Hp]). All of them are padded here to a whole number of chunks.
    For the chunk of queries [start, start + chunk), chunk_kernel(start, dq_parts, q_parts, idx, latent_parts,
    *per_query) (the full-length arrays; `sliced_chunks` adapts a kernel of one chunk's slices) returns
    (dq_parts with the chunk's rows written, dk_parts): per-(query, slot) head-summed row gradients
    [B, chunk Np, *] like latent_parts, in the latent's dtype (each row summed over heads in fp32 and rounded
    once: half the HBM bytes of fp32 rows in bf16). Those rows are scatter-added into fp32 d(latent) with
    `.at[].add` here, chunk after chunk. dq_init(shape, dtype) makes the dq buffers (default zeros: every row
    is written by its chunk, so a kernel writing them in place can start from an uninitialised buffer).
    Returns (dq_parts [B, S, Hp, *], d(latent) parts fp32 [B, T, *]).
    """
    batch, q_len = q_parts[0].shape[:2]  # idx may come padded already (to whole chunks, with -1)
    num_keys = latent_parts[0].shape[1]
    chunk = min(chunk, q_len)
    padded_len = round_up(q_len, chunk)

    def pad_queries(x, value=0):
        return pad_axis(x, 1, padded_len, value)

    q_parts = tuple(pad_queries(x) for x in q_parts)
    idx = pad_queries(idx, value=-1)
    per_query = tuple(pad_queries(x) for x in per_query)
    # Materialised once, before the loop: XLA would otherwise sink a broadcast operand (a constant cotangent,
    # such as a sum loss's) into the loop body, where a kernel reading the full-length array makes all of it
    # every chunk (DSA at 64K tokens: +540 GB).
    per_query = lax.optimization_barrier(per_query)

    def chunk_step(c, carry):
        dq_parts, dlat_parts = carry
        start = c * chunk
        dq_parts, dk_chunk = chunk_kernel(start, dq_parts, q_parts, idx, latent_parts, *per_query)
        idx_chunk = lax.dynamic_slice_in_dim(idx, start, chunk, axis=1)
        rows = jnp.where((idx_chunk >= 0) & (idx_chunk < num_keys), idx_chunk, num_keys).reshape(batch, -1)
        dlat_parts = tuple(_scatter_add_rows(acc, rows, dk.reshape(batch, rows.shape[1], -1))
                           for acc, dk in zip(dlat_parts, dk_chunk))
        return dq_parts, dlat_parts

    make_dq = dq_init or (lambda shape, dtype: jnp.zeros(shape, dtype))
    init = (tuple(make_dq(x.shape, x.dtype) for x in q_parts),
            tuple(jnp.zeros(x.shape, jnp.float32) for x in latent_parts))
    dq_parts, dlat_parts = lax.fori_loop(0, padded_len // chunk, chunk_step, init)
    return tuple(x[:, :q_len] for x in dq_parts), dlat_parts


def sliced_chunks(kernel, chunk: int):
    """A `chunked_backward` chunk kernel from kernel(q_parts, idx, latent_parts, *per_query) -> (dq_parts,
    dk_parts) of one chunk's slices: it slices the chunk out of each per-query array and writes its dq back."""

    def chunk_kernel(start, dq_parts, q_parts, idx, latent_parts, *per_query):
        def take(x):
            return lax.dynamic_slice_in_dim(x, start, min(chunk, x.shape[1]), axis=1)

        dq_chunk, dk_chunk = kernel(tuple(take(x) for x in q_parts), take(idx), latent_parts,
                                    *(take(x) for x in per_query))
        dq_parts = tuple(lax.dynamic_update_slice_in_dim(acc, dq, start, axis=1)
                         for acc, dq in zip(dq_parts, dq_chunk))
        return dq_parts, dk_chunk

    return chunk_kernel
