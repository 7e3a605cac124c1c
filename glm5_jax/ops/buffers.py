"""Buffers a collective fills: undefined contents on TPU (nothing writes them first), zeros elsewhere."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from glm5_jax.ops.platform import compiled_platform
from pallas_kernels.uninitialized import uninitialized


def fill_buffer(shape: tuple[int, ...], dtype, after: jax.Array, platform: str | None = None) -> jax.Array:
    """A buffer whose unwritten rows the caller never reads: on TPU (`platform`, default `compiled_platform`)
    one nothing writes (`pallas_kernels.uninitialized`), made once `after` (a value of the step it is for: XLA
    must not hoist it out of a loop) is; elsewhere zeros (XLA:CPU and XLA:GPU run no Mosaic)."""
    if compiled_platform(platform) == "tpu":
        return uninitialized(shape, dtype, after)
    return jnp.zeros(shape, dtype)
