"""One pre-norm decoder layer: h = x + MLA_DSA(norm(x)); y = h + FFN(norm(h)), FFN dense SwiGLU or MoE."""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp

from glm5_jax.config import ModelConfig
from glm5_jax.distributed.batch_local import batch_local
from glm5_jax.model import attention, indexer
from glm5_jax.model.indexer_kl import attend_with_indexer_kl
from glm5_jax.model.layers import normal_init, rms_norm, swiglu
from glm5_jax.model.moe import init_moe, moe_block
from pallas_kernels import indexer_topk


class LayerContext(NamedTuple):
    """Per-sequence inputs every layer shares."""

    cos: jax.Array           # [B, S, R/2] rotary angles of the queries (= keys in training)
    sin: jax.Array
    segment_ids: jax.Array   # [B, S] int32, 0 = padding
    token_mask: jax.Array    # [B, S] bool, real tokens


def init_dense_mlp(config: ModelConfig, key: jax.Array, dtype) -> dict:
    k1, k2, k3 = jax.random.split(key, 3)
    d, f, std = config.hidden_size, config.intermediate_size, config.initializer_range
    return {
        "gate_proj": {"kernel": normal_init(k1, (d, f), std, dtype)},
        "up_proj": {"kernel": normal_init(k2, (d, f), std, dtype)},
        "down_proj": {"kernel": normal_init(k3, (f, d), std, dtype)},
    }


def init_layer(config: ModelConfig, key: jax.Array, dtype, moe: bool) -> dict:
    k_attn, k_ffn = jax.random.split(key)
    d = config.hidden_size
    layer = {
        "input_norm": {"scale": jnp.ones((d,), dtype)},
        "post_attn_norm": {"scale": jnp.ones((d,), dtype)},
        "attn": attention.init_attention(config, k_attn, dtype),
    }
    if moe:
        layer["moe"] = init_moe(config, k_ffn, dtype)
    else:
        layer["mlp"] = init_dense_mlp(config, k_ffn, dtype)
    return layer


def compute_topk(indexer_params: dict, h: jax.Array, q_resid: jax.Array, ctx: LayerContext,
                 config: ModelConfig, mesh=None) -> jax.Array:
    """Run the lightning indexer of one layer; returns int32 [B, S, N] (-1 = unused slot). Scores and top-k
    run on each device's own rows (`batch_local`): GSPMD would gather the global batch for `top_k`."""
    q, weights = indexer.indexer_queries(indexer_params, q_resid, h, ctx.cos, ctx.sin, config)
    k = indexer.indexer_keys(indexer_params, h, ctx.cos, ctx.sin, config)
    if config.attention_backend == "pallas":
        def select(q, k, weights, segment_ids):
            return indexer_topk(q, k, weights, topk=config.index_topk, q_segment_ids=segment_ids,
                                k_segment_ids=segment_ids, **config.pallas_options)[0]
    else:
        def select(q, k, weights, segment_ids):
            return indexer.select_topk(q, k, weights, segment_ids, segment_ids, config.index_topk,
                                       query_chunk=config.index_query_chunk)
    return batch_local(select, mesh, (q, k, weights, ctx.segment_ids))


def decoder_layer(layer: dict, indexer_params: dict | None, x: jax.Array, ctx: LayerContext,
                  prev_topk: jax.Array | None, config: ModelConfig, *, run_indexer: jax.Array | bool = True,
                  expert_choices: jax.Array | None = None, topk_override: jax.Array | None = None,
                  indexer_mode: str | None = None, mesh=None) -> tuple[jax.Array, jax.Array, dict]:
    """Returns (new hidden [B, S, D], the top-k used [B, S, N], aux).

    `run_indexer` False (a traced bool is fine) reuses `prev_topk` (IndexShare "shared" layers);
    `topk_override` replays recorded indexer selections. `indexer_mode` ("dense_warmup" | "sparse") also
    returns the indexer KL terms (see `glm5_jax.model.indexer_kl`)."""
    eps = config.rms_norm_eps
    h = rms_norm(x, layer["input_norm"]["scale"], eps)
    proj = attention.project(layer["attn"], h, ctx.cos, ctx.sin, config)
    if topk_override is not None:
        topk = topk_override.astype(jnp.int32)
    elif run_indexer is True:
        topk = compute_topk(indexer_params, h, proj["q_resid"], ctx, config, mesh)
    else:
        topk = jax.lax.cond(run_indexer, lambda: compute_topk(indexer_params, h, proj["q_resid"], ctx, config, mesh),
                            lambda: prev_topk)
    if indexer_mode is None:
        x = x + attention.attend(layer["attn"], proj, topk, ctx.segment_ids, ctx.segment_ids, config)
        kl_aux = {}
    else:
        attn_out, kl_aux = attend_with_indexer_kl(layer["attn"], indexer_params, h, proj, topk, ctx.segment_ids,
                                                  ctx.token_mask, ctx.cos, ctx.sin, config, indexer_mode)
        x = x + attn_out
    h = rms_norm(x, layer["post_attn_norm"]["scale"], eps)
    if "moe" in layer:
        ffn, aux = moe_block(layer["moe"], h, ctx.token_mask, config, expert_choices, mesh)
    else:
        mlp = layer["mlp"]
        ffn = swiglu(h, mlp["gate_proj"]["kernel"], mlp["up_proj"]["kernel"], mlp["down_proj"]["kernel"])
        aux = {}
    return x + ffn, topk, {**aux, **kl_aux}
