"""The grouped matmul on GPU: Pallas Triton kernels whose work is that of the rows' own groups, forward and
in both gradients (XLA's GPU `ragged_dot` is a dense masked product over all groups in the forward and in
the weight gradient).

- forward / input gradient: one program per (N tile, work tile); a work tile is a row tile paired with one
  group in it (megablox's `make_group_metadata`: a row tile that holds the end of one group and the start
  of the next is visited once per group), so there are at most M / bm + G - 1 of them. Each program runs
  its row tile against its group's weights over K and stores only its group's rows (a masked store: two
  programs may share a row tile, never a row).
- weight gradient: one program per (held group, K tile, N tile), looping over its group's row tiles and
  accumulating lhs^T d_out in fp32; an empty group stores zeros.

Rows are padded (zeros) to the row tile, K and N to their tiles; rows outside the held groups are never
stored, so the output and the input gradient are masked to the held groups' rows.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu
from jax.experimental.pallas.ops.tpu.megablox.gmm import make_group_metadata

from pallas_kernels._common import dot_nn, dot_nt, dot_tn, next_power_of_two, pad_axis, round_up, triton_params
from pallas_kernels._grouped_rows import held_rows_mask, visited_rows
from pallas_kernels.kernel_cost import declared_cost

GpuTiling = tuple[int, int, int]

# Row, K and N tiles at most (Triton tiles are powers of two, at least 16 wide for tl.dot).
MAX_TILING: GpuTiling = (128, 64, 128)
MIN_TILE = 16
NUM_WARPS = 8
# Shared memory one program may use on sm_90 (H100 / H200: 227 KiB opt-in per block).
SHARED_MEMORY_BYTES = 232448
MAX_STAGES = 3


def _tile(dim: int, limit: int) -> int:
    """The largest power of two at most `limit`, no larger than `dim` needs, at least MIN_TILE."""
    return max(MIN_TILE, min(1 << (limit.bit_length() - 1), next_power_of_two(dim)))


def _shared_memory_bytes(bm: int, bk: int, bn: int, itemsize: int) -> int:
    """The most one stage of input tiles and the fp32 output tile take among the three kernels: forward
    [bm,bk]x[bk,bn] -> [bm,bn], input gradient with bk and bn swapped, weight gradient [bm,bk]^T[bm,bn] -> [bk,bn]."""
    forward = (bm * bk + bk * bn) * itemsize + 4 * bm * bn
    input_grad = (bm * bn + bk * bn) * itemsize + 4 * bm * bk
    weight_grad = (bm * bk + bm * bn) * itemsize + 4 * bk * bn
    return max(forward, input_grad, weight_grad)


def choose_gpu_tiling(m: int, k: int, n: int, itemsize: int, limit: GpuTiling | None = None) -> GpuTiling:
    """Power-of-two (row, K, N) tiles: the limit's (default MAX_TILING), shrunk to small dims, then the
    largest halved until a stage of every kernel fits in shared memory."""
    max_m, max_k, max_n = MAX_TILING if limit is None else limit
    tiles = [_tile(m, max_m), _tile(k, max_k), _tile(n, max_n)]
    while _shared_memory_bytes(*tiles, itemsize) > SHARED_MEMORY_BYTES and max(tiles) > MIN_TILE:
        largest = tiles.index(max(tiles))
        tiles[largest] //= 2
    return tuple(tiles)


def _stages(input_tile_elements: int, out_tile_elements: int, itemsize: int) -> int:
    """Software-pipelined copies of the two input tiles that fit in shared memory beside the fp32 output tile
    (staged there on its way out): 3 in bf16 and 2 in fp32 at the default tiles."""
    free = SHARED_MEMORY_BYTES - 4 * out_tile_elements
    return max(1, min(MAX_STAGES, free // (input_tile_elements * itemsize)))


def _work_tiles_kernel(group_ids_ref, m_tile_ids_ref, bounds_ref, count_ref, offset_ref, lhs_ref, rhs_ref, out_ref,
                       *, bm: int, bk: int, bn: int, transpose_rhs: bool):
    n_i, t = pl.program_id(0), pl.program_id(1)

    @pl.when(t < count_ref[0])
    def _():
        group = group_ids_ref[t]
        row0 = m_tile_ids_ref[t] * bm
        rows = row0 + jax.lax.broadcasted_iota(jnp.int32, (bm, bn), 0)
        mine = (rows >= bounds_ref[group]) & (rows < bounds_ref[group + 1])
        local = group - offset_ref[0]
        k_tiles = lhs_ref.shape[1] // bk

        def step(k_i, acc):
            a = lhs_ref[pl.ds(row0, bm), pl.ds(k_i * bk, bk)]
            if transpose_rhs:  # rhs [G, N_out, K]: the input gradient's d_out x rhs[g]^T
                return acc + dot_nt(a, rhs_ref[local, pl.ds(n_i * bn, bn), pl.ds(k_i * bk, bk)])
            return acc + dot_nn(a, rhs_ref[local, pl.ds(k_i * bk, bk), pl.ds(n_i * bn, bn)])

        acc = jax.lax.fori_loop(0, k_tiles, step, jnp.zeros((bm, bn), jnp.float32))
        plgpu.store(out_ref.at[pl.ds(row0, bm), pl.ds(n_i * bn, bn)], acc.astype(out_ref.dtype), mask=mine)


def _work_tiles_matmul(lhs, rhs, group_sizes, group_offset, tiling: GpuTiling, transpose_rhs: bool, expected_rows,
                       interpret: bool):
    """lhs [Mp, Kp] x rhs [G, Kp, Np] (or [G, Np, Kp] transposed) by group -> [Mp, Np], rows of held groups."""
    bm, bk, bn = tiling
    m = lhs.shape[0]
    n = rhs.shape[1] if transpose_rhs else rhs.shape[2]
    held = rhs.shape[0]
    (bounds, group_ids, m_tile_ids), count = make_group_metadata(
        group_sizes=group_sizes, m=m, tm=bm, start_group=group_offset, num_nonzero_groups=held,
        visit_empty_groups=False)
    kernel = functools.partial(_work_tiles_kernel, bm=bm, bk=bk, bn=bn, transpose_rhs=transpose_rhs)
    call = pl.pallas_call(
        kernel,
        out_shape=jax.ShapeDtypeStruct((m, n), lhs.dtype),
        grid=(n // bn, group_ids.shape[0]),
        name="grouped_matmul_input_grad" if transpose_rhs else "grouped_matmul",
        interpret=interpret,
        compiler_params=triton_params(num_warps=NUM_WARPS,
                                      num_stages=_stages(bm * bk + bk * bn, bm * bn, lhs.dtype.itemsize)),
    )
    k, rows = lhs.shape[1], visited_rows(m, bm, held, expected_rows)  # programs past the work tiles return at once
    with declared_cost(2 * rows * k * n, (rows * k + held * k * n + rows * n) * lhs.dtype.itemsize):
        out = call(group_ids, m_tile_ids, bounds.astype(jnp.int32), count.astype(jnp.int32)[None],
                   group_offset[None], lhs, rhs)
    return jnp.where(held_rows_mask(group_sizes, group_offset, held, m), out, 0)


def _weight_grad_kernel(bounds_ref, offset_ref, lhs_ref, d_out_ref, out_ref, *, bm: int, bk: int, bn: int):
    local, k_i, n_i = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    group = local + offset_ref[0]
    start, end = bounds_ref[group], bounds_ref[group + 1]
    first = start // bm
    last = jnp.where(end > start, (end + bm - 1) // bm, first)  # row tiles [first, last) hold the group

    def step(tile, acc):
        rows = tile * bm + jax.lax.broadcasted_iota(jnp.int32, (bm, 1), 0)
        mine = (rows >= start) & (rows < end)
        a = jnp.where(mine, lhs_ref[pl.ds(tile * bm, bm), pl.ds(k_i * bk, bk)], 0)
        b = jnp.where(mine, d_out_ref[pl.ds(tile * bm, bm), pl.ds(n_i * bn, bn)], 0)
        return acc + dot_tn(a, b)

    acc = jax.lax.fori_loop(first, last, step, jnp.zeros((bk, bn), jnp.float32))
    out_ref[...] = acc.astype(out_ref.dtype)


def _weight_grad(lhs, d_out, group_sizes, group_offset, held: int, tiling: GpuTiling, interpret: bool,
                 expected_rows: int | None):
    """d_rhs [held, Kp, Np]: per held group, lhs[rows of g]^T d_out[rows of g]."""
    bm, bk, bn = tiling
    k, n = lhs.shape[1], d_out.shape[1]
    bounds = jnp.concatenate([jnp.zeros((1,), jnp.int32), jnp.cumsum(group_sizes, dtype=jnp.int32)])
    call = pl.pallas_call(
        functools.partial(_weight_grad_kernel, bm=bm, bk=bk, bn=bn),
        out_shape=jax.ShapeDtypeStruct((held, k, n), lhs.dtype),
        grid=(held, k // bk, n // bn),
        name="grouped_matmul_weight_grad",
        out_specs=pl.BlockSpec((None, bk, bn), lambda g, k_i, n_i: (g, k_i, n_i)),
        interpret=interpret,
        compiler_params=triton_params(num_warps=NUM_WARPS,
                                      num_stages=_stages(bm * bk + bm * bn, bk * bn, lhs.dtype.itemsize)),
    )
    m = visited_rows(lhs.shape[0], bm, held, expected_rows)  # each group loops over its own row tiles
    with declared_cost(2 * m * k * n, (m * k + m * n + held * k * n) * lhs.dtype.itemsize):
        return call(bounds, group_offset[None], lhs, d_out)


@functools.partial(jax.custom_vjp, nondiff_argnums=(4, 5, 6))
def _grouped(lhs, rhs, group_sizes, group_offset, tiling: GpuTiling, interpret: bool, expected_rows: int | None):
    return _work_tiles_matmul(lhs, rhs, group_sizes, group_offset, tiling, False, expected_rows, interpret)


def _grouped_fwd(lhs, rhs, group_sizes, group_offset, tiling, interpret, expected_rows):
    out = _work_tiles_matmul(lhs, rhs, group_sizes, group_offset, tiling, False, expected_rows, interpret)
    return out, (lhs, rhs, group_sizes, group_offset)


def _grouped_bwd(tiling, interpret, expected_rows, residuals, d_out):
    lhs, rhs, group_sizes, group_offset = residuals
    bm, bk, bn = tiling
    d_lhs = _work_tiles_matmul(d_out, rhs, group_sizes, group_offset, (bm, bn, bk), True, expected_rows, interpret)
    d_rhs = _weight_grad(lhs, d_out, group_sizes, group_offset, rhs.shape[0], tiling, interpret, expected_rows)
    return d_lhs, d_rhs, None, None


_grouped.defvjp(_grouped_fwd, _grouped_bwd)


def gpu_grouped_matmul(lhs: jax.Array, rhs: jax.Array, group_sizes: jax.Array, group_offset: jax.Array, *,
                       tiling: GpuTiling | None = None, interpret: bool = False,
                       expected_rows: int | None = None) -> jax.Array:
    """lhs [M, K] x rhs [G, K, N] by group -> [M, N] (inputs validated by `grouped_matmul`); the kernels
    declare the work of the row tiles `expected_rows` fill (`visited_rows`; None: all M)."""
    m, k = lhs.shape
    n = rhs.shape[2]
    bm, bk, bn = choose_gpu_tiling(m, k, n, lhs.dtype.itemsize, tiling)
    # The input gradient tiles K as its output (by bk) and N as its contraction (by bn): both divide the pads.
    k_pad, n_pad = round_up(k, max(bk, bn)), round_up(n, max(bk, bn))
    lhs = pad_axis(pad_axis(lhs, 0, round_up(m, bm)), 1, k_pad)
    rhs = pad_axis(pad_axis(rhs, 1, k_pad), 2, n_pad)
    return _grouped(lhs, rhs, group_sizes, group_offset, (bm, bk, bn), interpret, expected_rows)[:m, :n]
