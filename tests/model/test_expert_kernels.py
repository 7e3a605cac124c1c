"""The routed experts' grouped matmuls are chosen by the platform compiled for: the MoE dispatches (`ragged`
and `ep`), compiled for a TPU mesh that libtpu describes on this CPU host, run the Mosaic grouped-matmul
kernels forward and backward and no `ragged_dot`; for an H100 mesh (the CUDA plugin's compile-only devices)
the Triton ones; compiled for CPU they keep the blocked layout."""

from __future__ import annotations

import dataclasses
import re

import jax
import jax.numpy as jnp
import pytest
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec

from glm5_jax.config import ModelConfig
from glm5_jax.config.mesh import MeshConfig
from glm5_jax.distributed.mesh import make_mesh
from glm5_jax.model.moe import MoE
from glm5_jax.parallel.hlo_stats import hlo_stats
from glm5_jax.parallel.topology import get_topology

CONFIG = ModelConfig(vocab_size=64, hidden_size=256, intermediate_size=512, moe_intermediate_size=128,
                     num_hidden_layers=2, num_attention_heads=2, q_lora_rank=8, kv_lora_rank=8, qk_nope_head_dim=4,
                     qk_rope_head_dim=4, v_head_dim=4, n_routed_experts=8, num_experts_per_tok=2,
                     first_k_dense_replace=1, index_n_heads=2, index_head_dim=4, index_topk=4,
                     compute_dtype="bfloat16").validate()


def _compiled_moe_step(backend: str, mesh, seq: int = 64, **settings) -> str:
    """Compiled HLO of one MoE block's loss and gradients with `backend` (and model `settings`), its inputs (4
    sequences of `seq` tokens) on `mesh`."""
    config = dataclasses.replace(CONFIG, moe_backend=backend, **settings)
    graph, state = nnx.split(nnx.eval_shape(lambda: MoE(config, nnx.Rngs(0), jnp.float32)))
    params = nnx.to_pure_dict(state)
    x = jax.ShapeDtypeStruct((4, seq, config.hidden_size), jnp.bfloat16)
    mask = jax.ShapeDtypeStruct((4, seq), jnp.bool_)
    replicated = NamedSharding(mesh, PartitionSpec())
    place = lambda tree: jax.tree.map(  # noqa: E731
        lambda s: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=replicated), tree)

    def loss(params, x, mask):
        out, _ = nnx.merge(graph, params)(x, mask, mesh=mesh)
        return jnp.sum(out.astype(jnp.float32) ** 2)

    return jax.jit(jax.grad(loss, argnums=(0, 1))).trace(*place((params, x, mask))).lower().compile().as_text()


@pytest.mark.slow
@pytest.mark.tpu_aot
@pytest.mark.parametrize("backend", ["ragged", "ep"])
def test_moe_dispatch_for_tpu_runs_the_grouped_matmul_kernels(backend):
    devices = get_topology("v5p-8").devices()
    mesh = make_mesh(MeshConfig(expert=2, fsdp=2), devices[:4])
    text = _compiled_moe_step(backend, mesh)
    # gate and up (one matmul), down: forward gmm, input gradient gmm, weight gradient tgmm each.
    kernels = text.count('custom_call_target="tpu_custom_call"')
    assert kernels == 6, kernels
    assert "%ragged-dot" not in text


@pytest.mark.slow
@pytest.mark.tpu_aot
def test_the_ep_kernels_declare_the_work_of_an_even_load():
    """Dropless, each device's receive buffer holds what every source could send it (8,192 rows: 4x an even load of
    1,024 tokens x 2 experts); the kernels visit only the tiles holding rows, and declare the work of the rows a
    device receives on average (`DispatchLayout.expected_rows`: 2,048 and the blocks' padding) in whole tiles,
    which the counter takes instead of megablox's own count over the whole buffer."""
    mesh = make_mesh(MeshConfig(expert=4), get_topology("v5p-8").devices()[:4])
    text = _compiled_moe_step("ep", mesh, seq=1024)
    assert re.search(r"%gmm[.\d]* = bf16\[8192,", text)
    counted = hlo_stats(text, 4).kernel_flops
    whole_buffer = sum(int(flops) for flops in re.findall(r'"cost_estimate":\{"flops":"(\d+)"', text))
    assert 0 < counted < 0.8 * whole_buffer, (counted, whole_buffer)


@pytest.mark.slow
@pytest.mark.gpu_aot
@pytest.mark.parametrize("backend", ["ragged", "ep"])
def test_moe_dispatch_for_gpu_runs_the_grouped_matmul_kernels(backend):
    try:
        import jax_plugins.xla_cuda12  # noqa: F401  (the CUDA plugin: the GPU compiler and Triton)
    except ImportError:
        pytest.skip("the CUDA plugin (jax-cuda12-plugin, jax-cuda12-pjrt) is not installed")
    from jax.experimental import topologies

    from pallas_kernels.gpu_targets import gpu_target_config

    devices = topologies.get_topology_desc(platform="cuda", target_config=gpu_target_config("h100"),
                                           topology="1x1x4").devices
    text = _compiled_moe_step(backend, make_mesh(MeshConfig(expert=2, fsdp=2), devices))
    kernels = text.count('custom_call_target="__gpu$xla.gpu.triton"')
    assert kernels == 6, kernels  # as on TPU: two matmuls, three kernels each
    assert "ragged-dot" not in text


def test_moe_dispatch_for_cpu_keeps_the_blocked_layout():
    mesh = make_mesh(MeshConfig(), jax.devices("cpu")[:1])
    text = _compiled_moe_step("ragged", mesh)
    assert "tpu_custom_call" not in text and "ragged-dot" not in text
    assert " while(" in text  # the blocked layout's loop over expert blocks


def test_remat_policy_full_keep_experts_saves_the_grouped_matmul_outputs(capsys):
    """Under `full_keep_experts` a rematerialised layer keeps the routed experts' gate and up projections, so
    its backward recomputes none of their grouped matmuls; under `full` it keeps neither."""
    from jax.ad_checkpoint import print_saved_residuals

    from glm5_jax.config import REMAT_POLICIES
    from glm5_jax.model.experts import grouped_swiglu

    experts = nnx.to_pure_dict(nnx.state(MoE(CONFIG, nnx.Rngs(0), jnp.float32)))["experts"]
    rows = jax.random.normal(jax.random.key(1), (48, CONFIG.hidden_size))
    group_sizes = jnp.array([6] * 8, jnp.int32)

    def saved(policy):
        fn = jax.checkpoint(lambda e, x: grouped_swiglu(e, x, group_sizes, "cpu").sum(),
                            policy=REMAT_POLICIES[policy])
        capsys.readouterr()
        print_saved_residuals(fn, experts, rows)
        return capsys.readouterr().out.splitlines()

    kept = [note for note in saved("full_keep_experts") if "expert_gate_up" in note]
    assert len(kept) == 1, saved("full_keep_experts")  # the gate and up projections, one [rows, 2F] array
    assert not [note for note in saved("full") if "expert_gate_up" in note]
