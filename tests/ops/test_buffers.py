"""Receive buffers a collective fills: zeros off TPU; on TPU a Mosaic call that writes nothing, whose buffer
XLA updates in place and whose HBM traffic `glm5 compile` counts as none (only the collective's)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from glm5_jax.ops.buffers import fill_buffer
from glm5_jax.parallel.hlo_stats import hlo_stats
from pallas_kernels.uninitialized import uninitialized
from tests.aot_compile import compile_for


def test_off_tpu_the_buffer_is_zeros():
    buffer = fill_buffer((4, 3), jnp.bfloat16, jnp.zeros(1), "cpu")
    assert buffer.dtype == jnp.bfloat16 and np.array_equal(np.asarray(buffer, np.float32), np.zeros((4, 3)))


def test_interpreted_the_buffer_has_the_shape_and_reads_as_uninitialised():
    buffer = jax.jit(lambda: uninitialized((8, 128), jnp.float32, jnp.zeros(1), interpret=True))()
    assert buffer.shape == (8, 128) and buffer.dtype == jnp.float32


@pytest.mark.tpu_aot
def test_on_tpu_nothing_writes_it_and_an_update_fills_it_in_place():
    def filled(rows):
        return jax.lax.dynamic_update_slice(fill_buffer((4096, 1024), jnp.bfloat16, rows, "tpu"), rows, (0, 0))

    text = compile_for(filled, (jax.ShapeDtypeStruct((512, 1024), jnp.bfloat16),), "v6e").as_text()
    assert "broadcast(" not in text  # no zero fill
    stats = hlo_stats(text, 1)
    # The update writes the 512 rows (and reads them), in place: far below one pass over the 8 MiB buffer.
    assert stats.hbm_bytes_by_source["pallas_call"] == 0, stats.hbm_bytes_by_source
    assert stats.hbm_bytes < 4 * 512 * 1024 * 2, stats.hbm_bytes_by_source

