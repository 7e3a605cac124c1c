"""The GLM-5 model: Flax NNX modules that own their computation (`transformer.GLM5` and its layers), and
`transformer.forward`, the one pure function over the model's state (for jit, optax and orbax). The heavy
operations (sparse attention, indexer top-k, grouped matmul) are the ops layer's (`glm5_jax.ops`).

Einsum dimension letters used throughout the package:
  B batch, S query length, T key length, D model width, H attention heads, K head dim (qk),
  P value head dim, C kv latent (kv_lora_rank), R rope dim, Q q latent (q_lora_rank),
  E experts, F (expert) hidden width, V vocabulary, I indexer heads, J indexer head dim,
  N top-k selected keys, L stacked layers, G expert groups, A top-k experts per token.
"""
