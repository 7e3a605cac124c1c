"""The small GLM-5-shaped model with attention_backend "pallas" that the kernel-compile tests build (every DSA
kernel and the grouped matmul are called; shapes small enough to compile in seconds)."""

import dataclasses

from glm5_jax.config import ModelConfig


def small_pallas_model(platform: str = "auto", **overrides) -> ModelConfig:
    """The model on `platform`'s kernels; `overrides` replace fields (a dtype, another backend)."""
    return dataclasses.replace(ModelConfig(vocab_size=64, hidden_size=32, intermediate_size=48, moe_intermediate_size=16,
                       num_hidden_layers=2, num_attention_heads=2, q_lora_rank=16, kv_lora_rank=16,
                       qk_nope_head_dim=8, qk_rope_head_dim=4, v_head_dim=8, n_routed_experts=4,
                       num_experts_per_tok=2, first_k_dense_replace=1, index_n_heads=2, index_head_dim=8,
                       index_topk=4, mtp_num_steps=1, compute_dtype="bfloat16", attention_backend="pallas",
                       pallas_platform=platform), **overrides).validate()
