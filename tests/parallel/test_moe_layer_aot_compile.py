"""One GLM-5 MoE layer's training step (router, 256 routed experts, shared expert; forward and backward in bf16)
compiled ahead of time, on a machine with neither, for a TPU v5p slice (libtpu; 4 chips) and for one node of 8
H100s (the CUDA plugin), with the routed experts spread over the chips (`expert` = chips, `fsdp` 1): the
compiled step must do the model's matmul work, its grouped matmuls' weight gradients included
(`jax.lax.ragged_dot`'s transpose is a dense product over every local expert: 64x on the v5p slice, and on GPU
the forward is dense too), and must gather no routed expert's weights (its tokens travel to it by all-to-all).

The capacity factor is 1.0 so the receive buffers hold exactly the even load: the grouped matmul kernels declare
the work of the row tiles an even load takes, one more per boundary between experts inside a tile, which with 64
or 32 experts per chip at this size is every row of the buffer. On TPU the rows travel in blocks of 16
(`model.ep_row_block`), whose expected padding the receive buffer adds, and the buffer is rounded up to the
grouped matmuls' row tiles: the model count here adds those rows too, and the compiled step must cut no buffer
into libtpu's one-row-per-tile layout (a [rows, 2, D / 2] copy of every buffer the all-to-all sends or
receives)."""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp
import pytest
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec

from glm5_jax.config import load_model_config
from glm5_jax.config.mesh import BATCH_AXES, MeshConfig
from glm5_jax.distributed.logical_axes import logical_to_spec
from glm5_jax.distributed.mesh import make_mesh
from glm5_jax.model.expert_parallel import mesh_layout
from glm5_jax.model.flops import moe_flops_per_token
from glm5_jax.model.moe import MoE
from glm5_jax.model.variables import logical_axes
from glm5_jax.parallel.hlo_stats import hlo_stats, result_shapes
from glm5_jax.parallel.topology import get_topology

from xla_env import REPO

# What is checked (matmul work against the model's, no expert weight gathered) holds at any token count;
# libtpu compiles the step for 1024 tokens per chip in about half the CPU time it takes for 4096, and for 128
# in ~16% less than for 1024 (43 vs 52 CPU s, one cold process each, 2026-12-02).
TOKENS_PER_CHIP = 128


@pytest.mark.slow
@pytest.mark.parametrize("topology", [pytest.param("v5p-8", marks=pytest.mark.tpu_aot),
                                      pytest.param("h100-8", marks=pytest.mark.gpu_aot)])
def test_moe_layer_step_does_the_model_flops_and_gathers_no_expert_weight(topology):
    config = dataclasses.replace(load_model_config(REPO / "configs" / "glm5_744b.yaml"), moe_backend="ep",
                                 moe_capacity_factor=1.0, param_dtype="bfloat16").validate()
    devices = get_topology(topology).devices()
    mesh = make_mesh(MeshConfig(expert=len(devices)), devices)
    graph, state = nnx.split(nnx.eval_shape(lambda: MoE(config, nnx.Rngs(0), jnp.bfloat16)))
    params = nnx.to_pure_dict(jax.tree.map(
        lambda v: jax.ShapeDtypeStruct(v.shape, v.dtype, sharding=NamedSharding(
            mesh, logical_to_spec(logical_axes(v), v.shape, mesh))), state,
        is_leaf=lambda x: isinstance(x, nnx.Variable)))
    rows = len(devices)
    tokens = NamedSharding(mesh, PartitionSpec(BATCH_AXES))
    x = jax.ShapeDtypeStruct((rows, TOKENS_PER_CHIP, config.hidden_size), jnp.bfloat16, sharding=tokens)

    def loss(params, x):
        out, _ = nnx.merge(graph, params)(x, jnp.ones(x.shape[:2], bool), mesh=mesh)
        return jnp.sum(out.astype(jnp.float32) ** 2)

    compiled = jax.jit(jax.grad(loss, argnums=(0, 1))).trace(params, x).lower().compile()
    text = compiled.as_text()
    stats = hlo_stats(text, len(devices))
    d, f = config.hidden_size, config.moe_intermediate_size
    assignments = TOKENS_PER_CHIP * config.num_experts_per_tok
    # The receive buffer as the step sizes it (the blocks' padding, whole row tiles).
    layout = mesh_layout(config, mesh, (config.n_routed_experts, d, f), TOKENS_PER_CHIP, config.num_experts_per_tok,
                         jnp.bfloat16)
    padding = 3 * 6 * d * f * (layout.receive_rows - assignments)  # its rows past the even load, fwd + bwd
    model = 3 * moe_flops_per_token(config) * TOKENS_PER_CHIP + padding  # forward + backward, per chip
    ratio = stats.matmul_flops / model
    assert 0.95 <= ratio <= 1.1, (ratio, dict(list(stats.flops_by_source.items())[:6]))
    assert "ragged-dot" not in text and "ragged_dot" not in text, "the routed experts must use the grouped " \
        "matmul kernels, not ragged_dot"
    assert not stats.kernels_without_cost, stats.kernels_without_cost
    gathered = [s for s in result_shapes(text, "all-gather") if len(s) >= 3 and s[-2:] in ((d, f), (f, d))]
    assert not gathered, f"routed-expert weights all-gathered: {gathered}"
    assert stats.collective_counts.get("ragged-all-to-all", 0) >= 2, stats.collective_counts
    if layout.row_block > 1:
        moved = result_shapes(text, "ragged-all-to-all")
        rows = [s for s in moved if s[-1] == d]  # the tokens' rows; the others carry each row's routing weight
        assert rows and all(s[1:] == (layout.row_block, d) for s in rows), moved
        assert all(math.prod(s) * 16 <= math.prod(rows[0]) for s in moved if s[-1] != d), moved
        relayouts = [s for op in ("copy", "reshape") for s in result_shapes(text, op) if s[-2:] == (2, d // 2)]
        assert not relayouts, f"buffers copied into one row per tile: {relayouts}"
    # Tokens are sorted to their experts and back by permutations whose gradients are gathers
    # (`model/token_permutation.py`): no scatter of activation rows, which XLA:GPU would run as atomic adds in
    # an order that varies from run to run.
    row_scatters = [s for s in result_shapes(text, "scatter") if len(s) == 2 and s[-1] == d]
    assert not row_scatters, f"activation rows scattered: {row_scatters}"
