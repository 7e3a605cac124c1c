"""The grouped matmul of one group on TPU (one routed expert per chip, as in the pod recipes), with its own
scoped VMEM limit: lhs [M, K] rows [0, rows) times rhs [K, N]; the rows past them are left undefined in the
output and the input gradient, and add nothing to the weight gradient.

megablox sets no VMEM limit on its kernels, so they get the chip's default scoped VMEM (16 MiB on v5p, 32 MiB on
v6e) unless the whole program is compiled with a larger one (`xla_tpu_scoped_vmem_limit_kib`), which changes how
XLA's own fusions use VMEM too (the v6e-256 step with 96 MiB for all: 2.79 -> 2.91 TB of HBM traffic, the grouped
matmuls' 0.20 TB less outweighed by the rest; benchmarks/BENCHMARKS.md). The forward and input-gradient kernels ask for
their own limit (`vmem_limit_bytes`), so larger row tiles re-read the expert's weights fewer times and nothing
else changes. The weight gradient's keeps the default: XLA fuses it with the dynamic update slice writing it into
the stacked layers' gradient, and such a fusion gets the default scoped limit whatever its kernel asks for (the
v6e-256 step: 61.5 MiB refused against 32).

Three kernels with megablox's tiling and cost model (`tpu_grouped_matmul`: the rows once per output-column tile,
the weights once per row tile, the output once): the forward, the input gradient (rhs transposed: N contracted)
and the weight gradient (lhs^T [K, M] x d_out [M, N], M contracted). Their row-tile grid dimension is the active
tiles only, cdiv(rows, tm), a traced size: no step visits a tile past the rows. The declared costs (static) are
the caller's: `tpu_grouped_matmul.declared_costs`, the tiles of the rows a step is expected to fill.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from pallas_kernels._common import dot_nn, dot_nt, dot_tn, tpu_interpret


def _active_tiles(rows: jax.Array, tile: int, at_least: int = 0) -> jax.Array:
    return jnp.maximum(lax.div(rows + tile - 1, tile), at_least).astype(jnp.int32)


def _rows_times_rhs_kernel(rows_ref, lhs_ref, rhs_ref, out_ref, acc_ref, *, transpose_rhs: bool):
    contracted = pl.program_id(2)

    @pl.when(contracted == 0)
    def _():
        acc_ref[...] = jnp.zeros(acc_ref.shape, jnp.float32)

    product = dot_nt if transpose_rhs else dot_nn
    acc_ref[...] += product(lhs_ref[...], rhs_ref[...])

    @pl.when(contracted == pl.num_programs(2) - 1)
    def _():
        out_ref[...] = acc_ref[...].astype(out_ref.dtype)


def _rows_times_rhs(lhs, rhs, rows, tiling, transpose_rhs: bool, vmem_limit: int, cost, interpret: bool):
    """lhs [M, C] x rhs [C, O] (rhs [O, C] with transpose_rhs) for the row tiles holding rows [0, rows)."""
    m, c = lhs.shape
    out_cols = rhs.shape[0] if transpose_rhs else rhs.shape[1]
    tm, tc, to = tiling
    rhs_block = (to, tc) if transpose_rhs else (tc, to)
    rhs_index = (lambda j, i, k, rows: (j, k)) if transpose_rhs else (lambda j, i, k, rows: (k, j))
    call = pl.pallas_call(
        functools.partial(_rows_times_rhs_kernel, transpose_rhs=transpose_rhs),
        grid_spec=pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=1,
            grid=(out_cols // to, _active_tiles(rows[0], tm), c // tc),
            in_specs=[pl.BlockSpec((tm, tc), lambda j, i, k, rows: (i, k)), pl.BlockSpec(rhs_block, rhs_index)],
            out_specs=pl.BlockSpec((tm, to), lambda j, i, k, rows: (i, j)),
            scratch_shapes=[pltpu.VMEM((tm, to), jnp.float32)]),
        out_shape=jax.ShapeDtypeStruct((m, out_cols), lhs.dtype),
        compiler_params=pltpu.CompilerParams(dimension_semantics=("parallel", "arbitrary", "arbitrary"),
                                             vmem_limit_bytes=vmem_limit),
        cost_estimate=pl.CostEstimate(flops=cost[0], bytes_accessed=cost[1], transcendentals=0),
        interpret=tpu_interpret(interpret),
    )
    return call(rows, lhs, rhs)


def _weight_grad_kernel(rows_ref, lhs_ref, d_out_ref, out_ref, acc_ref):
    tile = pl.program_id(2)
    tm = lhs_ref.shape[0]

    @pl.when(tile == 0)
    def _():
        acc_ref[...] = jnp.zeros(acc_ref.shape, jnp.float32)

    # Rows past `rows` in the last tile hold anything (NaN included): both operands are masked.
    held = tile * tm + lax.broadcasted_iota(jnp.int32, (tm, 1), 0) < rows_ref[0]
    lhs = jnp.where(held, lhs_ref[...], jnp.zeros((), lhs_ref.dtype))
    d_out = jnp.where(held, d_out_ref[...], jnp.zeros((), d_out_ref.dtype))
    acc_ref[...] += dot_tn(lhs, d_out)

    @pl.when(tile == pl.num_programs(2) - 1)
    def _():
        out_ref[...] = acc_ref[...].astype(out_ref.dtype)


def _weight_grad(lhs, d_out, rows, tiling, out_dtype, cost, interpret: bool):
    """lhs[:rows]^T x d_out[:rows]: [K, N] (at least one row tile is visited, so rows = 0 gives zeros), within the
    chip's default scoped VMEM (module docstring)."""
    k, n = lhs.shape[1], d_out.shape[1]
    tm, tk, tn = tiling
    call = pl.pallas_call(
        _weight_grad_kernel,
        grid_spec=pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=1,
            grid=(k // tk, n // tn, _active_tiles(rows[0], tm, at_least=1)),
            in_specs=[pl.BlockSpec((tm, tk), lambda a, b, i, rows: (i, a)),
                      pl.BlockSpec((tm, tn), lambda a, b, i, rows: (i, b))],
            out_specs=pl.BlockSpec((tk, tn), lambda a, b, i, rows: (a, b)),
            scratch_shapes=[pltpu.VMEM((tk, tn), jnp.float32)]),
        out_shape=jax.ShapeDtypeStruct((k, n), out_dtype),
        compiler_params=pltpu.CompilerParams(dimension_semantics=("parallel", "parallel", "arbitrary")),
        cost_estimate=pl.CostEstimate(flops=cost[0], bytes_accessed=cost[1], transcendentals=0),
        interpret=tpu_interpret(interpret),
    )
    return call(rows, lhs, d_out)


