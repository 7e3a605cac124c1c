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
from glm5_jax.model.decoder import DecoderLayer, LayerContext, decoder_layer
from glm5_jax.model.layers import Linear, Scale, rms_norm
from glm5_jax.model.variables import ParamModule


class MTP(ParamModule):
    """The MTP module's weights (GLM-5's `model.layers.78`): input norms, the [2D, D] merge projection, one
    MoE decoder layer with its own indexer, and the norm before the shared LM head."""

    def __init__(self, config: ModelConfig, rngs: nnx.Rngs, dtype):
        d = config.hidden_size
        self.enorm = Scale(d, dtype)
        self.hnorm = Scale(d, dtype)
        # [2D, D]: the concatenated input dim is the larger one and claims `fsdp` first.
        self.eh_proj = Linear((2 * d, d), ("embed", "embed"), rngs, config.initializer_range, dtype)
        self.layer = DecoderLayer(config, rngs, dtype, moe=True, with_indexer=True)
        self.shared_head_norm = Scale(d, dtype)

    def __call__(self, embedding: jax.Array, h0: jax.Array, tokens: jax.Array, ctx: LayerContext,
                 config: ModelConfig, num_steps: int, mesh=None, indexer_mode: str | None = None):
        return mtp_forward(self, embedding, h0, tokens, ctx, config, num_steps, mesh, indexer_mode)

    def step(self, embedding: jax.Array, next_tokens: jax.Array, h_prev: jax.Array, ctx: LayerContext,
             config: ModelConfig, **layer_options):
        """One depth: x = eh_proj([enorm(Emb(next_tokens)) ; hnorm(h_prev)]) through the MTP layer. Returns
        (the raw layer output [B, S, D] that feeds the next depth, its shared_head_norm that the LM head
        reads, the layer's output). `layer_options` go to the decoder layer (a cache when generating)."""
        return mtp_step(self, embedding, next_tokens, h_prev, ctx, config, **layer_options)


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


def mtp_step(mtp, embedding: jax.Array, next_tokens: jax.Array, h_prev: jax.Array, ctx: LayerContext,
             config: ModelConfig, **layer_options):
    """`MTP.step` (the MTP layer's own indexer; no earlier top-k to share)."""
    eps = config.rms_norm_eps
    dtype = h_prev.dtype
    emb = embedding[next_tokens].astype(dtype)
    merged = jnp.concatenate([rms_norm(emb, mtp["enorm"]["scale"], eps),
                              rms_norm(h_prev, mtp["hnorm"]["scale"], eps)], axis=-1)
    x = merged @ mtp["eh_proj"]["kernel"].astype(dtype)
    out = decoder_layer(mtp["layer"], mtp["layer"]["indexer"], x, ctx, None, config, **layer_options)
    return out.hidden, rms_norm(out.hidden, mtp["shared_head_norm"]["scale"], eps), out


def mtp_forward(mtp: dict, embedding: jax.Array, h0: jax.Array, tokens: jax.Array, ctx: LayerContext,
                config: ModelConfig, num_steps: int, mesh=None, indexer_mode: str | None = None
                ) -> tuple[jax.Array, dict]:
    """Returns the normed MTP hidden states [num_steps, B, S, D] and the MTP layer's aux per step.
    The depth loop is a `lax.scan`, so the shared module is compiled once whatever the depth."""
    def depth_step(h_prev, k):
        shifted, valid = shift_within_segment(tokens, ctx.segment_ids, k)
        step_ctx = ctx._replace(token_mask=ctx.token_mask & valid)
        h, normed, out = mtp_step(mtp, embedding, shifted, h_prev, step_ctx, config, indexer_mode=indexer_mode,
                                  mesh=mesh)
        return h, (normed, out.aux)

    if config.remat_policy != "none":
        depth_step = jax.checkpoint(depth_step, policy=REMAT_POLICIES[config.remat_policy])
    _, (outputs, aux) = jax.lax.scan(depth_step, h0, jnp.arange(1, num_steps + 1))
    return outputs, aux
