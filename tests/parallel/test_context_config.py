"""`mesh.context` on one device: the axis in configs, overrides, meshes and the rule table; the refusals that
name it (a sequence it cannot split in two chunks per chip, a query block that does not divide a chip's
queries); the planner's split of activations and weights and its key all-gathers. (Values on split sequences: test_context_parallel.py, 8 devices.)"""

import dataclasses

import jax
import jax.numpy as jnp
import pytest
from jax.sharding import PartitionSpec as P

from glm5_jax.config import ConfigError, load_model_config
from glm5_jax.config.experiment import load_experiment
from glm5_jax.config.mesh import MeshConfig, MeshConfigError, mesh_values
from glm5_jax.distributed.context_local import context_local, require_whole_sequences
from glm5_jax.distributed.context_order import balanced_chunks, declared_offset
from glm5_jax.distributed.logical_axes import logical_to_spec
from glm5_jax.distributed.mesh import make_mesh
from glm5_jax.parallel.plan import PlanError, PlanSettings, plan
from pallas_kernels.dsa_cost import causal_tiles

TINY = load_model_config("configs/tiny.yaml", ["moe_backend=ep"])


def test_context_axis_is_parsed_built_and_splits_the_sequence_only():
    assert mesh_values(["mesh.context=4"]) == {"context": 4}
    cfg = load_experiment("configs/tiny.yaml", ["mesh.fsdp=2", "mesh.context=4", "train.seq_len=64"])
    assert cfg.mesh.context == 4 and cfg.mesh.num_devices == 8
    assert MeshConfig(context=-1).resolve(8).context == 8
    with pytest.raises(MeshConfigError, match=r"mesh.context=0 is invalid"):
        MeshConfig(context=0)
    with pytest.raises(MeshConfigError, match=r"mesh.data, mesh.fsdp, mesh.expert, mesh.context and mesh.tensor"):
        MeshConfig(context=2).validate_devices(1)
    assert make_mesh(MeshConfig()).axis_names == ("data", "fsdp", "expert", "context", "tensor")
    sizes = {"data": 1, "fsdp": 2, "expert": 1, "context": 4, "tensor": 1}
    assert logical_to_spec(("batch", "seq", "embed"), (2, 64, 32), sizes) == P("fsdp", "context", None)
    # Weights are FSDP-sharded over `context` too (after `fsdp`), and routed experts spread over it.
    assert logical_to_spec(("embed", "q_lora"), (64, 32), sizes) == P(("fsdp", "context"), None)
    assert logical_to_spec(("experts", "expert_embed", None), (8, 64, 32), sizes) == P("context", "fsdp", None)


def test_context_split_refusals_name_the_field():
    with pytest.raises(ConfigError, match=r"mesh.context=4 is invalid: must split train.seq_len=36 into 2 x 4"):
        load_experiment("configs/tiny.yaml", ["mesh.fsdp=1", "mesh.context=4", "train.seq_len=36"])
    # The Pallas kernels run across the split (each chip's queries with their global offset).
    assert load_experiment("configs/tiny.yaml", ["mesh.fsdp=1", "mesh.context=2", "train.seq_len=64",
                                                 "model.attention_backend=pallas"]).mesh.context == 2
    # 32 divides the sequence (384) but not the 48 queries of a chip's chunk (two chunks per chip)
    with pytest.raises(ConfigError, match=r"model.index_query_chunk=32 is invalid: must divide the 48 queries "):
        load_experiment("configs/tiny.yaml", ["mesh.fsdp=1", "mesh.context=4", "train.seq_len=384",
                                              "model.index_query_chunk=32"])
    with pytest.raises(PlanError, match=r"mesh.context=4 is invalid: must split seq=36"):
        plan(TINY, MeshConfig(context=4), PlanSettings(batch=1, seq=36))


def test_one_device_is_the_context_one_case_with_offset_zero():
    require_whole_sequences(None, "a kernel")  # no split: nothing to refuse
    split = jax.sharding.AbstractMesh((2, 2), ("fsdp", "context"))
    with pytest.raises(ValueError, match=r"mesh.context=2 is invalid for the sparse MLA kernel"):
        require_whole_sequences(split, "the sparse MLA kernel")
    q, k = jnp.arange(6.0).reshape(1, 3, 2), jnp.ones((1, 3, 2))
    offsets = []
    out = context_local(lambda offset, q, k: offsets.append(offset) or q + k, None, (q,), (k,))
    assert offsets == [0] and isinstance(offsets[0], int)
    assert (out == q + 1).all()


@pytest.mark.slow
def test_plan_splits_activations_and_counts_key_all_gathers():
    # Activations split 4 ways. (With `ep` the experts' receive buffers also change shape: they are spread over
    # `context` too, so these are compared with the experts on every chip.)
    local_experts = dataclasses.replace(TINY, moe_backend="ragged")
    settings = PlanSettings(batch=1, seq=256, optimizer="adamw")
    whole, split = (plan(local_experts, mesh, settings) for mesh in (MeshConfig(), MeshConfig(context=4)))
    assert split["memory_bytes"]["activations_saved"] == pytest.approx(
        whole["memory_bytes"]["activations_saved"] / 4, rel=0.02)
    assert split["memory_bytes"]["activations_working_set"] < whole["memory_bytes"]["activations_working_set"] / 3
    whole, split = (plan(TINY, mesh, settings) for mesh in (MeshConfig(), MeshConfig(context=4)))
    # The weights (experts included) are split over the context chips too; only small vectors stay whole.
    assert split["memory_bytes"]["params"] == pytest.approx(whole["memory_bytes"]["params"] / 4, rel=0.02)
    assert split["communication_bytes"]["fsdp_reduce_scatter"] > 0 == whole["communication_bytes"]["fsdp_reduce_scatter"]
    comm = split["communication_bytes"]
    key_width = TINY.kv_lora_rank + TINY.qk_rope_head_dim + TINY.index_head_dim
    layers = TINY.num_hidden_layers + TINY.mtp_num_steps
    # forward + backward (no remat in tiny.yaml): each chip sends its 64 tokens' keys to the 3 others
    assert comm["context_all_gather"] == layers * 2 * 3 * 64 * key_width * 4
    assert comm["data_all_reduce"] > 0 == whole["communication_bytes"]["data_all_reduce"]


@pytest.mark.parametrize("split", [2, 4, 8, 64])
def test_a_chips_two_chunks_declare_the_causal_tiles_they_visit(split):
    """Under a split the kernels see a traced query offset; each of a chip's two calls declares its cost at the
    mean offset of the chip's chunks (`declared_offset`), so the pair declares exactly the key tiles the two chunks
    visit (every chip the same), where a traced offset alone would declare every tile for both."""
    chunk, block_s, block_t = 512, 128, 128
    keys = 2 * split * chunk
    key_blocks = keys // block_t
    mean = declared_offset(jnp.int32(0), keys, chunk)
    assert declared_offset(0, keys, chunk) is None  # a static offset: the kernels count it themselves
    for chip in range(split):
        early, late = balanced_chunks(chip, split)
        visited = sum(causal_tiles((c * chunk, chunk, 1), chunk, block_s, block_t, key_blocks) for c in (early, late))
        assert visited == 2 * causal_tiles((mean, chunk, 1), chunk, block_s, block_t, key_blocks)
    every_tile = causal_tiles((None, chunk, 1), chunk, block_s, block_t, key_blocks)
    assert visited <= (0.5 + 1 / split) * 2 * every_tile  # about half of what a traced offset declares
