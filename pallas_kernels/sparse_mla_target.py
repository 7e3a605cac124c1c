"""Sparse MLA attention that also returns the indexer KL's sparse target, for DSA's sparse training stage.

On TPU one Mosaic program per query gathers its selected rows once for both (`tpu_sparse_mla`): it keeps the
query's [Hp, Np] fp32 logits in VMEM as the row blocks arrive (GLM-5: 64 x 2048 x 4 B = 512 KiB) and, with the
final lse, writes the head-summed probabilities. The two-kernel composition gathered the same rows a second
time in `sparse_attention_target`.

On GPU the composition stays: the Triton forward's shared memory (~228 KB per block on H100 / H200) is
nearly full at GLM-5's shapes (216 KiB, README) and cannot also hold a query's [H, N] fp32 logits (512 KiB),
so `sparse_mla_attention` runs and `sparse_attention_target` gathers the rows again from its lse.
"""

from __future__ import annotations

import jax

from pallas_kernels._common import resolve_platform
from pallas_kernels.indexer_kl_target import sparse_attention_target
from pallas_kernels.sparse_mla import check_row_gradients, sparse_mla_attention, validate_sparse_call
from pallas_kernels.tpu_sparse_mla import tpu_sparse_mla_with_target


def sparse_mla_attention_with_target(q, latent, indices, *, scale, kv_lora_rank, block_n=64, bwd_query_chunk=None,
                                     interpret=None, platform=None, cost_q_offset=None, row_gradients="scatter"):
    """`sparse_mla_attention`'s (out, lse) and `sparse_attention_target`'s target from its lse: (out [B, S, H, C]
    q.dtype, lse fp32 [B, S, H], target fp32 [B, S, N]).

    The target is the L1-normalised head sum of the attention probabilities at each query's slots (0 at
    invalid slots; all 0 for a query without valid slots), a constant: no gradient flows through it (as
    under `stop_gradient`). out and lse are differentiable in q and latent with `sparse_mla_attention`'s
    backward. Arguments as `sparse_mla_attention`'s; platform "tpu" gathers the rows once for both, "gpu"
    runs the two kernels.
    """
    layout, bwd_query_chunk, interpret = validate_sparse_call(q, latent, indices, scale, kv_lora_rank, block_n,
                                                              bwd_query_chunk, interpret, cost_q_offset)
    check_row_gradients(row_gradients, resolve_platform(platform))
    if resolve_platform(platform) == "tpu":
        return tpu_sparse_mla_with_target(q, latent, indices, float(scale), layout, bwd_query_chunk, interpret,
                                          cost_q_offset)
    out, lse = sparse_mla_attention(q, latent, indices, scale=scale, kv_lora_rank=kv_lora_rank, block_n=block_n,
                                    bwd_query_chunk=bwd_query_chunk, interpret=interpret, platform="gpu",
                                    cost_q_offset=cost_q_offset, row_gradients=row_gradients)
    target = sparse_attention_target(jax.lax.stop_gradient(q), jax.lax.stop_gradient(latent), indices,
                                     jax.lax.stop_gradient(lse), scale=scale, block_n=block_n, interpret=interpret,
                                     platform="gpu", cost_q_offset=cost_q_offset)
    return out, lse, target
