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

from glm5_jax.config import REMAT_POLICIES, ModelConfig
from glm5_jax.model.decoder import LayerContext, decoder_layer, init_layer
from glm5_jax.model.indexer import init_indexer
from glm5_jax.model.layers import normal_init, rms_norm


def init_mtp(config: ModelConfig, key: jax.Array, dtype) -> dict:
    k_proj, k_layer, k_index = jax.random.split(key, 3)
    d = config.hidden_size
    layer = init_layer(config, k_layer, dtype, moe=True)
    layer["indexer"] = init_indexer(config, k_index, dtype)
    return {
        "enorm": {"scale": jnp.ones((d,), dtype)},
        "hnorm": {"scale": jnp.ones((d,), dtype)},
        "eh_proj": {"kernel": normal_init(k_proj, (2 * d, d), config.initializer_range, dtype)},
        "layer": layer,
        "shared_head_norm": {"scale": jnp.ones((d,), dtype)},
    }


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


def mtp_forward(mtp: dict, embedding: jax.Array, h0: jax.Array, tokens: jax.Array, ctx: LayerContext,
                config: ModelConfig, num_steps: int, mesh=None, indexer_mode: str | None = None
                ) -> tuple[jax.Array, dict]:
    """Returns the normed MTP hidden states [num_steps, B, S, D] and the MTP layer's aux per step.
    The depth loop is a `lax.scan`, so the shared module is compiled once whatever the depth."""
    eps = config.rms_norm_eps
    dtype = h0.dtype
    layer = {k: v for k, v in mtp["layer"].items() if k != "indexer"}

    def depth_step(h_prev, k):
        shifted, valid = shift_within_segment(tokens, ctx.segment_ids, k)
        emb = embedding[shifted].astype(dtype)
        merged = jnp.concatenate([rms_norm(emb, mtp["enorm"]["scale"], eps),
                                  rms_norm(h_prev, mtp["hnorm"]["scale"], eps)], axis=-1)
        x = merged @ mtp["eh_proj"]["kernel"].astype(dtype)
        step_ctx = ctx._replace(token_mask=ctx.token_mask & valid)
        h, _, aux = decoder_layer(layer, mtp["layer"]["indexer"], x, step_ctx, None, config,
                                  indexer_mode=indexer_mode, mesh=mesh)
        return h, (rms_norm(h, mtp["shared_head_norm"]["scale"], eps), aux)

    if config.remat_policy != "none":
        depth_step = jax.checkpoint(depth_step, policy=REMAT_POLICIES[config.remat_policy])
    _, (outputs, aux) = jax.lax.scan(depth_step, h0, jnp.arange(1, num_steps + 1))
    return outputs, aux
