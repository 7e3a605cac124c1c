"""Mesh configuration, the logical-axis rule table and optimizer-state shardings, on one device (shapes and mesh
sizes only; the multi-device behaviour is in test_multidevice.py)."""

import dataclasses
import math

import jax
import jax.numpy as jnp
import pytest
from jax.sharding import PartitionSpec as P

from glm5_jax.config import load_model_config
from glm5_jax.distributed.mesh import MeshConfig, MeshConfigError, make_mesh
from glm5_jax.distributed.logical_axes import ShardingRuleError, constrain, expert_split_axes, logical_to_spec
from glm5_jax.model.metadata import ParamMetadataError, param_info
from glm5_jax.parallel.sharding import abstract_params, param_specs, state_leaf_spec
from glm5_jax.tree_paths import path_names

SIZES = {"data": 2, "fsdp": 16, "expert": 8, "tensor": 4}


GLM5_744B = load_model_config("configs/glm5_744b.yaml")


@pytest.fixture(scope="module")
def glm5_params():
    return abstract_params(GLM5_744B)


def test_mesh_config_validates_fields_and_device_count():
    with pytest.raises(MeshConfigError, match=r"mesh.fsdp=0 is invalid"):
        MeshConfig(fsdp=0)
    with pytest.raises(MeshConfigError, match=r"mesh.tensor=2.5"):
        MeshConfig(tensor=2.5)
    with pytest.raises(MeshConfigError, match=r"mesh.pipeline=2 is invalid: unknown mesh axis"):
        MeshConfig.from_mapping({"pipeline": 2})
    with pytest.raises(MeshConfigError, match=r"has 8 devices but 1 are available"):
        make_mesh(MeshConfig(data=2, expert=4))
    mesh = make_mesh(MeshConfig())
    assert mesh.axis_names == ("data", "fsdp", "expert", "context", "tensor")
    assert dict(mesh.shape) == {"data": 1, "fsdp": 1, "expert": 1, "context": 1, "tensor": 1}


def test_activation_rules_give_batch_every_batch_axis_and_leave_embed_whole():
    assert logical_to_spec(("batch", "seq", "embed"), (256, 128, 6144), SIZES) == \
        P(("data", "fsdp", "expert"), None, None)
    assert logical_to_spec(("batch", "seq", "heads", "head_dim"), (256, 16, 64, 256), SIZES) == \
        P(("data", "fsdp", "expert"), None, "tensor", None)
    # A batch of 4 only takes the axes that divide it, in order; `fsdp` and `expert` then go to the next
    # candidate dim.
    assert logical_to_spec(("batch", "seq", "embed"), (4, 16, 6144), SIZES) == P("data", None, ("fsdp", "expert"))
    with pytest.raises(ShardingRuleError, match="logical axis 'channels' has no rule"):
        logical_to_spec(("batch", "channels"), (8, 8), SIZES)


def test_glm5_parameter_specs(glm5_params):
    specs = param_specs(glm5_params, SIZES, config=GLM5_744B)
    moe, attn = specs["moe_layers"], specs["moe_layers"]["attn"]
    assert moe["moe"]["experts"]["gate_proj"] == P(None, "expert", "fsdp", "tensor")
    assert moe["moe"]["experts"]["down_proj"] == P(None, "expert", "tensor", "fsdp")
    assert moe["moe"]["router"]["kernel"] == P(None, ("fsdp", "expert"), None)
    assert moe["moe"]["e_score_correction_bias"] == P(None, None)
    assert moe["moe"]["shared_experts"]["gate_proj"]["kernel"] == P(None, ("fsdp", "expert"), "tensor")
    assert attn["q_b_proj"]["kernel"] == P(None, ("fsdp", "expert"), "tensor", None)
    assert attn["kv_b_proj"]["kernel"] == P(None, ("fsdp", "expert"), "tensor", None)
    assert attn["o_proj"]["kernel"] == P(None, ("fsdp", "expert"), "tensor", None)
    assert specs["embed"]["embedding"] == P("tensor", ("fsdp", "expert"))
    assert specs["lm_head"]["kernel"] == P(("fsdp", "expert"), "tensor")
    assert specs["indexers"]["wq_b"]["kernel"] == P(None, ("fsdp", "expert"), "tensor", None)
    assert specs["mtp"]["eh_proj"]["kernel"] == P(("fsdp", "expert"), None)
    assert specs["final_norm"]["scale"] == P(None)
    for (path, leaf), spec in zip(jax.tree_util.tree_flatten_with_path(glm5_params)[0],
                                  jax.tree.leaves(specs, is_leaf=lambda s: isinstance(s, P))):
        names = path_names(path)
        if names[0] in ("dense_layers", "moe_layers", "indexers"):
            assert spec[0] is None, f"{names}: the stacked layer axis is never split"
        for dim, entry in zip(leaf.shape, spec):
            axes = () if entry is None else (entry,) if isinstance(entry, str) else entry
            assert dim % math.prod(SIZES[a] for a in axes) == 0, (names, leaf.shape, spec)


