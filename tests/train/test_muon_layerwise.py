"""Layer-wise Muon equals optax's `scale_by_muon` on stacked leaves, runs one layer at a time, and holds
one stacked copy of a leaf besides the state."""

from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from optax.contrib import MuonDimensionNumbers, scale_by_muon
from xla_env import run_pass_checks

from glm5_jax.train.muon_layerwise import _spreading_pays, scale_by_muon_layerwise


def _tree(key):
    k1, k2, k3 = jax.random.split(key, 3)
    return {
        "moe_layers": {"experts": jax.random.normal(k1, (3, 4, 16, 8))},   # [L, E, in, out]
        "mtp": {"kernel": jax.random.normal(k2, (12, 6))},                 # no layer axis
        "dense_layers": {"o_proj": jax.random.normal(k3, (2, 16, 4, 5))},  # [L, D, H, P]
    }


_DIMS = {
    "moe_layers": {"experts": MuonDimensionNumbers(reduction_axis=2, output_axis=3)},
    "mtp": {"kernel": MuonDimensionNumbers(reduction_axis=0, output_axis=1)},
    "dense_layers": {"o_proj": MuonDimensionNumbers(reduction_axis=(2, 3), output_axis=1)},
}
_STACKED = {"moe_layers": {"experts": True}, "mtp": {"kernel": False}, "dense_layers": {"o_proj": True}}


@pytest.mark.parametrize("mu_dtype", [None, jnp.bfloat16])
def test_layerwise_muon_equals_scale_by_muon_over_steps(mu_dtype):
    params = _tree(jax.random.key(0))
    reference = scale_by_muon(ns_steps=5, beta=0.95, eps=1e-8, mu_dtype=mu_dtype, nesterov=True,
                              weight_dimension_numbers=_DIMS)
    layerwise = scale_by_muon_layerwise(lambda t: _DIMS, lambda t: _STACKED, ns_steps=5, beta=0.95, eps=1e-8,
                                        mu_dtype=mu_dtype)
    ref_state, state = reference.init(params), layerwise.init(params)
    assert jax.tree.structure(ref_state) == jax.tree.structure(state)
    assert {x.dtype for x in jax.tree.leaves(state.mu)} == {jnp.dtype(mu_dtype or jnp.float32)}
    for step in range(3):
        grads = _tree(jax.random.key(step + 1))
        # Both jitted: eager and jitted fp32 arithmetic can round a bf16 momentum one ulp apart.
        ref_out, ref_state = jax.jit(reference.update)(grads, ref_state)
        out, state = jax.jit(layerwise.update)(grads, state)
        for a, b in zip(jax.tree.leaves((ref_out, ref_state)), jax.tree.leaves((out, state))):
            assert a.dtype == b.dtype
            np.testing.assert_allclose(np.asarray(b, np.float32), np.asarray(a, np.float32), rtol=2e-5, atol=2e-6)
    # The orthogonalised update of one expert matrix is (nearly) orthogonal, as Muon's should be.
    singular = np.linalg.svd(np.asarray(out["moe_layers"]["experts"][1, 2]), compute_uv=False)
    assert 0.5 < singular.min() and singular.max() < 1.5


def test_layer_axis_runs_as_a_loop():
    params = _tree(jax.random.key(0))
    layerwise = scale_by_muon_layerwise(lambda t: _DIMS, lambda t: _STACKED, ns_steps=5, beta=0.95, eps=1e-8)
    state = layerwise.init(params)
    text = jax.jit(layerwise.update).lower(params, state).as_text()
    assert text.count("stablehlo.while") >= 2  # one loop per layer-stacked leaf


@pytest.mark.slow
def test_newton_schulz_on_layers_spread_over_8_devices_equals_one_device_and_all_reduces_nothing():
    run_pass_checks(Path(__file__).with_name("_muon_split_checks.py"), expected=["spread Newton-Schulz"])


def test_layers_are_spread_only_where_whole_matrices_cost_no_more_flops_per_chip():
    dims = MuonDimensionNumbers(reduction_axis=0, output_axis=1)
    # GLM-5 on 256 chips: the 75 MoE layers' o_proj [(H P), D] spread; the 3 dense layers' MLP stays on shards
    # (one whole [6144, 12288] per chip would be ~8x the sharded products of 3 layers).
    assert _spreading_pays((75, 16384, 6144), dims, 256)
    assert not _spreading_pays((3, 6144, 12288), dims, 256)
    assert _spreading_pays((12, 64, 32), dims, 8) and not _spreading_pays((3, 64, 32), dims, 8)


@pytest.mark.tpu_aot
def test_a_guarded_muon_step_on_tpu_keeps_one_stacked_copy_besides_the_state():
    """The step's update (layer-wise Muon, the weight update and the finite guard's select), compiled for a v5p
    chip with the state donated: besides the state, its temporaries hold the orthogonalised update of the
    stacked leaf (one copy) and one layer's Newton-Schulz work. With the momentum returned by the layer loop,
    a second stacked copy stayed live until the guard's select (2.35 leaves here; 5.3 GB per v6e-256 chip)."""
    import jax.numpy as jnp
    import optax

    from glm5_jax.parallel.topology import get_topology
    from glm5_jax.train.finite_guard import keep_state_unless_finite

    layers, rows, cols = 16, 256, 512
    dims = {"w": MuonDimensionNumbers(reduction_axis=1, output_axis=2)}
    optimizer = optax.chain(scale_by_muon_layerwise(lambda t: dims, lambda t: {"w": True}, ns_steps=5, beta=0.95,
                                                    eps=1e-8), optax.scale(-0.01))

    def step(params, opt_state, grads):
        updates, new_opt_state = optimizer.update(grads, opt_state, params)
        new_params = optax.apply_updates(params, updates)
        return keep_state_unless_finite(params, opt_state, new_params, new_opt_state, grads,
                                        {"loss": jnp.float32(0)})[:2]

    on_chip = jax.sharding.SingleDeviceSharding(get_topology("v5p-8").devices()[0])
    abstract = lambda tree: jax.tree.map(  # noqa: E731
        lambda s: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=on_chip), tree)
    params = abstract({"w": jax.ShapeDtypeStruct((layers, rows, cols), jnp.float32)})
    opt_state = abstract(jax.eval_shape(optimizer.init, params))
    compiled = jax.jit(step, donate_argnums=(0, 1)).trace(params, opt_state, params).lower().compile()
    stacked_leaf = layers * rows * cols * 4
    assert compiled.memory_analysis().temp_size_in_bytes < 1.5 * stacked_leaf
