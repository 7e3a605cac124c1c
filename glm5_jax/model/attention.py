"""Multi-head latent attention (MLA) with DeepSeek Sparse Attention (DSA) selection.

Two mathematically equal forms:
- expanded (training reference, backend `dense`): kv_b_proj expands the latent into per-head k_nope and v,
  scores over every visible key, masked to the indexer's top-k selection;
- absorbed / MQA (backends `sparse`, `pallas`): W_UK is folded into the query (q_lat = q_nope @ W_UK_h), all
  heads attend over the shared 576-wide latent rows [c ; k_rope] of the selected keys only, and W_UV maps the
  512-wide latent output back to each head's value space. Memory and compute grow with the top-k N, not T.
  The attention over the rows is the ops layer's (`glm5_jax.ops.sparse_attention`: jnp or the kernels).
Where the selection is the causal mask itself (T <= index_topk: a top-k keeps every visible key; the dense
warm-up), the TPU kernels attend in the expanded form by flash attention (`glm5_jax.ops.causal_attention`).
Backend `auto` picks `dense` or `sparse` per call from the static shapes (`choose_backend`).
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
from flax import nnx
from jax.ad_checkpoint import checkpoint_name

from glm5_jax.config import ModelConfig
from glm5_jax.distributed.context_local import context_local
from glm5_jax.model.kv_cache import LayerCache, write_rows
from glm5_jax.model.layers import (Linear, Scale, apply_rope_half_split, apply_rope_interleaved, apply_rope_to_tail,
                                    deinterleave_tail)
from glm5_jax.ops.causal_attention import (causal_attention, causal_attention_with_target, flash_attends,
                                           selects_every_key)
from glm5_jax.ops.platform import uses_kernels
from glm5_jax.ops.sparse_attention import (cache_attention, dense_attention_with_target, sparse_attention,
                                          sparse_attention_with_target)
from pallas_kernels.dense_target import head_mean_target, visible_softmax
from pallas_kernels.masks import selected_mask, visible_keys

# Hugging Face uses eps 1e-6 for the two latent norms (q_a_layernorm, kv_a_layernorm).
LATENT_NORM_EPS = 1e-6

# Backend "auto": the masked dense form while T <= 4 N. Gathering N latent rows per query and running
# [H, C+R] x [C+R, N] matmuls per query costs ~4-5x more time per FLOP than the dense form's large matmuls
# (measured on CPU: small config 368 vs 138 ms fwd+bwd at T/N = 4; tiny 39 vs 54 ms at T/N = 16; see
# benchmarks/BENCHMARKS.md), so the dense form wins until it does ~4x the sparse work. The [B, H, S, T]
# probabilities it keeps for the backward pass are capped too, so long sequences always take the gather.
AUTO_DENSE_MAX_KEYS_PER_SELECTED = 4
AUTO_DENSE_MAX_SCORE_BYTES = 1 << 30


class Projection(NamedTuple):
    """One layer's queries and absorbed-form rows (x is the input-normed hidden state [B, S, D])."""

    q_resid: jax.Array   # [B, S, Q] the normed query latent (the indexer reads it too)
    q: jax.Array         # [B, S, H, K'+R] [q_nope ; q_rope] not yet rotated, its rope dims de-interleaved
    cos: jax.Array       # [B, S, R/2] the queries' rotation
    sin: jax.Array
    rows: jax.Array      # [B, S, C+R] the absorbed-form cache rows [c ; k_rope]: 576 values per token for GLM-5


