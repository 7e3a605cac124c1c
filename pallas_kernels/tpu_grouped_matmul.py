"""The grouped matmul on TPU: megablox `gmm` forward, `gmm` with the weights transposed for the input
gradient and `tgmm` for the weight gradient, so every pass does the work of the rows' own groups
(XLA's `ragged_dot` weight gradient is a dense masked product over all G groups).

megablox needs the row count to be a multiple of the row tile and never writes rows outside the groups
held here: rows are padded (zeros) to the tile and the output and input gradient are masked to the held
groups' rows. K and N are padded to multiples of 128 (the TPU lane width) only when they are not already.

Each of the three kernels gets its own tiles (`choose_tiles`): the ones that move the fewest HBM bytes by the
kernel's own cost model (what megablox declares and the roofline counts: `gmm` re-reads a weight tile for every
row tile and a row tile for every output-column tile; `tgmm` re-reads rows for every output tile column and row)
within the scoped VMEM budget.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import itertools
import math
import re

import jax
import jax.numpy as jnp
from jax.experimental.pallas.ops.tpu.megablox.gmm import gmm, tgmm

from pallas_kernels._common import pad_axis, round_up
from pallas_kernels._grouped_rows import held_rows_mask, visited_rows
from pallas_kernels.kernel_cost import declared_cost
from pallas_kernels.tpu_one_group_matmul import one_group_matmul

Tiling = tuple[int, int, int]  # (rows, contracted, output columns) of one kernel's tiles

LANE = 128
MAX_ROW_TILE = 2048
# Each grid step costs ~0.35 us of pipeline overhead on TPU (Pallas TPU docs): a step contracts at least this
# deep (or the whole dim), so its matmul, [1024, 512] x [512, 1024] at GLM-5's expert shapes, outweighs it.
MIN_CONTRACTED_TILE = 512
# What Mosaic gives a kernel that sets no scoped-VMEM limit (megablox sets none): 32 MiB on v6e, 16 MiB on v4, v5e
# and v5p. The tiles leave 4 MiB of it to Mosaic's own scratch (1.4 MiB measured above 12 MiB of tiles on v5p).
DEFAULT_SCOPED_VMEM = {6: 32 * 2**20}
SMALLEST_SCOPED_VMEM = 16 * 2**20
MOSAIC_SCRATCH = 4 * 2**20
VMEM_BUDGET = SMALLEST_SCOPED_VMEM - MOSAIC_SCRATCH  # any TPU
MIN_VMEM_LIMIT = SMALLEST_SCOPED_VMEM
# Under a kernel's own scoped limit (`tpu_one_group_matmul`) the tiles take this share of it: the cost model's VMEM
# estimate runs ~10% under what Mosaic allots at large tiles (GLM-5's v6e expert shapes: 92 MiB of tiles by the
# model took 102 MiB; 72 MiB took 76 MiB, under a 96 MiB limit).
RAISED_LIMIT_SHARE = 0.75


def vmem_budget(device_kind: str | None, vmem_limit: int | None = None) -> int:
    """VMEM bytes the tiles may take on the TPU jax names `device_kind` ("TPU v6 lite", "TPU v5p", ...; None or an
    unknown name: the smallest default, VMEM_BUDGET), or within a kernel's own limit of `vmem_limit` bytes:
    RAISED_LIMIT_SHARE of it."""
    if vmem_limit is not None:
        return int(vmem_limit * RAISED_LIMIT_SHARE)
    generation = re.match(r"TPU v(\d+)", device_kind or "")
    scoped = DEFAULT_SCOPED_VMEM.get(int(generation.group(1)) if generation else 0, SMALLEST_SCOPED_VMEM)
    return scoped - MOSAIC_SCRATCH


@dataclasses.dataclass(frozen=True)
class GroupedTiles:
    """The three kernels' tiles: the forward `gmm` over lhs [M, K] x rhs [K, N]; the input gradient's `gmm` over
    d_out [M, N] x rhs^T (N contracted, K out); the weight gradient's `tgmm` over lhs^T [K, M] x d_out [M, N]
    (M contracted; its tiles are written (rows, K, N)). Rows are padded to a multiple of every row tile."""

    forward: Tiling
    input_grad: Tiling
    weight_grad: Tiling

    @property
    def row_multiple(self) -> int:
        return math.lcm(self.forward[0], self.input_grad[0], self.weight_grad[0])


def gmm_vmem_bytes(tiling: Tiling, itemsize: int) -> int:
    """Double-buffered lhs [tm, tc], rhs [tc, to] and output [tm, to] tiles, and the fp32 accumulator."""
    tm, tc, to = tiling
    return 2 * (tm * tc + tc * to + tm * to) * itemsize + 4 * tm * to


def tgmm_vmem_bytes(tiling: Tiling, itemsize: int) -> int:
    """Double-buffered lhs^T [tk, tm], d_out [tm, tn] and output [tk, tn] tiles, and the fp32 accumulator."""
    tm, tk, tn = tiling
    return 2 * (tk * tm + tm * tn + tk * tn) * itemsize + 4 * tk * tn


def gmm_hbm_bytes(m: int, contracted: int, out: int, groups: int, tiling: Tiling, itemsize: int) -> int:
    """megablox's declared traffic of `gmm`: the rows once per output-column tile, a group's weights once per row
    tile (every group starting inside a tile adds a pass: at most G - 1), the output once."""
    tm, _, to = tiling
    return itemsize * (m * contracted * (out // to) + contracted * out * (m // tm + groups - 1) + m * out)


def tgmm_hbm_bytes(m: int, k: int, n: int, groups: int, tiling: Tiling, itemsize: int) -> int:
    """megablox's declared traffic of `tgmm`: lhs [M, K] once per N tile, d_out [M, N] once per K tile, the
    groups' gradients [G, K, N] once."""
    _, tk, tn = tiling
    return itemsize * (m * k * (n // tn) + m * n * (k // tk) + groups * k * n)


def _divisor_tiles(dim: int, limit: int | None = None) -> list[int]:
    """Multiples of LANE that divide `dim` (itself a multiple of LANE), at most `limit`."""
    return [t for t in range(LANE, min(dim, limit or dim) + 1, LANE) if dim % t == 0]


def _row_tiles(m: int, groups: int) -> list[int]:
    """Row tiles for M rows (a multiple of LANE): up to MAX_ROW_TILE and the rows themselves, and small enough
    that the at most G - 1 extra passes of groups starting mid-tile are at most half the tiles (LANE always)."""
    tiles = range(LANE, min(MAX_ROW_TILE, m) + 1, LANE)
    return [t for t in tiles if t == LANE or 2 * (groups - 1) <= round_up(m, t) // t]


def _fewest_bytes(candidates, hbm_bytes, vmem_bytes, itemsize: int, budget: int) -> Tiling:
    """The candidate tiling with the fewest HBM bytes within the VMEM budget; among equals the largest tiles
    (fewest grid steps). The smallest candidate when none fits."""
    fitting = [t for t in candidates if vmem_bytes(t, itemsize) <= budget]
    if not fitting:
        return min(candidates, key=lambda t: (vmem_bytes(t, itemsize), t))
    return min(fitting, key=lambda t: (hbm_bytes(t), -t[0] * t[1] * t[2], t))


def _gmm_tiles(m: int, contracted: int, out: int, groups: int, tm: int, itemsize: int, budget: int) -> Tiling:
    deep = [t for t in _divisor_tiles(contracted) if t >= min(MIN_CONTRACTED_TILE, contracted)]
    candidates = [(tm, tc, to) for tc, to in itertools.product(deep, _divisor_tiles(out))]
    return _fewest_bytes(candidates, lambda t: gmm_hbm_bytes(m, contracted, out, groups, t, itemsize),
                         gmm_vmem_bytes, itemsize, budget)


@functools.lru_cache(maxsize=None)
def choose_tiles(m: int, k: int, n: int, groups: int, itemsize: int, tiling: Tiling | None = None,
                 budget: int = VMEM_BUDGET, weight_grad_budget: int | None = None) -> GroupedTiles:
    """The three kernels' tiles for M rows and K, N already padded to multiples of LANE, within `budget` bytes of
    VMEM (`vmem_budget` of the chip; the weight gradient's within `weight_grad_budget` when given).

    A given `tiling` (rows, K, N) is used for all three as before: clamped to the dims (K and N: the largest
    divisors up to it; the input gradient swaps its K and N tiles). Otherwise each kernel's tiles are those with
    the fewest HBM bytes by its cost model within the budget (`_fewest_bytes`); the two `gmm` share one row
    tile (the one with the fewest bytes over both), the `tgmm` takes any dividing the padded rows."""
    if tiling is not None:
        max_tm, max_tk, max_tn = tiling
        tm = max(LANE, round_up(min(max_tm, m), LANE))
        tk, tn = _divisor_tiles(k, max(LANE, max_tk))[-1], _divisor_tiles(n, max(LANE, max_tn))[-1]
        return GroupedTiles((tm, tk, tn), (tm, tn, tk), (tm, tk, tn))

    def for_row_tile(tm: int) -> GroupedTiles:
        rows = round_up(m, tm)
        forward = _gmm_tiles(rows, k, n, groups, tm, itemsize, budget)
        input_grad = _gmm_tiles(rows, n, k, groups, tm, itemsize, budget)
        weight_candidates = [(r, tk, tn) for r in _row_tiles(rows, groups) if rows % r == 0
                             for tk in _divisor_tiles(k) for tn in _divisor_tiles(n)]
        weight_grad = _fewest_bytes(weight_candidates, lambda t: tgmm_hbm_bytes(rows, k, n, groups, t, itemsize),
                                    tgmm_vmem_bytes, itemsize, budget if weight_grad_budget is None
                                    else weight_grad_budget)
        return GroupedTiles(forward, input_grad, weight_grad)

    def total_bytes(tiles: GroupedTiles) -> int:
        rows = round_up(m, tiles.forward[0])
        return (gmm_hbm_bytes(rows, k, n, groups, tiles.forward, itemsize)
                + gmm_hbm_bytes(rows, n, k, groups, tiles.input_grad, itemsize)
                + tgmm_hbm_bytes(rows, k, n, groups, tiles.weight_grad, itemsize))

    return min((for_row_tile(tm) for tm in _row_tiles(round_up(m, LANE), groups)),
               key=lambda tiles: (total_bytes(tiles), -tiles.forward[0]))


def declared_costs(rows: int, k: int, n: int, groups: int, tiles: GroupedTiles, itemsize: int,
                   expected_rows: int | None) -> tuple[tuple[int, int], ...]:
    """(FLOPs, HBM bytes) of the forward, input-gradient and weight-gradient kernels over lhs [rows, k] x rhs
    [groups, k, n] by megablox's cost model, each over the row tiles its grid visits when the groups fill
    `expected_rows` (`visited_rows`; None: every row, as megablox declares)."""
    forward, input_grad, weight_grad = (visited_rows(rows, tiling[0], groups, expected_rows)
                                        for tiling in (tiles.forward, tiles.input_grad, tiles.weight_grad))
    return ((2 * forward * k * n, gmm_hbm_bytes(forward, k, n, groups, tiles.forward, itemsize)),
            (2 * input_grad * k * n, gmm_hbm_bytes(input_grad, n, k, groups, tiles.input_grad, itemsize)),
            (2 * weight_grad * k * n, tgmm_hbm_bytes(weight_grad, k, n, groups, tiles.weight_grad, itemsize)))


def _megablox_cost(lhs, rhs, tiles: GroupedTiles, expected_rows: int | None, kernel: int):
    """Context for megablox kernel `kernel` (0 forward, 1 input gradient, 2 weight gradient): with `expected_rows`
    its cost over the tiles those rows take (declared by the caller, which `hlo_stats` reads before megablox's own,
    counted over the whole buffer); nothing to add otherwise."""
    if expected_rows is None:
        return contextlib.nullcontext()
    costs = declared_costs(lhs.shape[0], lhs.shape[1], rhs.shape[2], rhs.shape[0], tiles,
                           jnp.dtype(lhs.dtype).itemsize, expected_rows)
    return declared_cost(*costs[kernel])


@functools.partial(jax.custom_vjp, nondiff_argnums=(4, 5, 6, 7))
def _grouped(lhs, rhs, group_sizes, group_offset, tiles: GroupedTiles, interpret: bool, zero_outside: bool,
             expected_rows: int | None):
    return _grouped_fwd(lhs, rhs, group_sizes, group_offset, tiles, interpret, zero_outside, expected_rows)[0]


def _held_or_zero(x, group_sizes, group_offset, held: int, zero_outside: bool):
    """x with the rows outside the held groups zeroed (gmm leaves them unwritten), or as it is."""
    return jnp.where(held_rows_mask(group_sizes, group_offset, held, x.shape[0]), x, 0) if zero_outside else x


def _grouped_fwd(lhs, rhs, group_sizes, group_offset, tiles, interpret, zero_outside, expected_rows):
    with _megablox_cost(lhs, rhs, tiles, expected_rows, 0):
        out = gmm(lhs, rhs, group_sizes, lhs.dtype, tiles.forward, group_offset, interpret=interpret)
    return (_held_or_zero(out, group_sizes, group_offset, rhs.shape[0], zero_outside),
            (lhs, rhs, group_sizes, group_offset))


def _grouped_bwd(tiles, interpret, zero_outside, expected_rows, residuals, d_out):
    lhs, rhs, group_sizes, group_offset = residuals
    # d_lhs = d_out [M, N] x rhs[g]^T: N is contracted, K is the output's.
    with _megablox_cost(lhs, rhs, tiles, expected_rows, 1):
        d_lhs = gmm(d_out, rhs, group_sizes, lhs.dtype, tiles.input_grad, group_offset, transpose_rhs=True,
                    interpret=interpret)
    d_lhs = _held_or_zero(d_lhs, group_sizes, group_offset, rhs.shape[0], zero_outside)
    # d_rhs[g] = lhs[rows of g]^T x d_out[rows of g], accumulated in fp32 over the group's row tiles.
    with _megablox_cost(lhs, rhs, tiles, expected_rows, 2):
        d_rhs = tgmm(lhs.swapaxes(0, 1), d_out, group_sizes, rhs.dtype, tiles.weight_grad, group_offset,
                     rhs.shape[0], interpret=interpret)
    return d_lhs, d_rhs, None, None


_grouped.defvjp(_grouped_fwd, _grouped_bwd)


def tpu_kernel_rows(m: int, k: int, n: int, groups: int, itemsize: int, device_kind: str | None = None,
                    vmem_limit: int | None = None) -> int:
    """The rows `tpu_grouped_matmul` runs lhs [m, k] x rhs [groups, k, n] on: m padded to its row tiles (by a copy
    of lhs, unless m already is a multiple of them); `vmem_limit` as there (one group, rows past it undefined)."""
    limit = vmem_limit if groups == 1 else None
    tiles = choose_tiles(round_up(m, LANE), round_up(k, LANE), round_up(n, LANE), groups, itemsize, None,
                         vmem_budget(device_kind, limit), vmem_budget(device_kind))
    return round_up(m, tiles.row_multiple)


def tpu_grouped_matmul(lhs: jax.Array, rhs: jax.Array, group_sizes: jax.Array, group_offset: jax.Array, *,
                       tiling: Tiling | None = None, interpret: bool = False,
                       device_kind: str | None = None, zero_outside: bool = True,
                       vmem_limit: int | None = None, expected_rows: int | None = None) -> jax.Array:
    """lhs [M, K] x rhs [G, K, N] by group -> [M, N] (inputs validated by `grouped_matmul`), tiled for the TPU
    named `device_kind` (None: any). With `vmem_limit` (bytes), one group of one, and `zero_outside` False (the
    pod recipes' one expert per chip), `tpu_one_group_matmul`'s kernels run instead, asking for that much scoped
    VMEM and tiled for it (`vmem_budget`); megablox's otherwise (the limit unused). `zero_outside` False leaves
    the output's and the input gradient's rows outside the held groups undefined (no pass over them); the weight
    gradient never reads them (tgmm selects the groups' rows). `expected_rows`: what the kernels declare
    (`declared_costs`)."""
    m, k = lhs.shape
    n = rhs.shape[2]
    k_pad, n_pad = round_up(k, LANE), round_up(n, LANE)
    one_group = vmem_limit is not None and rhs.shape[0] == group_sizes.shape[0] == 1 and not zero_outside
    itemsize = jnp.dtype(lhs.dtype).itemsize
    # The weight gradient's kernel keeps the chip's default: XLA fuses it with the dynamic update slice that
    # writes it into the stacked layers' gradient, and that fusion gets the default scoped limit whatever the
    # kernel asks for (the v6e-256 step: 61.5 MiB refused against 32).
    tiles = choose_tiles(round_up(m, LANE), k_pad, n_pad, rhs.shape[0], itemsize,
                         None if tiling is None else tuple(tiling),
                         vmem_budget(device_kind, vmem_limit if one_group else None), vmem_budget(device_kind))
    rows = round_up(m, tiles.row_multiple)
    lhs = pad_axis(pad_axis(lhs, 0, rows), 1, k_pad)
    rhs = pad_axis(pad_axis(rhs, 1, k_pad), 2, n_pad)
    if one_group:
        costs = declared_costs(rows, k_pad, n_pad, 1, tiles, itemsize, expected_rows)
        out = one_group_matmul(lhs, rhs[0], jnp.minimum(group_sizes, m), tiles, vmem_limit, costs, interpret)
    else:
        out = _grouped(lhs, rhs, group_sizes, group_offset, tiles, interpret, zero_outside, expected_rows)
    return out[:m, :n]