def test_every_large_glm5_weight_is_fsdp_sharded(glm5_params):
    """No host holds a whole matrix: every leaf above 1M values is split over `fsdp`."""
    specs = param_specs(glm5_params, SIZES, config=GLM5_744B)
    for (path, leaf), spec in zip(jax.tree_util.tree_flatten_with_path(glm5_params)[0],
                                  jax.tree.leaves(specs, is_leaf=lambda s: isinstance(s, P))):
        if math.prod(leaf.shape) > 2**20:
            assert "fsdp" in jax.tree.leaves(tuple(spec)), (path_names(path), spec)


def test_wide_expert_parallelism_keeps_experts_whole_and_shards_the_rest_over_every_chip(glm5_params):
    """With `fsdp` 1 and a wide `expert` axis, each chip holds whole experts (nothing to gather per layer) while
    every other large weight is still split over all the chips."""
    wide = {"data": 1, "fsdp": 1, "expert": 256, "tensor": 1}
    specs = param_specs(glm5_params, wide, config=GLM5_744B)
    experts = specs["moe_layers"]["moe"]["experts"]
    assert experts["gate_proj"] == P(None, "expert", None, None)
    assert experts["down_proj"] == P(None, "expert", None, None)
    assert specs["moe_layers"]["attn"]["q_b_proj"]["kernel"] == P(None, "expert", None, None)
    for (path, leaf), spec in zip(jax.tree_util.tree_flatten_with_path(glm5_params)[0],
                                  jax.tree.leaves(specs, is_leaf=lambda s: isinstance(s, P))):
        if math.prod(leaf.shape) > 2**20:
            assert "expert" in jax.tree.leaves(tuple(spec)), (path_names(path), spec)


def test_a_split_sequence_spreads_the_experts_and_the_other_weights_over_its_chips(glm5_params):
    """With `context` splitting each sequence, its chips hold different experts (expert parallelism over `expert`
    x `context`, so the exchange spans both) and every other large weight is FSDP-sharded over them too: nothing
    is stored once per context chip."""
    split = {"data": 1, "fsdp": 1, "expert": 8, "context": 32, "tensor": 1}
    specs = param_specs(glm5_params, split, config=GLM5_744B)
    assert specs["moe_layers"]["moe"]["experts"]["gate_proj"] == P(None, ("expert", "context"), None, None)
    assert expert_split_axes(GLM5_744B.n_routed_experts, split) == ("expert", "context")
    assert specs["embed"]["embedding"] == P(None, ("expert", "context"))
    for (path, leaf), spec in zip(jax.tree_util.tree_flatten_with_path(glm5_params)[0],
                                  jax.tree.leaves(specs, is_leaf=lambda s: isinstance(s, P))):
        if math.prod(leaf.shape) > 2**20:
            assert {"expert", "context"} <= set(jax.tree.leaves(tuple(spec))), (path_names(path), spec)
    # 256 experts do not split 512 ways: they stay on `expert` and are stored once per context chip.
    assert expert_split_axes(GLM5_744B.n_routed_experts, {**split, "context": 64}) == ("expert",)