class MLA(nnx.Module):
    """Multi-head latent attention: projections, the expanded and absorbed forms, the attention backends."""

    def __init__(self, config: ModelConfig, rngs: nnx.Rngs, dtype):
        self.config = config  # static: part of the graph definition, not of the state
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
        # [D, H, P], the output first as Hugging Face stores it: the matmul's weight gradient comes out in this
        # layout, where XLA:TPU relaid out an [H, P, D] one in every layer (GLM-5 on v6e-256: 30 GB of HBM traffic
        # per chip and step; benchmarks/BENCHMARKS.md).
        self.o_proj = Linear((d, h, config.v_head_dim), ("embed", "heads", "head_dim"), rngs, std, dtype)

    def project(self, x: jax.Array, cos: jax.Array, sin: jax.Array) -> Projection:
        """Queries and the latent cache rows of one layer (x is the input-normed hidden state [B, S, D])."""
        config = self.config
        # The two down-projections' outputs are named for remat "full_keep_projections" (small: Q + C + R values
        # per token).
        q_resid = self.q_a_norm.rms_norm(checkpoint_name(self.q_a_proj(x), "attention_down_proj"), LATENT_NORM_EPS)
        # The rope columns are de-interleaved on the (FSDP-sharded) weight, so the queries come out of the matmul
        # in the rotation's layout: each form rotates them where it reads them (the expanded form whole, no
        # [B, S, H, R] slice written on its own, which a TPU tile pads from R = 64 to 128 lanes; GLM-5 on v6e-256:
        # benchmarks/BENCHMARKS.md).
        q = jnp.einsum("BSQ,QHK->BSHK", q_resid, deinterleave_tail(self.q_b_proj.weight(x.dtype),
                                                                  config.qk_rope_head_dim))
        ckv = checkpoint_name(self.kv_a_proj(x), "attention_down_proj")
        latent = self.kv_a_norm.rms_norm(ckv[..., : config.kv_lora_rank], LATENT_NORM_EPS)
        k_rope = apply_rope_interleaved(ckv[..., config.kv_lora_rank:], cos, sin)
        return Projection(q_resid, q, cos, sin, jnp.concatenate([latent, k_rope], axis=-1))

    def _split_kv_b(self, dtype) -> tuple[jax.Array, jax.Array]:
        kv_b = self.kv_b_proj.weight(dtype)
        nope = self.config.qk_nope_head_dim
        return kv_b[..., :nope], kv_b[..., nope:]  # W_UK [C, H, K'], W_UV [C, H, P]

    def output_projection(self, heads_out: jax.Array) -> jax.Array:
        """[B, S, H, P] -> [B, S, D]."""
        return jnp.einsum("BSHP,DHP->BSD", heads_out, self.o_proj.weight(heads_out.dtype))

    def expanded_inputs(self, proj: Projection) -> tuple[jax.Array, jax.Array, jax.Array]:
        """The expanded form's per-head queries [B, S, H, K'+R], keys [B, T, H, K'+R] and values [B, T, H, P]:
        the latent expanded through kv_b_proj, the rope key broadcast to every head."""
        w_uk, w_uv = self._split_kv_b(proj.q.dtype)
        latent = proj.rows[..., : self.config.kv_lora_rank]
        k_rope = proj.rows[..., self.config.kv_lora_rank:]
        k_nope = jnp.einsum("BTC,CHK->BTHK", latent, w_uk)
        values = jnp.einsum("BTC,CHP->BTHP", latent, w_uv)
        # One contraction over [nope ; rope] (the rope key broadcast to every head): a single matmul instead of
        # two plus an add of [B, H, S, T] tensors.
        keys = jnp.concatenate(
            [k_nope, jnp.broadcast_to(k_rope[:, :, None, :], (*k_nope.shape[:3], k_rope.shape[-1]))], axis=-1)
        return apply_rope_to_tail(proj.q, proj.cos, proj.sin, self.config.qk_rope_head_dim), keys, values

    def expanded_attention(self, proj: Projection, allowed: jax.Array, return_probs: bool = False):
        """Reference form: expand the latent into per-head keys/values; `allowed` [B, S, T] masks keys.

        Returns per-head outputs [B, S, H, P] (and the probabilities [B, H, S, T] when asked)."""
        return masked_attention(*self.expanded_inputs(proj), allowed, self.config.softmax_scale, return_probs)

    def absorbed_queries(self, proj: Projection) -> jax.Array:
        """Queries in latent space [B, S, H, C + R]: q_nope folded through W_UK, rope part unchanged."""
        nope = self.config.qk_nope_head_dim
        w_uk, _ = self._split_kv_b(proj.q.dtype)
        q_latent = jnp.einsum("BSHK,CHK->BSHC", proj.q[..., :nope], w_uk)
        return jnp.concatenate([q_latent, apply_rope_half_split(proj.q[..., nope:], proj.cos, proj.sin)], axis=-1)

    def latent_to_heads(self, latent_out: jax.Array) -> jax.Array:
        """[B, S, H, C] latent attention output -> per-head values [B, S, H, P] through W_UV."""
        _, w_uv = self._split_kv_b(latent_out.dtype)
        return jnp.einsum("BSHC,CHP->BSHP", latent_out, w_uv)

    def attend(self, proj: Projection, indices: jax.Array, q_segment_ids: jax.Array, k_segment_ids: jax.Array,
               q_offset: int | jax.Array = 0, mesh=None) -> jax.Array:
        """Attention over the selected keys with the configured backend; returns [B, S, D]."""
        config = self.config
        batch, num_queries = proj.q.shape[:2]
        num_keys = proj.rows.shape[1]
        if self.selection_is_causal_mask(num_queries, num_keys, mesh) and isinstance(q_offset, int) \
                and q_offset == 0 and q_segment_ids is k_segment_ids:
            heads = causal_attention(*self.expanded_inputs(proj), q_segment_ids, config=config, mesh=mesh)
        elif choose_backend(config, batch, num_queries, num_keys) == "dense":
            queries, keys, values = self.expanded_inputs(proj)

            def selected_attention(chip_offset, queries, q_segment_ids, indices, keys, values, k_segment_ids):
                allowed = (visible_keys(q_segment_ids, k_segment_ids, q_offset + chip_offset)
                           & selected_mask(indices, keys.shape[1]))
                return masked_attention(queries, keys, values, allowed, config.softmax_scale)

            heads = context_local(selected_attention, mesh, (queries, q_segment_ids, indices),
                                  (keys, values, k_segment_ids))
        else:
            latent_out = sparse_attention(self.absorbed_queries(proj), proj.rows, indices, config=config, mesh=mesh,
                                          q_offset=q_offset if isinstance(q_offset, int) else None)
            heads = self.latent_to_heads(latent_out)
        return self.output_projection(heads)

    def selection_is_causal_mask(self, num_queries: int, num_keys: int, mesh) -> bool:
        """Whether the kernels attend by flash attention over every visible key: the queries' own keys, all
        of them selected (T <= index_topk). Such a layer runs no top-k (`DecoderLayer`)."""
        return flash_attends(self.config, num_queries, num_keys, mesh) and selects_every_key(self.config, num_keys)

    def attend_cached(self, proj: Projection, indices: jax.Array, cache: LayerCache,
                      mesh=None) -> tuple[jax.Array, jax.Array]:
        """Write the new rows into the cache, then attend (absorbed form) over the selected cached rows; the
        dense training reference decodes in the absorbed form too (the two forms are equal). Returns
        ([B, S, D], the new latent cache). The cache may be split over `context` (`ops.cache_attention`)."""
        latent = write_rows(cache.kv.latent, cache.layer, proj.rows, cache.positions, mesh)
        latent_out = cache_attention(self.absorbed_queries(proj), latent[cache.layer], indices, config=self.config,
                                     mesh=mesh)
        return self.output_projection(self.latent_to_heads(latent_out)), latent

    def attend_dense_with_target(self, proj: Projection, visible: jax.Array, segment_ids: jax.Array,
                                 mesh=None) -> tuple[jax.Array, jax.Array]:
        """Dense attention over every `visible` key [B, S, T] and the head-mean probability target [B, S, T]:
        the expanded form returns its probabilities with its output; the kernels' flash attention where it runs
        (`causal_attention_with_target`), else theirs in the absorbed form."""
        if not uses_kernels(self.config):
            def with_target(_, queries, visible, keys, values):
                heads, probs = masked_attention(queries, keys, values, visible, self.config.softmax_scale,
                                                return_probs=True)
                return heads, head_mean_target(probs)

            queries, keys, values = self.expanded_inputs(proj)
            heads, target = context_local(with_target, mesh, (queries, visible), (keys, values))
            return self.output_projection(heads), target
        if flash_attends(self.config, visible.shape[1], visible.shape[2], mesh):
            heads, target = causal_attention_with_target(*self.expanded_inputs(proj), segment_ids,
                                                         lambda: (self.absorbed_queries(proj), proj.rows),
                                                         config=self.config, mesh=mesh)
            return self.output_projection(heads), target
        latent, target = dense_attention_with_target(self.absorbed_queries(proj), proj.rows, visible, segment_ids,
                                                     config=self.config, mesh=mesh)
        return self.output_projection(self.latent_to_heads(latent)), target

    def attend_sparse_with_target(self, proj: Projection, indices: jax.Array, segment_ids: jax.Array,
                                  mesh=None) -> tuple[jax.Array, jax.Array]:
        """Attention over the selected keys [B, S, D] and the head-mean probability target there [B, S, N]
        (0 on unused slots). `indices` select among the queries' own tokens, `segment_ids` [B, S]. (Where they would
        be every visible key, the layer attends by `attend_dense_with_target` instead: `DecoderLayer`.)"""
        latent, target = sparse_attention_with_target(self.absorbed_queries(proj), proj.rows, indices,
                                                      config=self.config, mesh=mesh)
        return self.output_projection(self.latent_to_heads(latent)), target


