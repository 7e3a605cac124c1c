"""Multi-head latent attention (MLA) with DeepSeek Sparse Attention (DSA) selection.

Two mathematically equal forms:
- expanded (training reference, backend `dense`): kv_b_proj expands the latent into per-head k_nope and v,
  scores over every visible key, masked to the indexer's top-k selection;
- absorbed / MQA (backends `sparse`, `pallas`): W_UK is folded into the query (q_lat = q_nope @ W_UK_h), all
  heads attend over the shared 576-wide latent rows [c ; k_rope] of the selected keys only, and W_UV maps the
  512-wide latent output back to each head's value space. Memory and compute grow with the top-k N, not T.
Backend `auto` picks `dense` or `sparse` per call from the static shapes (`choose_backend`).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from glm5_jax.config import ModelConfig
from glm5_jax.model.layers import Linear, Scale, apply_rope_interleaved, rms_norm
from glm5_jax.model.variables import ParamModule
from glm5_jax.model.masks import selected_mask, visible_keys
from glm5_jax.model.sparse_latent import sparse_latent_attention
from pallas_kernels import NEG_INF, sparse_mla_attention

# Hugging Face uses eps 1e-6 for the two latent norms (q_a_layernorm, kv_a_layernorm).
LATENT_NORM_EPS = 1e-6

# Backend "auto": the masked dense form while T <= 4 N. Gathering N latent rows per query and running
# [H, C+R] x [C+R, N] matmuls per query costs ~4-5x more time per FLOP than the dense form's large matmuls
# (measured on CPU: small config 368 vs 138 ms fwd+bwd at T/N = 4; tiny 39 vs 54 ms at T/N = 16; see
# benchmarks/BENCHMARKS.md), so the dense form wins until it does ~4x the sparse work. The [B, H, S, T]
# probabilities it keeps for the backward pass are capped too, so long sequences always take the gather.
AUTO_DENSE_MAX_KEYS_PER_SELECTED = 4
AUTO_DENSE_MAX_SCORE_BYTES = 1 << 30


class MLA(ParamModule):
    """Multi-head latent attention's weights; `project` and `attend` below are its computation."""

    def __init__(self, config: ModelConfig, rngs: nnx.Rngs, dtype):
        std = config.initializer_range
        d, q, c, r, h = (config.hidden_size, config.q_lora_rank, config.kv_lora_rank, config.qk_rope_head_dim,
                         config.num_attention_heads)
        self.q_a_proj = Linear((d, q), ("embed", "q_lora"), rngs, std, dtype)
        self.q_a_norm = Scale(q, dtype)
        self.q_b_proj = Linear((q, h, config.qk_head_dim), ("q_lora", "heads", "head_dim"), rngs, std, dtype)
        self.kv_a_proj = Linear((d, c + r), ("embed", "kv_lora"), rngs, std, dtype)
        self.kv_a_norm = Scale(c, dtype)
        # The last dim is [W_UK (nope) ; W_UV (values)]: Muon Split orthogonalises the two parts separately.
        self.kv_b_proj = Linear((c, h, config.qk_nope_head_dim + config.v_head_dim), ("kv_lora", "heads", "head_dim"),
                                rngs, std, dtype)
        self.o_proj = Linear((h, config.v_head_dim, d), ("heads", "head_dim", "embed"), rngs, std, dtype)


def project(params: dict, x: jax.Array, cos: jax.Array, sin: jax.Array, config: ModelConfig) -> dict:
    """Queries and the latent cache rows of one layer (x is the input-normed hidden state [B, S, D])."""
    dtype = x.dtype
    q_resid = rms_norm(x @ params["q_a_proj"]["kernel"].astype(dtype), params["q_a_norm"]["scale"], LATENT_NORM_EPS)
    q = jnp.einsum("BSQ,QHK->BSHK", q_resid, params["q_b_proj"]["kernel"].astype(dtype))
    q_nope, q_rope = q[..., : config.qk_nope_head_dim], q[..., config.qk_nope_head_dim:]
    ckv = x @ params["kv_a_proj"]["kernel"].astype(dtype)
    latent = rms_norm(ckv[..., : config.kv_lora_rank], params["kv_a_norm"]["scale"], LATENT_NORM_EPS)
    k_rope = apply_rope_interleaved(ckv[..., config.kv_lora_rank:], cos, sin)
    return {
        "q_resid": q_resid,
        "q_nope": q_nope,
        "q_rope": apply_rope_interleaved(q_rope, cos, sin),
        # The absorbed-form cache row: 576 values per token and layer for GLM-5.
        "cache": jnp.concatenate([latent, k_rope], axis=-1),
    }


def _split_kv_b(params: dict, config: ModelConfig, dtype) -> tuple[jax.Array, jax.Array]:
    kv_b = params["kv_b_proj"]["kernel"].astype(dtype)
    return kv_b[..., : config.qk_nope_head_dim], kv_b[..., config.qk_nope_head_dim:]  # W_UK [C,H,K'], W_UV [C,H,P]