def test_unknown_parameter_path_shape_mismatch_and_a_config_of_another_type_are_errors():
    with pytest.raises(ParamMetadataError, match="parameter 'moe_layers/attn/new_proj/kernel' is not a weight"):
        param_info(("moe_layers", "attn", "new_proj", "kernel"), GLM5_744B)
    with pytest.raises(ParamMetadataError, match=r"q_b_proj/kernel' has shape \(2048, 64\) but the model of this "
                                                 r"config creates it with shape \(75, 2048, 64, 256\)"):
        param_info(("moe_layers", "attn", "q_b_proj", "kernel"), GLM5_744B, (2048, 64))
    with pytest.raises(TypeError, match="config must be the ModelConfig the parameters were built from, got dict"):
        param_specs({"final_norm": {"scale": jnp.ones(8)}}, SIZES, config={"hidden_size": 8})


def test_logical_axes_come_from_the_modules():
    """The stacked layer axis is the one `nnx.vmap` adds; the router bias is the one non-Param weight."""
    info = lambda *names: param_info(names, GLM5_744B)  # noqa: E731
    assert info("moe_layers", "attn", "o_proj", "kernel").axes == ("layers", "embed", "heads", "head_dim")
    assert info("moe_layers", "attn", "o_proj", "kernel").shape == (75, 6144, 64, 256)
    assert info("mtp", "layer", "attn", "o_proj", "kernel").axes == ("embed", "heads", "head_dim")
    bias = info("moe_layers", "moe", "e_score_correction_bias")
    assert bias.router_bias and bias.axes == ("layers", "router_experts")
    assert info("indexers", "wk", "kernel").in_indexer
    assert info("mtp", "layer", "indexer", "wk", "kernel").in_indexer
    assert not info("mtp", "layer", "attn", "q_a_proj", "kernel").in_indexer


def test_the_metadata_is_that_of_the_config_given():
    """A model without dense layers or MTP has no such weights, and each weight has that model's shape."""
    moe_only = dataclasses.replace(GLM5_744B, num_hidden_layers=4, first_k_dense_replace=0,
                                   num_nextn_predict_layers=0, mtp_num_steps=0)
    assert param_info(("moe_layers", "attn", "o_proj", "kernel"), moe_only).shape == (4, 6144, 64, 256)
    for names in (("dense_layers", "input_norm", "scale"), ("mtp", "enorm", "scale")):
        with pytest.raises(ParamMetadataError, match="is not a weight of the GLM5 model of this config"):
            param_info(names, moe_only)


def test_optimizer_state_leaves_follow_their_parameter():
    kv_b = state_leaf_spec(("2", "inner_states", "muon", "mu", "moe_layers", "attn", "kv_b_proj", "kernel", "uk"),
                           (75, 512, 64, 192), SIZES, config=GLM5_744B)
    assert kv_b == P(None, ("fsdp", "expert"), "tensor", None)
    nu = state_leaf_spec(("0", "nu", "embed", "embedding"), (154880, 6144), SIZES, config=GLM5_744B)
    assert nu == P("tensor", ("fsdp", "expert"))
    assert state_leaf_spec(("0", "count"), (), SIZES, config=GLM5_744B) == P()
    assert state_leaf_spec(("ns_coeffs",), (3,), SIZES, config=GLM5_744B) == P()


def test_constrain_without_a_mesh_is_the_identity():
    x = jnp.ones((2, 4, 8))
    assert constrain(x, ("batch", "seq", "embed")) is x
    mesh = make_mesh(MeshConfig())
    y = jax.jit(lambda x: constrain(x, ("batch", "seq", "embed"), mesh))(x)
    assert y.sharding.is_fully_replicated and (y == x).all()


@pytest.mark.tpu_aot
def test_a_mesh_whose_axes_no_physical_product_matches_splits_a_torus_axis():
    """v5p-1024 is an 8x8x8 torus: `data` 2 x `expert` 256 matches no product of its axes, so one is split."""
    from glm5_jax.config.mesh import MeshConfig
    from glm5_jax.distributed.mesh import make_mesh
    from glm5_jax.parallel.topology import get_topology

    devices = get_topology("v5p-1024").devices()
    mesh = make_mesh(MeshConfig(data=2, expert=256), devices)
    assert dict(mesh.shape) == {"data": 2, "fsdp": 1, "expert": 256, "context": 1, "tensor": 1}
    assert sorted(d.id for d in mesh.devices.flat) == sorted(d.id for d in devices)
