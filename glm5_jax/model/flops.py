"""Analytic model FLOPs per token (matrix multiplies only, 2 FLOPs per multiply-add), for MFU.

Forward, per token of a length-S sequence (causal; keys attended per query averaged over positions):
  MLA projections   2 * [D*Q + Q*H*K + D*(C+R) + C*H*(nope+P) + H*P*D]
  attention core    2 * H * n_keys * (K + P)          n_keys = mean_s min(index_topk, s+1)  (DSA selection)
  indexer           2 * [Q*I*J + D*J + D*I] + 2 * I * J * n_causal   n_causal = (S+1)/2 (it scores every
                    causal key) + I * n_causal (the weighted head sum)
  dense FFN         2 * 3 * D * F                      (first_k_dense_replace layers)
  MoE               2 * D * E (router) + 2 * 3 * D * F_e * (A + n_shared)
  LM head           2 * D * V
  MTP (per depth)   2 * 2D * D (eh_proj) + one MoE layer + LM head
Training = 3 x forward (backward costs two forwards).
"""

from __future__ import annotations

from glm5_jax.config import ModelConfig


def _mean_keys(seq_len: int, topk: int | None) -> float:
    if topk is None:
        return (seq_len + 1) / 2
    return sum(min(topk, s + 1) for s in range(seq_len)) / seq_len


def attention_flops_per_token(config: ModelConfig, seq_len: int, sparse: bool = True) -> float:
    d, q, c, r, h = (config.hidden_size, config.q_lora_rank, config.kv_lora_rank, config.qk_rope_head_dim,
                     config.num_attention_heads)
    k, p, nope = config.qk_head_dim, config.v_head_dim, config.qk_nope_head_dim
    projections = 2 * (d * q + q * h * k + d * (c + r) + c * h * (nope + p) + h * p * d)
    n_keys = _mean_keys(seq_len, config.index_topk if sparse else None)
    core = 2 * h * n_keys * (k + p)
    i, j = config.index_n_heads, config.index_head_dim
    n_causal = _mean_keys(seq_len, None)
    indexer = 2 * (q * i * j + d * j + d * i) + 2 * i * j * n_causal + i * n_causal
    return projections + core + indexer


def moe_flops_per_token(config: ModelConfig) -> float:
    """Router, the A routed experts and the shared experts of one MoE block, forward."""
    d = config.hidden_size
    return 2 * d * config.n_routed_experts + 6 * d * config.moe_intermediate_size * (
        config.num_experts_per_tok + config.n_shared_experts)


def layer_flops_per_token(config: ModelConfig, seq_len: int, moe: bool) -> float:
    ffn = moe_flops_per_token(config) if moe else 6 * config.hidden_size * config.intermediate_size
    return attention_flops_per_token(config, seq_len) + ffn


def forward_flops_per_token(config: ModelConfig, seq_len: int, mtp_steps: int | None = None) -> float:
    d = config.hidden_size
    total = (config.num_dense_layers * layer_flops_per_token(config, seq_len, False)
             + config.num_moe_layers * layer_flops_per_token(config, seq_len, True)
             + 2 * d * config.vocab_size)
    steps = (config.mtp_num_steps if config.num_nextn_predict_layers else 0) if mtp_steps is None else mtp_steps
    total += steps * (4 * d * d + layer_flops_per_token(config, seq_len, True) + 2 * d * config.vocab_size)
    return total


def training_flops_per_token(config: ModelConfig, seq_len: int, mtp_steps: int | None = None) -> float:
    return 3 * forward_flops_per_token(config, seq_len, mtp_steps)