@functools.partial(jax.custom_vjp, nondiff_argnums=(3, 4, 5, 6))
def one_group_matmul(lhs, rhs, rows, tiles, vmem_limit: int, costs, interpret: bool):
    """lhs [M, K] (M a multiple of every row tile; K, N of the lanes) x rhs [K, N] for rows [0, rows[0]); the
    other rows of the output and of lhs's gradient undefined, none in rhs's. `tiles`: `GroupedTiles`; `costs`:
    (flops, bytes) declared by the forward, the input gradient and the weight gradient."""
    return _rows_times_rhs(lhs, rhs, rows, tiles.forward, False, vmem_limit, costs[0], interpret)


def _one_group_fwd(lhs, rhs, rows, tiles, vmem_limit, costs, interpret):
    return one_group_matmul(lhs, rhs, rows, tiles, vmem_limit, costs, interpret), (lhs, rhs, rows)


def _one_group_bwd(tiles, vmem_limit, costs, interpret, residuals, d_out):
    lhs, rhs, rows = residuals
    d_lhs = _rows_times_rhs(d_out, rhs, rows, tiles.input_grad, True, vmem_limit, costs[1], interpret)
    d_rhs = _weight_grad(lhs, d_out, rows, tiles.weight_grad, rhs.dtype, costs[2], interpret)
    return d_lhs, d_rhs, None


one_group_matmul.defvjp(_one_group_fwd, _one_group_bwd)
