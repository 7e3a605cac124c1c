"""The Pallas (Mosaic) DSA kernels compile inside the model sharded over a pod mesh: GSPMD cannot partition a
Mosaic kernel ("Mosaic kernels cannot be automatically partitioned. Please wrap the call in a shard_map"), so
the ops layer runs each kernel on every device's own batch rows under `shard_map`. Here the model's loss and
gradients with attention_backend "pallas" compile for a TPU v5p slice described by libtpu on this CPU host, with
the weights FSDP-sharded and the batch split over `fsdp` and `data`, in every indexer mode (no TPU needed)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import pytest
from jax.sharding import NamedSharding, PartitionSpec
from pallas_model import small_pallas_model

from glm5_jax.config.mesh import BATCH_AXES, MeshConfig
from glm5_jax.distributed.mesh import make_mesh
from glm5_jax.model.transformer import forward, init
from glm5_jax.parallel.sharding import param_shardings
from glm5_jax.parallel.topology import get_topology

MODEL = small_pallas_model("tpu")
BATCH, SEQ = 8, 16
# Kernel calls per mode in one layer's forward + backward (the loss runs 2 layers and the MTP layer): the
# indexer's top-k; sparse MLA forward and backward; in "sparse" the sparse KL target, in "dense_warmup" the dense
# target's passes and the indexer scores' forward and backward instead.
MIN_KERNELS = {None: 3, "sparse": 4, "dense_warmup": 6}


def _compiled_loss_and_grads(indexer_mode: str | None):
    mesh = make_mesh(MeshConfig(data=2, fsdp=2), get_topology("v5p-8").devices())
    abstract = jax.eval_shape(lambda: init(MODEL, jax.random.key(0)))
    params = jax.tree.map(lambda leaf, sharding: jax.ShapeDtypeStruct(leaf.shape, leaf.dtype, sharding=sharding),
                          abstract, param_shardings(abstract, mesh, config=MODEL))
    tokens = jax.ShapeDtypeStruct((BATCH, SEQ), jnp.int32, sharding=NamedSharding(mesh, PartitionSpec(BATCH_AXES)))

    def loss(params, tokens):
        out = forward(params, tokens, config=MODEL, indexer_mode=indexer_mode, mesh=mesh)
        value = jnp.mean(out.logits**2) + jnp.mean(out.mtp_logits**2)
        return value + (0.0 if indexer_mode is None else out.aux["indexer_kl_sum"].sum())

    return jax.jit(jax.value_and_grad(loss)).trace(params, tokens).lower().compile(), mesh


@pytest.mark.slow
@pytest.mark.tpu_aot
# "sparse" (the DSA sparse stage: the top-k and sparse MLA kernels of plain training, under the same `shard_map`
# of the ops layer, plus the target) is compiled inside `glm5 compile`'s whole training step on a v6e mesh
# (tests/parallel/test_compile_cli.py); plain training's kernels alone at GLM-5 shapes in test_tpu_compile.py.
@pytest.mark.parametrize("indexer_mode", ["dense_warmup"])
def test_pallas_model_compiles_sharded_over_a_v5p_mesh(indexer_mode):
    compiled, mesh = _compiled_loss_and_grads(indexer_mode)
    assert mesh.shape["fsdp"] > 1 and mesh.devices.size == 4
    text = compiled.as_text()
    kernels = text.count('custom_call_target="tpu_custom_call"')
    assert kernels >= MIN_KERNELS[indexer_mode], kernels
    assert "triton" not in text
