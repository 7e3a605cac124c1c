"""The grouped matmul on TPU: megablox `gmm` forward, `gmm` with the weights transposed for the input
gradient and `tgmm` for the weight gradient, so every pass does the work of the rows' own groups
(XLA's `ragged_dot` weight gradient is a dense masked product over all G groups).

megablox needs the row count to be a multiple of the row tile and never writes rows outside the groups
held here: rows are padded (zeros) to the tile and the output and input gradient are masked to the held
groups' rows. K and N are padded to multiples of 128 (the TPU lane width) only when they are not already.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental.pallas.ops.tpu.megablox.gmm import gmm, tgmm

from pallas_kernels._common import pad_axis, round_up
from pallas_kernels._grouped_rows import held_rows_mask

Tiling = tuple[int, int, int]

LANE = 128
# MaxText's megablox tiles: the largest tried; each shrinks to fit the shapes and the VMEM budget.
MAX_TILING: Tiling = (512, 1024, 1024)
# Under v5p's 16 MiB default scoped VMEM (v6e: 32 MiB), with room for Mosaic's own scratch.
VMEM_BUDGET = 12 * 2**20


def _divisor_tile(dim: int, limit: int) -> int:
    """Largest multiple of LANE that is at most `limit` and divides `dim` (itself a multiple of LANE)."""
    tile = max(LANE, min(limit, dim) // LANE * LANE)
    while dim % tile:
        tile -= LANE
    return tile


def _vmem_bytes(tm: int, tk: int, tn: int, itemsize: int) -> int:
    """Largest scoped VMEM of the three kernels: double-buffered input and output tiles plus the fp32
    accumulator. Forward [tm,tk]x[tk,tn] -> [tm,tn]; input gradient the same with tk and tn swapped;
    weight gradient [tm,tk]^T x [tm,tn] -> [tk,tn]."""
    forward = 2 * (tm * tk + tk * tn + tm * tn) * itemsize + 4 * tm * tn
    input_grad = 2 * (tm * tn + tk * tn + tm * tk) * itemsize + 4 * tm * tk
    weight_grad = 2 * (tm * tk + tm * tn + tk * tn) * itemsize + 4 * tk * tn
    return max(forward, input_grad, weight_grad)


def choose_tiling(m: int, k: int, n: int, groups: int, itemsize: int, tiling: Tiling | None = None) -> Tiling:
    """(row tile, K tile, N tile) for rows M, K and N already padded to multiples of LANE.

    A given `tiling` is used as it is, clamped to the dims (K and N: the largest divisors up to it). Otherwise,
    from MAX_TILING: every group that starts inside a row tile costs one extra tile pass (megablox computes
    the tile once per group in it), so the row tile halves (down to LANE) until those at most G - 1 extra
    passes are at most half the tiles; K and N take the largest divisors up to their limits, then the larger
    of the two steps down to its next divisor until all three kernels fit the VMEM budget."""
    max_tm, max_tk, max_tn = MAX_TILING if tiling is None else tiling
    tm = max(LANE, round_up(min(max_tm, m), LANE))
    tk, tn = _divisor_tile(k, max_tk), _divisor_tile(n, max_tn)
    if tiling is not None:
        return tm, tk, tn
    while tm > LANE and 2 * (groups - 1) > m // tm:
        tm = max(LANE, tm // 2 // LANE * LANE)
    while _vmem_bytes(tm, tk, tn, itemsize) > VMEM_BUDGET and max(tk, tn) > LANE:
        if tk >= tn:
            tk = _divisor_tile(k, tk - LANE)
        else:
            tn = _divisor_tile(n, tn - LANE)
    return tm, tk, tn


@functools.partial(jax.custom_vjp, nondiff_argnums=(4, 5))
def _grouped(lhs, rhs, group_sizes, group_offset, tiling: Tiling, interpret: bool):
    return _grouped_fwd(lhs, rhs, group_sizes, group_offset, tiling, interpret)[0]


def _grouped_fwd(lhs, rhs, group_sizes, group_offset, tiling, interpret):
    out = gmm(lhs, rhs, group_sizes, lhs.dtype, tiling, group_offset, interpret=interpret)
    held = held_rows_mask(group_sizes, group_offset, rhs.shape[0], lhs.shape[0])
    return jnp.where(held, out, 0), (lhs, rhs, group_sizes, group_offset)


def _grouped_bwd(tiling, interpret, residuals, d_out):
    lhs, rhs, group_sizes, group_offset = residuals
    tm, tk, tn = tiling
    # d_lhs = d_out [M, N] x rhs[g]^T: N is contracted, K is the output's (tiles swapped).
    d_lhs = gmm(d_out, rhs, group_sizes, lhs.dtype, (tm, tn, tk), group_offset, transpose_rhs=True,
                interpret=interpret)
    d_lhs = jnp.where(held_rows_mask(group_sizes, group_offset, rhs.shape[0], lhs.shape[0]), d_lhs, 0)
    # d_rhs[g] = lhs[rows of g]^T x d_out[rows of g], accumulated in fp32 over the group's row tiles.
    d_rhs = tgmm(lhs.swapaxes(0, 1), d_out, group_sizes, rhs.dtype, tiling, group_offset, rhs.shape[0],
                 interpret=interpret)
    return d_lhs, d_rhs, None, None


_grouped.defvjp(_grouped_fwd, _grouped_bwd)


def tpu_grouped_matmul(lhs: jax.Array, rhs: jax.Array, group_sizes: jax.Array, group_offset: jax.Array, *,
                       tiling: Tiling | None = None, interpret: bool = False) -> jax.Array:
    """lhs [M, K] x rhs [G, K, N] by group -> [M, N] (inputs validated by `grouped_matmul`)."""
    m, k = lhs.shape
    n = rhs.shape[2]
    k_pad, n_pad = round_up(k, LANE), round_up(n, LANE)
    tm, tk, tn = choose_tiling(round_up(m, LANE), k_pad, n_pad, rhs.shape[0], jnp.dtype(lhs.dtype).itemsize,
                               tiling)
    lhs = pad_axis(pad_axis(lhs, 0, round_up(m, tm)), 1, k_pad)
    rhs = pad_axis(pad_axis(rhs, 1, k_pad), 2, n_pad)
    out = _grouped(lhs, rhs, group_sizes, group_offset, (tm, tk, tn), interpret)
    return out[:m, :n]
