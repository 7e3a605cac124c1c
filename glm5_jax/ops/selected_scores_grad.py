"""The gradient of the lightning indexer's scores at a selection (the sparse KL's backward), choosing the jnp path
or the Mosaic kernel in one place.

jnp (`pallas_kernels.selected_scores.gathered_scores_backward`): per query block, XLA gathers the selected
index-key rows [B, c, N, J] and takes the VJP of the recomputed per-head logits, all of it in HBM. Mosaic
(`pallas_kernels.selected_scores_backward`, config `attention_backend: pallas` on the TPU platform): the rows are
DMA'd into VMEM per query and only dq, dw and the per-slot key rows leave the kernel. There is no Triton kernel:
on GPU, and on CPU unless the TPU kernels are asked for (`pallas_platform: tpu`, or the TPU interpret mode the
tests use), `attention_backend: pallas` keeps the jnp path.
"""

from __future__ import annotations

import jax

from glm5_jax.config import ModelConfig
from glm5_jax.ops.platform import uses_tpu_kernels
from pallas_kernels import selected_scores_backward as selected_scores_backward_kernel
from pallas_kernels.selected_scores import gathered_scores_backward


def uses_selected_scores_kernel(config: ModelConfig) -> bool:
    """Whether the backward runs the Mosaic kernel (a Mosaic kernel must then see only its device's rows)."""
    return uses_tpu_kernels(config)


def selected_scores_backward(q: jax.Array, weights: jax.Array, keys: jax.Array, topk: jax.Array,
                             d_scores: jax.Array, *, config: ModelConfig,
                             cost_q_offset: int | None = None) -> tuple[jax.Array, jax.Array, jax.Array]:
    """(dq, dw, dk) of the fp32 index scores at `topk` [B, S, N] (-1 = unused slot) of indexer queries
    q [B, S, I, J], head weights [B, S, I] and keys [B, T, J], for their cotangent d_scores [B, S, N] (zero on
    unused slots); query blocks of `index_query_chunk`, the key gradient summed over them in fp32.
    cost_q_offset: for a causal self-selection, the position of query 0 (the kernel's declared cost)."""
    if uses_selected_scores_kernel(config):
        return selected_scores_backward_kernel(q, keys, weights, topk, d_scores,
                                               bwd_query_chunk=config.index_query_chunk,
                                               cost_q_offset=cost_q_offset, **config.pallas_options)
    return gathered_scores_backward(q, weights, keys, topk, d_scores, config.index_query_chunk)
