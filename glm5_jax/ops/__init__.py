"""The model's heavy operations, each switched in one place between its jnp path and its kernels.

One function per operation; the model calls only these, never a kernel:
- `sparse_attention` (and `sparse_attention_with_target`, `dense_attention_with_target` for the indexer KL):
  DSA's absorbed-form MLA attention over selected latent rows (`sparse_attention.py`);
- `indexer_topk` (and `indexer_topk_with_scores`, for the sparse KL), `indexer_scores`: the lightning indexer's
  scores and top-k (`indexer_select.py`);
- `selected_scores_backward`: the gradient of the index scores at a selection, the sparse KL's backward
  (`selected_scores_grad.py`; a Mosaic kernel on TPU only, the jnp path elsewhere);
- `grouped_matmul`: the routed experts' grouped matmul (`grouped_matmul.py`);
- `causal_attention` (and `causal_attention_with_target`): every head over every visible key in the expanded form,
  where DSA's selection is the causal mask itself (T <= index_topk, the dense warm-up): flash attention kernels
  (the project's Mosaic ones on TPU, jax's Triton ones on GPU; `causal_attention.py`), in place of the sparse MLA
  kernel over every row;
- `fill_buffer`: a buffer a collective fills, not zero-filled first on TPU (`buffers.py`).
Config `attention_backend: pallas` selects the Pallas kernels (Mosaic on TPU, Triton on GPU, interpreted on CPU;
`ops.platform.uses_kernels`); every other backend runs the jnp path, which is also the kernels' reference
(`pallas_kernels.sparse_latent`, `pallas_kernels.chunked_topk`; memory bounded by query blocks). Kernels run
under `shard_map` over the batch axes of the mesh (`distributed.batch_local`): GSPMD cannot partition a Mosaic
kernel; they refuse a sequence split over `context`. The jnp path runs under `distributed.context_local`: each
chip's queries against the key rows all-gathered over `context`, by global position (on one chip, offset 0).
"""
