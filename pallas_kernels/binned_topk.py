"""Exact top-k of long score rows from a short candidate list: `lax.top_k`'s result, ties included, with far fewer
elements sorted.

XLA lowers `lax.top_k` with a large k (the indexer's 2048) to a sort of whole (score, index) rows; on TPU that is
~28 bytes of HBM traffic per score. Split a row of T scores into bins of b keys and take each bin's max. The k-th
largest bin max, m, is a lower bound of the k-th largest score (k bins hold a score >= m), so every score of the
top k lies in a bin whose max is >= m, and at most k bins (the top k bins) qualify. The top k of their k * b scores
is the top k of the row: T / b maxima and k * b candidates are ranked instead of T scores (at T = 202,752,
k = 2048, b = 8: 41,728 instead of 202,752).

Bins are strided, bin j holding keys j, j + W, ..., j + (b - 1) W for a width W (a multiple of 128), so that the
maxima are an elementwise max of b aligned slices of the row and the candidates of bin j, read slice by slice, come
out in ascending key order: no [.., b]-minor array, which TPU tiling would pad 16-fold.

Ties follow `lax.top_k` (XLA's total order on floats: -0.0 below 0.0; the lowest key first among equals). Bins are
ranked by (max, then the lowest key holding it), and the final `lax.top_k` sees the candidates in key order. Why
that is the same selection: every score above the k-th largest value v lies in a bin with max > v, all of which
are chosen; a score equal to v in an unchosen bin B' comes after B''s first maximum, and each chosen bin whose max
is v holds a v at a key below that, while each chosen bin whose max exceeds v holds a larger score, so at least as
many scores precede it as the top k has room for. Checked against `lax.top_k` with heavy ties in
`tests/pallas_kernels/test_binned_topk.py`.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax

from pallas_kernels._common import pad_axis, round_up

_LANES = 128  # slices start at multiples of it, so the bin maxima are an aligned elementwise max

# Bins only pay when they at least halve what is sorted: the bin-max pass reads every score once more.
_MIN_SORT_SAVING = 2


def topk_bin_size(num_keys: int, k: int) -> int:
    """The bin size b (a power of two) that sorts the fewest elements, num_keys / b maxima + k * b candidates; 1
    (sort the row whole) unless that is at most half of num_keys."""
    best = 1
    for b in (2, 4, 8, 16, 32, 64):
        if -(-num_keys // b) + k * b < -(-num_keys // best) + k * best:
            best = b
    if best > 1 and _MIN_SORT_SAVING * (-(-num_keys // best) + k * best) > num_keys:
        return 1
    return best


def bin_width(num_keys: int, k: int, bin_size: int | None = None, align: int = _LANES) -> int | None:
    """The number of bins W (keys per slice, a multiple of `align`) for the top k of num_keys scores, or None
    when binning would not pay (then sort the row whole). bin_size: None picks `topk_bin_size`."""
    b = topk_bin_size(num_keys, k) if bin_size is None else bin_size
    if b <= 1:
        return None
    width = round_up(-(-num_keys // b), align)
    return width if k < width < num_keys else None


def total_order_key(x: jax.Array) -> jax.Array:
    """int32 keys ordered as XLA orders the floats of a sort or top-k (a total order: -NaN < -inf < ... < -0.0 <
    0.0 < ... < inf < NaN)."""
    bits = lax.bitcast_convert_type(x.astype(jnp.float32), jnp.int32)
    return jnp.where(bits < 0, bits ^ jnp.int32(0x7FFFFFFF), bits)


def merge_bin_slice(order: jax.Array, first_key: jax.Array, part: jax.Array,
                    part_keys: jax.Array) -> tuple[jax.Array, jax.Array]:
    """Folds one slice of the scores (`part`, whose keys are `part_keys`) into the bins' running (order: the max's
    `total_order_key`, bitwise inverted so that ascending order ranks the highest first; the key of the bin's
    first max). Slices must come in ascending key order. Shared with the TPU score kernel, which folds them on
    chip."""
    key = ~total_order_key(part)
    return jnp.minimum(order, key), jnp.where(key < order, part_keys, first_key)


def bin_maxima(scores: jax.Array, width: int) -> tuple[jax.Array, jax.Array]:
    """Per bin j (keys j, j + width, ...): its max as an inverted `total_order_key` and the key of its first max,
    int32 [..., width] each (`merge_bin_slice`). Keys past the row count as -inf."""
    num_keys = scores.shape[-1]
    order = jnp.full((*scores.shape[:-1], width), jnp.iinfo(jnp.int32).max, jnp.int32)
    first_key = jnp.zeros(order.shape, jnp.int32)
    for start in range(0, num_keys, width):
        part = pad_axis(scores[..., start:start + width], scores.ndim - 1, width, value=-jnp.inf)
        part_keys = start + lax.broadcasted_iota(jnp.int32, part.shape, part.ndim - 1)
        order, first_key = merge_bin_slice(order, first_key, part, part_keys)
    return order, first_key


def topk_from_bins(scores: jax.Array, order: jax.Array, first_key: jax.Array, k: int,
                   num_keys: int | None = None) -> tuple[jax.Array, jax.Array]:
    """`lax.top_k(scores[..., :num_keys], k)` from the scores and their `bin_maxima` (or the score kernel's): the top
    k bins by (max, then the key of their first max), then the top k of those bins' scores, gathered in key order.
    num_keys: the row's real length when `scores` carries padding past it (None: all of it)."""
    num_keys, width = scores.shape[-1] if num_keys is None else num_keys, order.shape[-1]
    num_slices = -(-num_keys // width)
    # Unstable: the first keys are distinct, so no two bins compare equal (a stable sort would carry an iota).
    _, ranked = lax.sort((order, first_key), dimension=order.ndim - 1, is_stable=False, num_keys=2)
    chosen = jnp.sort(ranked[..., :k] % width, axis=-1)  # bin j's keys are j mod width
    # One gather from the whole row (slices feeding gathers would be materialised): slice-major, ascending keys.
    keys = (jnp.arange(num_slices, dtype=jnp.int32)[:, None] * width + chosen[..., None, :]).reshape(
        *chosen.shape[:-1], num_slices * k)
    candidates = jnp.where(keys < num_keys, jnp.take_along_axis(scores, jnp.minimum(keys, num_keys - 1), axis=-1),
                           -jnp.inf)
    values, position = lax.top_k(candidates, k)  # candidates are in ascending key order: ties take the lowest key
    return values, jnp.take_along_axis(keys, position, axis=-1)


def binned_topk(scores: jax.Array, k: int, bin_size: int | None = None,
                align: int = _LANES) -> tuple[jax.Array, jax.Array]:
    """`lax.top_k(scores, k)` over the last axis: (values, int32 indices), equal to it bit for bit, ties
    included (see the module docstring). bin_size: None picks `topk_bin_size`; 1 is `lax.top_k` itself. align:
    the number of bins' multiple."""
    num_keys = scores.shape[-1]
    if not 0 < k <= num_keys:
        raise ValueError(f"k must be in [1, {num_keys}] (the row length); got {k}")
    width = bin_width(num_keys, k, bin_size, align)
    if width is None:
        return lax.top_k(scores, k)
    return topk_from_bins(scores, *bin_maxima(scores, width), k)
