"""The `ep` MoE dispatch on one device (mesh None): dropless equality with the reference, the deterministic
capacity drop rule against a hand loop, buffer sizes and input validation. Meshes: test_multidevice.py."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from glm5_jax.config import ModelConfig
from glm5_jax.model.experts import experts_reference
from glm5_jax.model.moe import MoE
from glm5_jax.model.expert_parallel import (ExpertParallelError, capacity_settings, dispatch_layout,
                                               experts_ep)


def init_moe(config, key, dtype) -> dict:
    """The weights of one MoE block (`MoE` module) as a pure dict."""
    return nnx.to_pure_dict(nnx.state(MoE(config, nnx.Rngs(key), dtype)))


CONFIG = ModelConfig(vocab_size=64, hidden_size=16, intermediate_size=32, moe_intermediate_size=8, num_hidden_layers=2,
                  num_attention_heads=2, q_lora_rank=8, kv_lora_rank=8, qk_nope_head_dim=4, qk_rope_head_dim=4,
                  v_head_dim=4, n_routed_experts=8, num_experts_per_tok=2, first_k_dense_replace=1,
                  index_n_heads=2, index_head_dim=4, index_topk=4, compute_dtype="float32",
                  moe_backend="ep").validate()
T, A, E = 24, 2, 8


@pytest.fixture(scope="module")
def inputs():
    experts = jax.tree.map(lambda w: w * 10, init_moe(CONFIG, jax.random.key(0), jnp.float32)["experts"])
    x = jax.random.normal(jax.random.key(1), (T, CONFIG.hidden_size))
    ids = jax.vmap(lambda k: jax.random.choice(k, E, (A,), replace=False))(jax.random.split(jax.random.key(2), T))
    weights = jax.random.uniform(jax.random.key(3), (T, A))
    return experts, x, ids.astype(jnp.int32), weights


def loss_and_grads(fn, experts, x, weights):
    probe = jnp.cos(jnp.arange(x.size, dtype=jnp.float32)).reshape(x.shape)
    return jax.jit(jax.value_and_grad(lambda e, x, w: (fn(e, x, w) * probe).sum(), argnums=(0, 1, 2)))(
        experts, x, weights)


def test_dropless_equals_reference_outputs_and_gradients(inputs):
    experts, x, ids, weights = inputs
    out, aux = jax.jit(lambda e, x, i, w: experts_ep(e, x, i, w, CONFIG, None))(experts, x, ids, weights)
    np.testing.assert_allclose(out, jax.jit(experts_reference)(experts, x, ids, weights), rtol=1e-5, atol=1e-5)
    assert int(aux["dropped_assignments"]) == 0
    got = loss_and_grads(lambda e, x, w: experts_ep(e, x, ids, w, CONFIG, None)[0], experts, x, weights)
    want = loss_and_grads(lambda e, x, w: experts_reference(e, x, ids, w), experts, x, weights)
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-4)


def test_capacity_drops_the_rows_past_the_receive_buffer_and_counts_them(inputs):
    """One device receives its own assignments in expert order, then token order; R = ceil(cf * T * A) of them
    fit and the rest are dropped."""
    experts, x, ids, weights = inputs
    config = dataclasses.replace(CONFIG, moe_capacity_factor=0.75)
    rows = int(np.ceil(0.75 * T * A))  # 36 of the 48 assignments
    kept = np.zeros((T, A), bool)
    filled = 0
    for expert in range(E):
        for token in range(T):
            for slot in range(A):
                if int(ids[token, slot]) == expert:
                    kept[token, slot] = filled < rows
                    filled += 1
    assert (~kept).sum() == T * A - rows
    out, aux = jax.jit(lambda e, x, i, w: experts_ep(e, x, i, w, config, None))(experts, x, ids, weights)
    want = jax.jit(experts_reference)(experts, x, ids, weights * kept)
    np.testing.assert_allclose(out, want, rtol=1e-5, atol=1e-5)
    assert int(aux["dropped_assignments"]) == int((~kept).sum())


def test_moe_ep_backend_without_mesh_matches_reference_backend():
    params = init_moe(CONFIG, jax.random.key(4), jnp.float32)
    x = jax.random.normal(jax.random.key(5), (2, 6, CONFIG.hidden_size))
    mask = jnp.ones((2, 6), bool)

    def run(config):  # the same weights in the MoE module of `config`
        graph = nnx.graphdef(nnx.eval_shape(lambda: MoE(config, nnx.Rngs(0), jnp.float32)))
        return jax.jit(lambda p, x: nnx.merge(graph, p)(x, mask))(params, x)

    out, aux = run(CONFIG)
    want, _ = run(dataclasses.replace(CONFIG, moe_backend="reference"))
    np.testing.assert_allclose(out, want, rtol=1e-5, atol=1e-6)
    assert int(aux["dropped_assignments"]) == 0


def test_dispatch_layout_sizes():
    dropless = dispatch_layout(local_tokens=16, top_k=2, n_experts=8, expert_shards=4, capacity_factor=0.0)
    # Each of 4 sources may send all 32 of its assignments to one rank (16 per expert, 2 experts there).
    assert (dropless.receive_rows, dropless.largest_chunk, dropless.local_experts) == (128, 32, 2)
    capped = dispatch_layout(local_tokens=16, top_k=2, n_experts=8, expert_shards=4, capacity_factor=1.25)
    assert (capped.receive_rows, capped.largest_chunk) == (40, 32)  # 1.25 x an even load of 32 rows
    one_expert_each = dispatch_layout(local_tokens=4096, top_k=8, n_experts=256, expert_shards=256,
                                      capacity_factor=1.25)
    assert (one_expert_each.receive_rows, one_expert_each.largest_chunk) == (40960, 4096)
    # Rows in blocks of 16: each chunk padded to whole blocks; the receive buffer adds their expected padding
    # (256 chunks x 7.5 rows) and holds whole blocks; the send buffer holds every chunk's worst-case padding.
    blocked = dispatch_layout(local_tokens=2048, top_k=8, n_experts=256, expert_shards=256, capacity_factor=1.25,
                              row_block=16)
    assert (blocked.receive_rows, blocked.receive_blocks) == (22400, 1400)  # 20480 + 1920
    assert (blocked.send_blocks, blocked.largest_chunk_blocks) == ((16384 + 256 * 15) // 16, 128)
    dropless_blocks = dispatch_layout(local_tokens=16, top_k=2, n_experts=8, expert_shards=4, capacity_factor=0.0,
                                      row_block=16)
    # Chunks of 29, 1, 1 and 1 rows take 2 + 1 + 1 + 1 blocks: the most 32 rows in 4 chunks can.
    assert dropless_blocks.receive_rows == 4 * 32 and dropless_blocks.send_blocks == 5


@pytest.mark.tpu_aot
def test_mesh_layout_blocks_rows_and_takes_the_grouped_matmuls_whole_row_tiles_on_tpu():
    """On a TPU mesh (described by libtpu; nothing compiles) rows travel in blocks of a bf16 tile's 16 rows and the
    receive buffer is rounded up to rows the grouped matmuls take without padding it; on CPU neither."""
    from glm5_jax.config.mesh import MeshConfig
    from glm5_jax.distributed.mesh import make_mesh
    from glm5_jax.model.expert_parallel import mesh_layout
    from glm5_jax.parallel.topology import get_topology
    from pallas_kernels.grouped_matmul import kernel_rows

    config = dataclasses.replace(CONFIG, moe_capacity_factor=1.25)
    up_shape = (256, 6144, 2048)
    tpu_mesh = make_mesh(MeshConfig(expert=8), get_topology("v6e-8").devices())
    layout = mesh_layout(config, tpu_mesh, up_shape, 2048, 8, jnp.bfloat16)
    even = dispatch_layout(2048, 8, 256, 8, 1.25, row_block=16)
    assert layout.row_block == 16 and layout.receive_rows % 16 == 0 and layout.receive_rows >= even.receive_rows
    for k, n in ((6144, 4096), (2048, 6144)):
        assert kernel_rows(layout.receive_rows, k, n, 32, jnp.bfloat16, platform="tpu",
                           device_kind="TPU v6 lite") == layout.receive_rows
    cpu_mesh = make_mesh(MeshConfig(expert=1), jax.devices()[:1])
    assert mesh_layout(config, cpu_mesh, up_shape, 2048, 8, jnp.float32) == dispatch_layout(2048, 8, 256, 1, 1.25)
    # `moe_kernel_vmem_mib`: with one expert per chip the one-group kernels' own VMEM, and rows they take whole
    # (the gate and up projection in one, then down); with 32 experts per chip megablox's, as before.
    raised = dataclasses.replace(config, moe_kernel_vmem_mib=96)
    assert mesh_layout(raised, tpu_mesh, up_shape, 2048, 8, jnp.bfloat16) == layout
    one_each = mesh_layout(raised, tpu_mesh, (8, 6144, 2048), 2048, 8, jnp.bfloat16)
    assert one_each.kernel_vmem == 96 * 2**20 and one_each.local_experts == 1
    for k, n in ((6144, 4096), (2048, 6144)):
        assert kernel_rows(one_each.receive_rows, k, n, 1, jnp.bfloat16, platform="tpu", device_kind="TPU v6 lite",
                           vmem_limit=one_each.kernel_vmem) == one_each.receive_rows


def test_settings_and_inputs_are_validated(inputs):
    experts, x, ids, weights = inputs
    with pytest.raises(ExpertParallelError, match=r"moe_capacity_factor=-1\.0 is invalid"):
        capacity_settings(dataclasses.replace(CONFIG, moe_capacity_factor=-1.0))
    with pytest.raises(ExpertParallelError, match=r"ep_transport='nccl' is invalid"):
        capacity_settings(dataclasses.replace(CONFIG, ep_transport="nccl"))
    with pytest.raises(ExpertParallelError, match=r"weights has shape \(24, 3\)"):
        experts_ep(experts, x, ids, jnp.ones((T, 3)), CONFIG, None)
    with pytest.raises(ExpertParallelError, match="experts must hold gate_proj, up_proj and down_proj"):
        experts_ep({"gate_proj": experts["gate_proj"]}, x, ids, weights, CONFIG, None)
