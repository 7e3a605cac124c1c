"""The whole model with attention_backend "pallas" and pallas_platform "gpu" compiles for an H100 inside a full
training step of the DSA warm-up: XLA's GPU compiler and its Triton compiler accept every Pallas Triton kernel
the model calls (flash attention over every visible key among them), inside jit, grad, the layer scan and
the optimizer update. No GPU needed. (The sparse stage's
kernels are compiled inside `glm5 compile`'s step for an H200 cluster, tests/parallel/test_compile_cli.py.)"""

import jax
import jax.numpy as jnp
import pytest
from gpu_compile import lower_for, require_cuda_plugin, triton_kernel_names, triton_shared_memory
from pallas_model import small_pallas_model

from glm5_jax.config import TrainConfig
from glm5_jax.model.transformer import init
from glm5_jax.train.optim import OptimConfig, make_optimizer
from glm5_jax.train.step import init_train_state, make_train_step
from pallas_kernels.shared_memory import shared_memory_limit

# Without the MTP step, whose layer calls the same kernels again (~20% of the compile).
MODEL = small_pallas_model("gpu", mtp_num_steps=0)
BATCH, SEQ = 2, 16


def _lowered_step(mode: str):
    optim = OptimConfig(name="adamw", lr=1e-3, min_lr=0.0, warmup_steps=1, total_steps=10, schedule="constant",
                        weight_decay=0.0, trainable="indexer" if mode == "dsa_warmup" else "all")
    params = jax.eval_shape(lambda: init(MODEL, jax.random.key(0)))
    tx = make_optimizer(optim, params, config=MODEL)
    state = jax.eval_shape(lambda p: init_train_state(p, tx), params)
    step = make_train_step(MODEL, TrainConfig(mode=mode, batch_size=BATCH, seq_len=SEQ, vocab_chunk=32), tx)
    batch = {key: jax.ShapeDtypeStruct((BATCH, SEQ), jnp.int32)
             for key in ("tokens", "segment_ids", "positions", "loss_mask")}
    return lower_for(step.jitted, (state, batch), "h100")


@pytest.mark.gpu_aot
@pytest.mark.slow
def test_pallas_dense_warmup_step_compiles_for_h100():
    require_cuda_plugin()
    lowered = _lowered_step("dsa_warmup")
    text = lowered.compile().as_text()
    kernels = set(triton_kernel_names(text))
    assert "tpu_custom_call" not in text
    # Only the indexer trains: the dense KL target and the indexer scores (forward and backward); the attention
    # over every visible key is jax's Triton flash attention (forward only: no weight under it trains).
    assert {"_dense_target_kernel", "_scores_kernel", "mha_forward"} <= kernels, kernels
    assert "mha_backward" not in kernels and "_forward_kernel" not in kernels, kernels
    assert max(triton_shared_memory(lowered).values()) <= shared_memory_limit("h100")
