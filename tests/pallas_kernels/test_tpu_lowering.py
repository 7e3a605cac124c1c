"""The Mosaic kernels (platform="tpu", interpret=False) lower for TPU at GLM-5 shapes, checked on CPU through
jax.export: catches what TPU interpret mode cannot (block shapes breaking the (8, 128) rule, ops without a
Mosaic lowering, SMEM/HBM/VMEM misuse). libtpu's own Mosaic compilation (layouts, VMEM limits) still
needs a TPU."""

import jax
import jax.numpy as jnp
import pytest

from pallas_kernels import (
    dense_attention_target,
    indexer_scores,
    indexer_topk,
    sparse_attention_target,
    sparse_mla_attention,
)

B, S, T, H, C, R, N, I, J = 1, 64, 256, 64, 512, 64, 128, 32, 128
BF16, F32, I32 = jnp.bfloat16, jnp.float32, jnp.int32
Q, LATENT = jax.ShapeDtypeStruct((B, S, H, C + R), BF16), jax.ShapeDtypeStruct((B, T, C + R), BF16)
INDICES, LSE = jax.ShapeDtypeStruct((B, S, N), I32), jax.ShapeDtypeStruct((B, S, H), F32)
Q_INDEX, K_INDEX = jax.ShapeDtypeStruct((B, S, I, J), BF16), jax.ShapeDtypeStruct((B, T, J), BF16)
WEIGHTS = jax.ShapeDtypeStruct((B, S, I), F32)
COMPILED = dict(interpret=False, platform="tpu")


def _attention_loss(q, latent, indices):
    out, lse = sparse_mla_attention(q, latent, indices, scale=0.06, kv_lora_rank=C, **COMPILED)
    return jnp.sum(out.astype(F32)) + jnp.sum(lse)


def _scores_loss(q, k, w):
    return jnp.sum(jnp.sin(indexer_scores(q, k, w, **COMPILED)))


# name: (function, arguments, number of Mosaic kernels in the module)
CALLS = {
    "sparse_mla_forward": (lambda q, l, i: sparse_mla_attention(q, l, i, scale=0.06, kv_lora_rank=C, **COMPILED),
                           (Q, LATENT, INDICES), 1),
    "sparse_mla_backward": (jax.grad(_attention_loss, argnums=(0, 1)), (Q, LATENT, INDICES), 2),
    "indexer_topk": (lambda q, k, w: indexer_topk(q, k, w, topk=N, **COMPILED), (Q_INDEX, K_INDEX, WEIGHTS), 1),
    "indexer_scores_grad": (jax.grad(_scores_loss, argnums=(0, 1, 2)), (Q_INDEX, K_INDEX, WEIGHTS), 1),
    "sparse_target": (lambda q, l, i, s: sparse_attention_target(q, l, i, s, scale=0.06, **COMPILED),
                      (Q, LATENT, INDICES, LSE), 1),
    "dense_target": (lambda q, l: dense_attention_target(q, l, scale=0.06, **COMPILED), (Q, LATENT), 2),
}


@pytest.mark.parametrize("name", sorted(CALLS))
def test_lowers_to_mosaic_for_tpu(name):
    fn, args, kernels = CALLS[name]
    module = jax.export.export(jax.jit(fn), platforms=["tpu"])(*args).mlir_module()
    assert module.count("stablehlo.custom_call @tpu_custom_call") == kernels
    assert "triton" not in module