def masked_attention(queries: jax.Array, keys: jax.Array, values: jax.Array, allowed: jax.Array, scale: float,
                     return_probs: bool = False):
    """Per-head softmax attention of queries [B, S, H, K] over keys [B, T, H, K] / values [B, T, H, P] where
    `allowed` [B, S, T]; fp32 softmax. Returns [B, S, H, P] (and the fp32 probabilities [B, H, S, T] when asked:
    the dense warm-up's KL target, which bf16-rounded probabilities bias: the tiny model's warm-up KL came out 6%
    low in bf16 against fp32, where the kernels' fp32 target stays within 0.02%)."""
    logits = jnp.einsum("BSHK,BTHK->BHST", queries, keys).astype(jnp.float32)
    probs = visible_softmax(logits * scale, allowed[:, None])
    out = jnp.einsum("BHST,BTHP->BSHP", probs.astype(queries.dtype), values)
    return (out, probs) if return_probs else out


def choose_backend(config: ModelConfig, batch: int, num_queries: int, num_keys: int) -> str:
    """The backend a call runs: the configured one, or for "auto" "dense" / "sparse" from static shapes."""
    if config.attention_backend != "auto":
        return config.attention_backend
    score_bytes = 4 * batch * config.num_attention_heads * num_queries * num_keys
    few_keys = num_keys <= AUTO_DENSE_MAX_KEYS_PER_SELECTED * config.index_topk
    return "dense" if few_keys and score_bytes <= AUTO_DENSE_MAX_SCORE_BYTES else "sparse"
