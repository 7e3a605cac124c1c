"""Pallas kernels for DeepSeek Sparse Attention (GLM-5): sparse MLA attention (forward + backward), the
lightning indexer's scores and top-k (long rows ranked through bins, `binned_topk`), and the indexer KL targets
(the sparse one also fused into the attention's forward, `sparse_mla_attention_with_target`). Each has a jnp
reference of the same signature in `pallas_kernels.reference`; the attention's and the indexer's are the jnp
code the model runs without kernels (`sparse_latent`, `chunked_topk`, blocked over queries by `query_chunks`;
`masks` says which keys a query sees). And the backward of the index scores at a selection (the sparse KL's
gradient: Mosaic only, `tpu_selected_scores`; reference `selected_scores`). See README.md in this folder for memory
bounds and tie-breaking.
And the routed experts' grouped matmul (`grouped_matmul`, its reference beside it), with a real backward; and
causal attention over every visible key for layers whose top-k keeps every key (`causal_flash_attention`: the
project's Mosaic flash kernels, `tpu_flash_attention`, or jax's Triton ones, with their costs declared; on TPU
also with the indexer KL target from the flash forward's own log-sum-exp,
`flash_attention.causal_flash_attention_with_target`).
And `uninitialized`: an HBM buffer nothing writes, for outputs a collective fills (TPU).
"""

from pallas_kernels._common import NEG_INF
from pallas_kernels.flash_attention import causal_flash_attention
from pallas_kernels.grouped_matmul import grouped_matmul
from pallas_kernels.indexer_kl_target import dense_attention_target, sparse_attention_target
from pallas_kernels.indexer_topk import indexer_scores, indexer_topk
from pallas_kernels.sparse_mla import sparse_mla_attention
from pallas_kernels.sparse_mla_target import sparse_mla_attention_with_target
from pallas_kernels.tpu_selected_scores import selected_scores_backward

__all__ = [
    "NEG_INF",
    "causal_flash_attention",
    "dense_attention_target",
    "grouped_matmul",
    "indexer_scores",
    "indexer_topk",
    "selected_scores_backward",
    "sparse_attention_target",
    "sparse_mla_attention",
    "sparse_mla_attention_with_target",
]
