"""The GLM-5 model as pure functions over a parameter pytree.

Einsum dimension letters used throughout the package:
  B batch, S query length, T key length, D model width, H attention heads, K head dim (qk),
  P value head dim, C kv latent (kv_lora_rank), R rope dim, Q q latent (q_lora_rank),
  E experts, F (expert) hidden width, V vocabulary, I indexer heads, J indexer head dim,
  N top-k selected keys, L stacked layers, G expert groups, A top-k experts per token.
"""
