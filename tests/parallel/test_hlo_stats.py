"""`hlo_stats` counts matmul FLOPs with loop bodies as often as they run, and attributes them to the JAX
operation each came from."""

import jax
import jax.numpy as jnp

from glm5_jax.parallel.hlo_stats import hlo_stats


def _layers(x, w):
    def layer(h, w_l):
        return jnp.einsum("bd,de->be", h, w_l), None
    return jax.lax.scan(layer, x, w)[0]


def test_scan_body_counts_once_per_layer_and_names_its_source():
    x = jax.ShapeDtypeStruct((8, 64), jnp.float32)
    w = jax.ShapeDtypeStruct((5, 64, 64), jnp.float32)
    text = jax.jit(_layers).lower(x, w).compile().as_text()
    stats = hlo_stats(text, num_devices=1)
    expected = 5 * 2 * 8 * 64 * 64
    assert stats.matmul_flops == expected
    assert sum(stats.flops_by_source.values()) == expected
    (source, flops), = stats.flops_by_source.items()
    assert "bd,de->be" in source and flops == expected
    assert stats.dynamic_loops == 0
