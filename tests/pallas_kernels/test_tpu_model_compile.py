"""The whole model with attention_backend "pallas" and pallas_platform "tpu" compiles for a TPU v5p chip inside a
full training step (DSA warm-up and sparse modes): XLA's TPU compiler and libtpu's Mosaic compiler accept every
kernel the model calls, inside jit, grad, the layer scan and the optimizer update. No TPU needed."""

import dataclasses

import jax
import jax.numpy as jnp
import pytest
from aot_compile import SCOPED_VMEM_LIMIT, chip_sharding, mosaic_vmem_bytes
from pallas_model import small_pallas_model

from glm5_jax.config import ConfigError, TrainConfig
from glm5_jax.model.transformer import init
from glm5_jax.train.optim import OptimConfig, make_optimizer
from glm5_jax.train.step import init_train_state, make_train_step

MODEL = small_pallas_model("tpu")
BATCH, SEQ = 2, 16


def _compiled_step(mode: str):
    optim = OptimConfig(name="adamw", lr=1e-3, min_lr=0.0, warmup_steps=1, total_steps=10, schedule="constant",
                        weight_decay=0.0, trainable="indexer" if mode == "dsa_warmup" else "all")
    params = jax.eval_shape(lambda: init(MODEL, jax.random.key(0)))
    tx = make_optimizer(optim, params, config=MODEL)
    state = jax.eval_shape(lambda p: init_train_state(p, tx), params)
    train = TrainConfig(mode=mode, batch_size=BATCH, seq_len=SEQ, vocab_chunk=32)
    step = make_train_step(MODEL, train, tx)
    sharding = chip_sharding("v5p")
    place = lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sharding)  # noqa: E731
    batch = {key: jax.ShapeDtypeStruct((BATCH, SEQ), jnp.int32, sharding=sharding)
             for key in ("tokens", "segment_ids", "positions", "loss_mask")}
    return step.jitted.trace(jax.tree.map(place, state), batch).lower().compile()


@pytest.mark.tpu_aot
@pytest.mark.slow
@pytest.mark.parametrize("mode", ["dsa_warmup", "dsa_sparse"])
def test_pallas_training_step_compiles_for_v5p(mode):
    compiled = _compiled_step(mode)
    vmem = mosaic_vmem_bytes(compiled)
    text = compiled.as_text()
    assert "triton" not in text
    # dsa_sparse: sparse MLA forward + backward and the sparse KL target per layer, the indexer's top-k;
    # dsa_warmup adds the dense target's two passes and the indexer scores.
    assert len(vmem) >= (6 if mode == "dsa_warmup" else 4), vmem
    assert max(vmem) < SCOPED_VMEM_LIMIT, vmem


def test_pallas_platform_is_validated():
    valid = r"must be one of \('auto', 'gpu', 'tpu'\)"
    with pytest.raises(ConfigError, match=r"pallas_platform='cuda' is invalid: " + valid):
        dataclasses.replace(MODEL, pallas_platform="cuda").validate()
    assert MODEL.pallas_options == dict(platform="tpu", interpret=False)
    assert dataclasses.replace(MODEL, pallas_platform="auto").pallas_options == {}
