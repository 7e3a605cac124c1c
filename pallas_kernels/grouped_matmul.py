"""Grouped matmul of rows sorted by group: out[r] = lhs[r] @ rhs[group of r - group_offset].

The routed experts' matmuls. `jax.lax.ragged_dot` has these semantics, but XLA lowers its weight gradient
as a dense masked product over every group on TPU (G times the work), and on GPU its forward too. Here
each platform gets kernels whose work, forward and in both gradients, is that of the rows' own groups:
- "tpu": megablox `gmm` / `tgmm` (Mosaic) under a custom VJP (`tpu_grouped_matmul.py`);
- "gpu": Pallas Triton kernels (`gpu_grouped_matmul.py`);
- "cpu": the jnp reference (`ragged_dot`), for tests; the model's CPU path uses its own blocked layout.

Letters: M rows, K contracted dim, N output dim, G groups held here (of Gt groups in `group_sizes`).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from pallas_kernels._common import default_platform
from pallas_kernels.gpu_grouped_matmul import gpu_grouped_matmul
from pallas_kernels.tpu_grouped_matmul import MIN_VMEM_LIMIT, Tiling, tpu_grouped_matmul, tpu_kernel_rows

GROUPED_MATMUL_PLATFORMS = ("cpu", "gpu", "tpu")
SUPPORTED_DTYPES = (jnp.dtype(jnp.float32), jnp.dtype(jnp.bfloat16))


def grouped_matmul_reference(lhs: jax.Array, rhs: jax.Array, group_sizes: jax.Array, *,
                             group_offset: jax.Array | int | None = None) -> jax.Array:
    """`ragged_dot` semantics: rows of group g (in order of `group_sizes` [Gt]) times rhs[g - group_offset];
    rows of groups outside [group_offset, group_offset + G) and rows past sum(group_sizes) give zeros.
    The groups held here are placed among all Gt (others zero), so plain `ragged_dot` computes it."""
    held, total = rhs.shape[0], group_sizes.shape[0]
    if group_offset is not None and held < total:
        rhs = jax.lax.dynamic_update_slice_in_dim(
            jnp.zeros((total, *rhs.shape[1:]), rhs.dtype), rhs, jnp.asarray(group_offset, jnp.int32), 0)
    return jax.lax.ragged_dot(lhs, rhs, group_sizes)


def resolve_grouped_platform(platform: str | None) -> str:
    """None means `default_platform()` (the default device's, else the default backend); "cuda" / "rocm" name the
    GPU one."""
    platform = default_platform() if platform is None else platform
    platform = "gpu" if platform in ("cuda", "rocm") else platform
    if platform not in GROUPED_MATMUL_PLATFORMS:
        raise ValueError(f"platform must be one of {GROUPED_MATMUL_PLATFORMS} or None; got {platform!r}")
    return platform


def _validate(lhs, rhs, group_sizes, group_offset, tiling, device_kind, vmem_limit, expected_rows) -> None:
    if getattr(lhs, "ndim", None) != 2:
        raise ValueError(f"lhs must be [M, K]; got shape {getattr(lhs, 'shape', type(lhs).__name__)}")
    if getattr(rhs, "ndim", None) != 3:
        raise ValueError(f"rhs must be [G, K, N]; got shape {getattr(rhs, 'shape', type(rhs).__name__)}")
    if lhs.shape[1] != rhs.shape[1]:
        raise ValueError(f"lhs K={lhs.shape[1]} differs from rhs K={rhs.shape[1]} (lhs [M, K], rhs [G, K, N])")
    if lhs.dtype != rhs.dtype or jnp.dtype(lhs.dtype) not in SUPPORTED_DTYPES:
        raise ValueError(f"lhs and rhs must share one dtype of float32 / bfloat16; got {lhs.dtype} and {rhs.dtype}")
    if getattr(group_sizes, "ndim", None) != 1 or group_sizes.dtype != jnp.int32:
        raise ValueError(f"group_sizes must be int32 [Gt]; got {getattr(group_sizes, 'dtype', None)} "
                         f"{getattr(group_sizes, 'shape', None)}")
    held, total = rhs.shape[0], group_sizes.shape[0]
    if group_offset is None and held != total:
        raise ValueError(f"rhs holds {held} groups but group_sizes has {total}: pass group_offset (the first "
                         "group held here) when rhs holds a share of the groups")
    if held > total:
        raise ValueError(f"rhs holds {held} groups, more than group_sizes' {total}")
    if group_offset is not None and (isinstance(group_offset, bool) or jnp.ndim(group_offset) != 0):
        raise ValueError(f"group_offset must be an int or an integer scalar array; got {group_offset!r}")
    if isinstance(group_offset, int) and not 0 <= group_offset <= total - held:
        raise ValueError(f"group_offset={group_offset} is out of range: rhs holds {held} of {total} groups, so it "
                         f"must be in [0, {total - held}]")
    if tiling is not None and (len(tiling) != 3 or not all(isinstance(t, int) and t > 0 for t in tiling)):
        raise ValueError(f"tiling must be None or three positive ints (rows, K, N tile); got {tiling!r}")
    if device_kind is not None and not isinstance(device_kind, str):
        raise ValueError(f"device_kind must be None or jax's name of a device (e.g. 'TPU v6 lite'); "
                         f"got {device_kind!r}")
    if vmem_limit is not None and (isinstance(vmem_limit, bool) or not isinstance(vmem_limit, int)
                                   or vmem_limit < MIN_VMEM_LIMIT):
        raise ValueError(f"vmem_limit must be None (the chip's default) or the scoped VMEM in bytes the one-group "
                         f"kernels ask for, at least {MIN_VMEM_LIMIT} (16 MiB); got {vmem_limit!r}")
    if expected_rows is not None and (isinstance(expected_rows, bool) or not isinstance(expected_rows, int)
                                      or not 0 < expected_rows <= lhs.shape[0]):
        raise ValueError(f"expected_rows must be None (every row) or an int in [1, {lhs.shape[0]}] (lhs's rows); "
                         f"got {expected_rows!r}")


def grouped_matmul(lhs: jax.Array, rhs: jax.Array, group_sizes: jax.Array, *,
                   group_offset: jax.Array | int | None = None, platform: str | None = None,
                   interpret: bool = False, tiling: Tiling | None = None,
                   device_kind: str | None = None, zero_outside: bool = True,
                   vmem_limit: int | None = None, expected_rows: int | None = None) -> jax.Array:
    """lhs [M, K] (rows sorted by group) x rhs [G, K, N] -> [M, N] in lhs.dtype, differentiable in lhs and rhs.

    `group_sizes` int32 [Gt]: rows per group, in row order. rhs holds groups [group_offset, group_offset + G)
    of them (group_offset None: all, G == Gt), as a device holding a share of the experts does; rows of
    other groups, and rows past sum(group_sizes), give zeros and receive zero gradient. `zero_outside` False
    lets the TPU kernels leave those rows of the output and the input gradient undefined (garbage, possibly
    not finite), sparing a pass over each, for a caller that never reads them; the weight gradient is the same.
    `platform`: "tpu", "gpu", "cpu" or None (the default backend); `interpret` runs the TPU / GPU kernels
    in Pallas interpret mode (on CPU). `tiling` (rows, K, N): the largest tiles to use, for all three kernels; each
    is clamped to the shapes (default: each kernel's own, see `tpu_grouped_matmul.choose_tiles`). `device_kind`
    (jax's name of the TPU compiled for, e.g. "TPU v6 lite"; None: any TPU) sets the TPU tiles' VMEM budget.
    `vmem_limit` (bytes; None: the chip's default) with one group of one and `zero_outside` False runs
    `tpu_one_group_matmul`'s kernels, which ask for that much scoped VMEM and are tiled for it.

    `expected_rows` (static; None: all M) is how many rows the groups fill on average, such as a balanced load in
    a receive buffer sized for more: the kernels only visit the row tiles holding rows, so they declare the work of
    the tiles those rows take (`_grouped_rows.visited_rows`), which is what a roofline then counts; the results
    do not depend on it."""
    _validate(lhs, rhs, group_sizes, group_offset, tiling, device_kind, vmem_limit, expected_rows)
    platform = resolve_grouped_platform(platform)
    if platform == "cpu":
        return grouped_matmul_reference(lhs, rhs, group_sizes, group_offset=group_offset)
    offset = jnp.zeros((), jnp.int32) if group_offset is None else jnp.asarray(group_offset, jnp.int32)
    if platform == "gpu":
        return gpu_grouped_matmul(lhs, rhs, group_sizes, offset, tiling=tiling, interpret=interpret,
                                  expected_rows=expected_rows)
    return tpu_grouped_matmul(lhs, rhs, group_sizes, offset, tiling=tiling, interpret=interpret,
                              device_kind=device_kind, zero_outside=zero_outside, vmem_limit=vmem_limit,
                              expected_rows=expected_rows)


def kernel_rows(m: int, k: int, n: int, groups: int, dtype, *, platform: str | None = None,
                device_kind: str | None = None, vmem_limit: int | None = None) -> int:
    """The rows `grouped_matmul` works on for lhs [m, k] x rhs [groups, k, n] on `platform`: on TPU m padded to
    the kernels' row tiles, which costs a copy of lhs unless m is already that (a caller sizing a buffer can size
    it so); m elsewhere."""
    if resolve_grouped_platform(platform) != "tpu":
        return m
    return tpu_kernel_rows(m, k, n, groups, jnp.dtype(dtype).itemsize, device_kind, vmem_limit)
