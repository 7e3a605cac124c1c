"""The routed experts' grouped matmul for the platform compiled for: megablox `gmm` / `tgmm` on TPU, the
project's Triton kernels on GPU, `ragged_dot` on CPU (where the model itself uses the blocked layout of
`glm5_jax.model.blocked_experts` instead). Each has a real weight gradient (see `pallas_kernels.grouped_matmul`)."""

from __future__ import annotations

import jax

from glm5_jax.ops.platform import compiled_device_kind, compiled_platform
from pallas_kernels.grouped_matmul import grouped_matmul as grouped_matmul_kernels, kernel_rows


def grouped_matmul(x: jax.Array, weights: jax.Array, group_sizes: jax.Array,
                   platform: str | None = None, zero_outside: bool = True, vmem_limit: int | None = None,
                   expected_rows: int | None = None) -> jax.Array:
    """Rows of `x` [M, K] sorted by group times their group's `weights` [G, K, N] (`group_sizes` int32 [G]);
    rows past sum(group_sizes) give zeros, or with `zero_outside` False whatever the kernels leave there (see
    `pallas_kernels.grouped_matmul`). `platform` as `compiled_platform` resolves it; the TPU kernels are tiled
    for the chip compiled for (`compiled_device_kind`: v6e's VMEM takes larger tiles); `vmem_limit` (bytes) is
    the one-group kernels' own (`model.moe_kernel_vmem_mib`); `expected_rows` the rows filled on average, whose
    row tiles' work the kernels declare (None: every row; see `pallas_kernels.grouped_matmul`)."""
    return grouped_matmul_kernels(x, weights, group_sizes, platform=compiled_platform(platform),
                                  device_kind=compiled_device_kind(), zero_outside=zero_outside,
                                  vmem_limit=vmem_limit, expected_rows=expected_rows)


def swiglu_rows(rows: int, hidden: int, intermediate: int, groups: int, dtype, platform: str | None = None,
                device_kind: str | None = None, vmem_limit: int | None = None) -> int:
    """The fewest rows, at least `rows`, on which a grouped SwiGLU's matmuls ([rows, hidden] -> [rows, 2 x
    intermediate], the gate and up projections in one, and [rows, intermediate] -> [rows, hidden], `groups` groups)
    run without padding their inputs: a buffer this size spares a copy of it per matmul (TPU row tiles, for the
    chip `device_kind`, default `compiled_device_kind`, and `vmem_limit` as `grouped_matmul`'s; `rows` elsewhere)."""
    platform, kind = compiled_platform(platform), device_kind or compiled_device_kind()
    tiles_for = dict(platform=platform, device_kind=kind, vmem_limit=vmem_limit)
    for _ in range(4):  # the tiles depend on the rows: settle on rows both shapes take whole
        padded = max(kernel_rows(rows, hidden, 2 * intermediate, groups, dtype, **tiles_for),
                     kernel_rows(rows, intermediate, hidden, groups, dtype, **tiles_for))
        if padded == rows:
            break
        rows = padded
    return rows
