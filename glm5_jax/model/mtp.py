"""Multi-token prediction: one module (GLM-5's `model.layers.78`) applied D times with shared parameters.

Depth k = 1..D: h_k = Layer(eh_proj([enorm(Emb(t_{i+k})) ; hnorm(h_{k-1})])) and logits_k =
lm_head(shared_head_norm(h_k)) predict t_{i+k+1}. h_0 is the main model's final (normed) hidden state, as
the public inference engines feed it to the released MTP weights; h_k for k >= 1 is the raw layer output.
The shifted token of a position whose t_{i+k} lies outside its packed segment is replaced by 0 and that
position is marked invalid; causal attention keeps it from influencing any valid position.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from glm5_jax.config import REMAT_POLICIES, ModelConfig
from glm5_jax.distributed.context_order import to_balanced
from glm5_jax.model.context import LayerContext
from glm5_jax.model.decoder import DecoderLayer, LayerOutput
from glm5_jax.model.kv_cache import LayerCache
from glm5_jax.model.layers import Embed, Linear, Scale


class MTP(nnx.Module):
    """The MTP module (GLM-5's `model.layers.78`): input norms, the [2D, D] merge projection, one MoE decoder
    layer with its own indexer, and the norm before the shared LM head."""

    def __init__(self, config: ModelConfig, rngs: nnx.Rngs, dtype):
        self.config = config  # static: part of the graph definition, not of the state
        d = config.hidden_size
        self.enorm = Scale(d, dtype)
        self.hnorm = Scale(d, dtype)
        # [2D, D]: the concatenated input dim is the larger one and claims `fsdp` first.
        self.eh_proj = Linear((2 * d, d), ("embed", "embed"), rngs, config.initializer_range, dtype)
        self.layer = DecoderLayer(config, rngs, dtype, moe=True, with_indexer=True)
        self.shared_head_norm = Scale(d, dtype)

    def __call__(self, embed: Embed, h0: jax.Array, tokens: jax.Array, segment_ids: jax.Array, ctx: LayerContext,
                 num_steps: int, mesh=None, indexer_mode: str | None = None,
                 balanced: bool = False) -> tuple[jax.Array, dict]:
        """Returns the normed MTP hidden states [num_steps, B, S, D] and the MTP layer's aux per step (`embed`:
        the main model's embedding). The depth loop is a `lax.scan`, so the shared module is compiled once
        whatever the depth. `tokens` and `segment_ids` are in the natural order; h0 and ctx in the layers' order,
        the load-balanced one under a context split (`balanced`), where the shifted tokens move to it."""
        config = self.config

        def depth_step(h_prev, k):
            shifted, valid = shift_within_segment(tokens, segment_ids, k)
            if balanced:
                shifted, valid = to_balanced(shifted, mesh), to_balanced(valid, mesh)
            step_ctx = ctx._replace(token_mask=ctx.token_mask & valid)
            h, normed, out = self.step(embed, shifted, h_prev, step_ctx, indexer_mode=indexer_mode, mesh=mesh)
            return h, (normed, out.aux)

        if config.remat_policy != "none":
            depth_step = jax.checkpoint(depth_step, policy=REMAT_POLICIES[config.remat_policy])
        _, (outputs, aux) = jax.lax.scan(depth_step, h0, jnp.arange(1, num_steps + 1))
        return outputs, aux

    def step(self, embed: Embed, next_tokens: jax.Array, h_prev: jax.Array, ctx: LayerContext, *,
             indexer_mode: str | None = None, mesh=None,
             cache: LayerCache | None = None) -> tuple[jax.Array, jax.Array, LayerOutput]:
        """One depth: x = eh_proj([enorm(Emb(next_tokens)) ; hnorm(h_prev)]) through the MTP layer (with its own
        indexer; no earlier top-k to share). Returns (the raw layer output [B, S, D] that feeds the next depth,
        its shared_head_norm that the LM head reads, the layer's output). `cache` when generating."""
        eps = self.config.rms_norm_eps
        emb = embed(next_tokens, h_prev.dtype, mesh)
        merged = jnp.concatenate([self.enorm.rms_norm(emb, eps), self.hnorm.rms_norm(h_prev, eps)], axis=-1)
        out = self.layer(self.eh_proj(merged), ctx, indexer_mode=indexer_mode, mesh=mesh, cache=cache)
        return out.hidden, self.shared_head_norm.rms_norm(out.hidden, eps), out


def shift_within_segment(tokens: jax.Array, segment_ids: jax.Array, k) -> tuple[jax.Array, jax.Array]:
    """(t_{i+k} or 0, valid) for every position i; valid means i+k exists and shares i's segment.
    `k` may be a traced integer (the MTP depth loop is a scan)."""
    b, s = tokens.shape
    padded_tokens = jnp.pad(tokens, ((0, 0), (0, s)))
    padded_seg = jnp.pad(segment_ids, ((0, 0), (0, s)), constant_values=-1)
    shifted = jax.lax.dynamic_slice_in_dim(padded_tokens, k, s, axis=1)
    shifted_seg = jax.lax.dynamic_slice_in_dim(padded_seg, k, s, axis=1)
    valid = (shifted_seg == segment_ids) & (segment_ids > 0)
    return jnp.where(valid, shifted, 0), valid
