"""The routed experts' grouped matmul for the platform compiled for: megablox `gmm` / `tgmm` on TPU, the
project's Triton kernels on GPU, `ragged_dot` on CPU (where the model itself uses the blocked layout of
`glm5_jax.model.blocked_experts` instead). Each has a real weight gradient (see `pallas_kernels.grouped_matmul`)."""

from __future__ import annotations

import jax

from glm5_jax.ops.platform import compiled_device_kind, compiled_platform
from pallas_kernels.grouped_matmul import grouped_matmul as grouped_matmul_kernels


def grouped_matmul(x: jax.Array, weights: jax.Array, group_sizes: jax.Array,
                   platform: str | None = None) -> jax.Array:
    """Rows of `x` [M, K] sorted by group times their group's `weights` [G, K, N] (`group_sizes` int32 [G]);
    rows past sum(group_sizes) give zeros. `platform` as `compiled_platform` resolves it; the TPU kernels are
    tiled for the chip compiled for (`compiled_device_kind`: v6e's VMEM takes larger tiles)."""
    return grouped_matmul_kernels(x, weights, group_sizes, platform=compiled_platform(platform),
                                  device_kind=compiled_device_kind())
