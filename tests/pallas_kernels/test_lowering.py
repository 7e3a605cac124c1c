"""The compiled (non-interpret) kernels lower at GLM-5 shapes for both targets, checked on CPU through
jax.export: Triton for CUDA (platform "gpu") and Mosaic for TPU (platform "tpu"). This catches what
interpret mode cannot: tiles Triton rejects (non-power-of-two) or that break TPU's (8, 128) rule, ops
without a lowering, a Mosaic-GPU fallback, SMEM/HBM/VMEM misuse. libtpu's own Mosaic compilation (tile
alignment, layouts, VMEM limits) is checked in test_tpu_compile.py; compiling the Triton IR to a GPU binary
still needs a GPU."""

import functools

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

# platform: (export platform, the custom call its kernels lower to, what must not appear, disabled checks)
TARGETS = {
    "gpu": ("cuda", "stablehlo.custom_call @__gpu$xla.gpu.triton", "mosaic_gpu",
            [jax.export.DisabledSafetyCheck.custom_call("__gpu$xla.gpu.triton")]),
    "tpu": ("tpu", "stablehlo.custom_call @tpu_custom_call", "triton", []),
}


def _calls(platform: str) -> dict:
    """name: (function, arguments, number of kernels per platform)."""
    compiled = dict(interpret=False, platform=platform)
    attention = functools.partial(sparse_mla_attention, scale=0.06, kv_lora_rank=C, **compiled)

    def attention_loss(q, latent, indices):
        out, lse = attention(q, latent, indices)
        return jnp.sum(out.astype(F32)) + jnp.sum(lse)

    def scores_loss(q, k, w):
        return jnp.sum(jnp.sin(indexer_scores(q, k, w, **compiled)))

    return {
        "sparse_mla_forward": (attention, (Q, LATENT, INDICES), {"gpu": 1, "tpu": 1}),
        # TPU: and the empty call that makes the dq buffer the backward writes in place (`uninitialized`).
        "sparse_mla_backward": (jax.grad(attention_loss, argnums=(0, 1)), (Q, LATENT, INDICES), {"gpu": 2, "tpu": 3}),
        "indexer_topk": (lambda q, k, w: indexer_topk(q, k, w, topk=N, **compiled), (Q_INDEX, K_INDEX, WEIGHTS),
                         {"gpu": 1, "tpu": 1}),
        "indexer_scores_grad": (jax.grad(scores_loss, argnums=(0, 1, 2)), (Q_INDEX, K_INDEX, WEIGHTS),
                                {"gpu": 1, "tpu": 1}),
        "sparse_target": (lambda q, l, i, s: sparse_attention_target(q, l, i, s, scale=0.06, **compiled),
                          (Q, LATENT, INDICES, LSE), {"gpu": 1, "tpu": 1}),
        # TPU: one call for each head's lse, one for the head sum (GPU does both passes in one program).
        "dense_target": (lambda q, l: dense_attention_target(q, l, scale=0.06, **compiled), (Q, LATENT),
                         {"gpu": 1, "tpu": 2}),
    }


@pytest.mark.parametrize("platform", sorted(TARGETS))
@pytest.mark.parametrize("name", sorted(_calls("gpu")))
def test_kernels_lower_for_the_platform(name, platform):
    export_platform, kernel_call, foreign, disabled = TARGETS[platform]
    fn, args, kernels = _calls(platform)[name]
    module = jax.export.export(jax.jit(fn), platforms=[export_platform], disabled_checks=disabled)(*args).mlir_module()
    assert module.count(kernel_call) == kernels[platform]
    assert foreign not in module
