"""One pre-norm decoder layer: h = x + MLA_DSA(norm(x)); y = h + FFN(norm(h)), FFN dense SwiGLU or MoE. It serves
training (the whole sequence), prefill and decode (new tokens against a cache) alike."""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
from flax import nnx
from jax.ad_checkpoint import checkpoint_name

from glm5_jax.config import ModelConfig
from glm5_jax.model.attention import MLA
from glm5_jax.model.context import LayerContext
from glm5_jax.model.indexer import Indexer
from glm5_jax.model.indexer_kl import attend_with_indexer_kl, scores_at
from glm5_jax.model.kv_cache import KVCache, LayerCache
from glm5_jax.model.layers import Scale, SwiGLU
from glm5_jax.model.moe import MoE
from glm5_jax.ops.causal_attention import causal_selection


class LayerOutput(NamedTuple):
    hidden: jax.Array            # [B, S, D]
    topk: jax.Array              # [B, S, N] the key selection used
    aux: dict                    # expert counts / balance terms / expert ids (MoE), indexer KL terms
    cache: LayerCache | None     # with the new tokens' rows written (when run against a cache)


class DecoderLayer(nnx.Module):
    """One decoder layer: norms, MLA, and a dense SwiGLU (`moe=False`) or the MoE. The MTP layer also owns its
    indexer (`with_indexer=True`); the main stacks share a separate stack of indexers, passed in per call."""

    def __init__(self, config: ModelConfig, rngs: nnx.Rngs, dtype, *, moe: bool, with_indexer: bool = False):
        self.config = config  # static: part of the graph definition, not of the state
        d, std = config.hidden_size, config.initializer_range
        self.input_norm = Scale(d, dtype)
        self.post_attn_norm = Scale(d, dtype)
        self.attn = MLA(config, rngs, dtype)
        if moe:
            self.moe = MoE(config, rngs, dtype)
        else:
            self.mlp = SwiGLU(d, config.intermediate_size, rngs, std, dtype)
        if with_indexer:
            self.indexer = Indexer(config, rngs, dtype)

    def __call__(self, x: jax.Array, ctx: LayerContext, *, indexer: Indexer | None = None,
                 prev_topk: jax.Array | None = None, run_indexer: jax.Array | bool = True,
                 expert_choices: jax.Array | None = None, topk_override: jax.Array | None = None,
                 indexer_mode: str | None = None, mesh=None, cache: LayerCache | None = None) -> LayerOutput:
        """One pre-norm decoder layer: h = x + MLA_DSA(norm(x)); y = h + FFN(norm(h)). The same layer serves
        training (the whole sequence), prefill and decode (new tokens against `cache`).

        `indexer`: the one this layer's top-k comes from (default: its own). `run_indexer` False (a traced
        bool is fine) reuses `prev_topk` (IndexShare "shared" layers); `topk_override` replays recorded
        indexer selections. `indexer_mode` ("dense_warmup" | "sparse") also returns the indexer KL terms (see
        `glm5_jax.model.indexer_kl`). With `cache`, the new tokens' latent rows (and indexer keys) are written
        first, the indexer ranks every cached key up to each query's position and attention reads the selected
        cached rows."""
        indexer = self.indexer if indexer is None else indexer
        eps = self.config.rms_norm_eps
        h = self.input_norm.rms_norm(x, eps)
        proj = self.attn.project(h, ctx.cos, ctx.sin)
        kl_aux = {}
        if cache is not None:
            if topk_override is not None or indexer_mode is not None:
                raise ValueError("DecoderLayer: a cache serves generation only; topk_override and indexer_mode "
                                 "(routing replay, DSA training) need the whole sequence (cache=None)")

            def own_topk(index_keys):
                return indexer.topk_over_cache(h, proj.q_resid, ctx,
                                               cache._replace(kv=cache.kv._replace(index_keys=index_keys)), mesh)

            if run_indexer is True:
                topk, index_keys = own_topk(cache.kv.index_keys)
            else:
                topk, index_keys = jax.lax.cond(run_indexer, own_topk, lambda keys: (prev_topk, keys),
                                                cache.kv.index_keys)
            attn_out, latent = self.attn.attend_cached(proj, topk, cache, mesh)
            cache = cache._replace(kv=KVCache(latent, index_keys))
        else:
            # The sparse KL reads the index scores at the selection: the top-k's own, or gathered where this
            # layer's indexer did not make the selection (a shared layer's source scored other inputs).
            keep_scores = indexer_mode == "sparse"

            def own_topk():
                topk, scores = indexer.topk(h, proj.q_resid, ctx, mesh)
                return topk, scores if keep_scores else None

            def shared_topk():
                return prev_topk, scores_at(indexer, h, proj, prev_topk, ctx, mesh) if keep_scores else None

            # T <= index_topk with the kernels' flash attention: the top-k would keep every visible key, so none
            # runs and nothing of it is saved for the backward (the sparse KL then runs over every visible key).
            every_key = topk_override is None and self.attn.selection_is_causal_mask(x.shape[1], x.shape[1], mesh)
            if every_key:
                topk, scores = causal_selection(ctx.segment_ids, min(self.config.index_topk, x.shape[1])), None
            elif topk_override is not None:
                topk, scores = topk_override.astype(jnp.int32), None
            elif run_indexer is True:
                topk, scores = own_topk()
            else:
                topk, scores = jax.lax.cond(run_indexer, own_topk, shared_topk)
            if not every_key:
                topk = checkpoint_name(topk, "dsa_topk")  # remat policies keep it (config.ALWAYS_SAVED)
            if scores is not None:
                scores = checkpoint_name(scores, "dsa_topk_scores")  # so is this, or the recompute reruns top-k
            if indexer_mode is None:
                attn_out = self.attn.attend(proj, topk, ctx.segment_ids, ctx.segment_ids, mesh=mesh)
            else:
                attn_out, kl_aux = attend_with_indexer_kl(self.attn, indexer, h, proj, topk, ctx, indexer_mode, mesh,
                                                          scores, every_key=every_key)
        x = x + attn_out
        h = self.post_attn_norm.rms_norm(x, eps)
        if hasattr(self, "moe"):
            ffn, aux = self.moe(h, ctx.token_mask, expert_choices, mesh)
        else:
            ffn, aux = self.mlp(h), {}
        return LayerOutput(x + ffn, topk, {**aux, **kl_aux}, cache)
