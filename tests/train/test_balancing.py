"""The bias update finds the router correction biases by the model's own metadata (`RouterBias` weights of
`GLM5(config)`), in the MoE stack and in the MTP layer, and moves nothing else."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from glm5_jax.config import load_model_config
from glm5_jax.model.metadata import ParamMetadataError
from glm5_jax.parallel.sharding import abstract_params
from glm5_jax.train.balancing import update_correction_biases

CONFIG = load_model_config("configs/tiny.yaml")
MOE_LAYERS, EXPERTS = CONFIG.num_moe_layers, CONFIG.n_routed_experts


@pytest.fixture(scope="module")
def params():
    return jax.tree.map(lambda a: jnp.zeros(a.shape, a.dtype), abstract_params(CONFIG))


def test_only_the_router_biases_move_each_by_its_own_counts(params):
    main = jnp.tile(jnp.arange(EXPERTS), (MOE_LAYERS, 1))        # expert e got e tokens in every layer
    mtp = jnp.arange(EXPERTS)[::-1]                                # the MTP layer's load runs the other way
    moved = update_correction_biases(params, {"main": main, "mtp": mtp}, 0.5, config=CONFIG)
    below_mean = jnp.sign(jnp.mean(jnp.arange(EXPERTS)) - jnp.arange(EXPERTS)) * 0.5
    np.testing.assert_array_equal(moved["moe_layers"]["moe"]["e_score_correction_bias"],
                                  jnp.tile(below_mean, (MOE_LAYERS, 1)))
    np.testing.assert_array_equal(moved["mtp"]["layer"]["moe"]["e_score_correction_bias"], below_mean[::-1])
    unchanged = lambda tree: {k: v for k, v in tree.items() if k not in ("moe_layers", "mtp")}  # noqa: E731
    for a, b in zip(jax.tree.leaves(unchanged(params)), jax.tree.leaves(unchanged(moved))):
        assert a is b
    assert moved["moe_layers"]["moe"]["router"]["kernel"] is params["moe_layers"]["moe"]["router"]["kernel"]


def test_missing_counts_leave_a_section_alone_and_a_foreign_leaf_is_refused(params):
    moved = update_correction_biases(params, {"main": None}, 0.5, config=CONFIG)
    bias = lambda tree: tree["moe_layers"]["moe"]["e_score_correction_bias"]  # noqa: E731
    assert bias(moved) is bias(params)
    with pytest.raises(ParamMetadataError, match="'moe_layers/moe/extra_bias' is not a weight"):
        update_correction_biases({"moe_layers": {"moe": {"extra_bias": jnp.zeros((MOE_LAYERS, EXPERTS))}}},
                                 {"main": jnp.ones((MOE_LAYERS, EXPERTS))}, 0.5, config=CONFIG)