def output_projection(params: dict, heads_out: jax.Array) -> jax.Array:
    """[B, S, H, P] -> [B, S, D]."""
    return jnp.einsum("BSHP,HPD->BSD", heads_out, params["o_proj"]["kernel"].astype(heads_out.dtype))


def expanded_attention(params: dict, proj: dict, allowed: jax.Array, config: ModelConfig,
                       return_probs: bool = False):
    """Reference form: expand the latent into per-head keys/values; `allowed` [B, S, T] masks keys.

    Returns per-head outputs [B, S, H, P] (and the probabilities [B, H, S, T] when asked)."""
    dtype = proj["q_nope"].dtype
    w_uk, w_uv = _split_kv_b(params, config, dtype)
    latent = proj["cache"][..., : config.kv_lora_rank]
    k_rope = proj["cache"][..., config.kv_lora_rank:]
    k_nope = jnp.einsum("BTC,CHK->BTHK", latent, w_uk)
    values = jnp.einsum("BTC,CHP->BTHP", latent, w_uv)
    # One contraction over [nope ; rope] (the rope key broadcast to every head): a single matmul instead of
    # two plus an add of [B, H, S, T] tensors.
    queries = jnp.concatenate([proj["q_nope"], proj["q_rope"]], axis=-1)
    keys = jnp.concatenate([k_nope, jnp.broadcast_to(k_rope[:, :, None, :], (*k_nope.shape[:3], k_rope.shape[-1]))],
                           axis=-1)
    logits = jnp.einsum("BSHK,BTHK->BHST", queries, keys).astype(jnp.float32)
    logits = jnp.where(allowed[:, None], logits * config.softmax_scale, NEG_INF)
    probs = jax.nn.softmax(logits, axis=-1)
    # A query with no allowed key (e.g. a padding row) outputs zeros, not a uniform average.
    probs = jnp.where(allowed[:, None].any(-1, keepdims=True), probs, 0.0).astype(dtype)
    out = jnp.einsum("BHST,BTHP->BSHP", probs, values)
    return (out, probs) if return_probs else out


def absorbed_queries(params: dict, proj: dict, config: ModelConfig) -> jax.Array:
    """Queries in latent space [B, S, H, C + R]: q_nope folded through W_UK, rope part unchanged."""
    w_uk, _ = _split_kv_b(params, config, proj["q_nope"].dtype)
    q_latent = jnp.einsum("BSHK,CHK->BSHC", proj["q_nope"], w_uk)
    return jnp.concatenate([q_latent, proj["q_rope"]], axis=-1)


def latent_to_heads(params: dict, latent_out: jax.Array, config: ModelConfig) -> jax.Array:
    """[B, S, H, C] latent attention output -> per-head values [B, S, H, P] through W_UV."""
    _, w_uv = _split_kv_b(params, config, latent_out.dtype)
    return jnp.einsum("BSHC,CHP->BSHP", latent_out, w_uv)


def choose_backend(config: ModelConfig, batch: int, num_queries: int, num_keys: int) -> str:
    """The backend a call runs: the configured one, or for "auto" "dense" / "sparse" from static shapes."""
    if config.attention_backend != "auto":
        return config.attention_backend
    score_bytes = 4 * batch * config.num_attention_heads * num_queries * num_keys
    few_keys = num_keys <= AUTO_DENSE_MAX_KEYS_PER_SELECTED * config.index_topk
    return "dense" if few_keys and score_bytes <= AUTO_DENSE_MAX_SCORE_BYTES else "sparse"


def attend(params: dict, proj: dict, indices: jax.Array, q_segment_ids: jax.Array, k_segment_ids: jax.Array,
           config: ModelConfig, q_offset: int | jax.Array = 0) -> jax.Array:
    """Attention over the selected keys with the configured backend; returns [B, S, D]."""
    batch, num_queries = proj["q_nope"].shape[:2]
    num_keys = proj["cache"].shape[1]
    backend = choose_backend(config, batch, num_queries, num_keys)
    if backend == "dense":
        allowed = visible_keys(q_segment_ids, k_segment_ids, q_offset) & selected_mask(indices, num_keys)
        heads = expanded_attention(params, proj, allowed, config)
    else:
        q = absorbed_queries(params, proj, config)
        if backend == "sparse":
            latent_out = sparse_latent_attention(q, proj["cache"], indices, config.softmax_scale,
                                                 config.kv_lora_rank, config.index_query_chunk)[0]
        else:
            latent_out, _ = sparse_mla_attention(q, proj["cache"], indices, scale=config.softmax_scale,
                                                 kv_lora_rank=config.kv_lora_rank, **config.pallas_options)
        heads = latent_to_heads(params, latent_out, config)
    return output_projection(params, heads)
