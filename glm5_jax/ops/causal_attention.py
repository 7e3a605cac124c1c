"""Attention of every head over every visible key (causal within packed segments), in MLA's expanded form, where
DSA's selection is the causal mask itself: a layer whose top-k keeps every key (T <= index_topk) and the dense
warm-up's attention. With the kernels it runs flash attention (`pallas_kernels.flash_attention`: the project's
Mosaic kernels on TPU, jax's Triton ones on GPU) on each device's own rows, instead of the sparse MLA kernel
gathering every visible latent row per query.

Only with the kernels (`attention_backend: pallas`, or their interpret modes on CPU), on whole sequences (no
`context` split) attending to themselves; elsewhere the layers keep their own paths (the jnp backends already
choose the dense form for short sequences, `model.attention.choose_backend`).
"""

from __future__ import annotations

from collections.abc import Callable

import jax
import jax.numpy as jnp

from glm5_jax.config import ModelConfig
from glm5_jax.distributed.batch_local import context_split
from glm5_jax.distributed.context_local import context_local
from glm5_jax.ops.platform import uses_kernels, uses_tpu_kernels
from pallas_kernels import causal_flash_attention, dense_attention_target
from pallas_kernels.flash_attention import causal_flash_attention_with_target


def flash_attends(config: ModelConfig, num_queries: int, num_keys: int, mesh=None) -> bool:
    """Whether queries attending to their own sequence's keys run the flash kernel (see the module doc; config
    `flash_every_key: false` turns it off)."""
    return (config.flash_every_key and uses_kernels(config) and num_queries == num_keys
            and context_split(mesh) == 1)


def selects_every_key(config: ModelConfig, num_keys: int) -> bool:
    """A top-k over at most index_topk keys keeps every visible one: the selection is the causal mask."""
    return num_keys <= config.index_topk


def causal_selection(segment_ids: jax.Array, num_slots: int) -> jax.Array:
    """The selection a top-k keeping every visible key makes, without scoring any: int32 [B, S, num_slots], slot j
    of query s holding its segment's j-th token while that is at or before s, else -1 (unused). The same set as
    the top-k's, valid slots first as in it, in key order instead of score order (every consumer reads it as a
    set). O(S): a segment starts where the id changes, and segments of a packed row are contiguous."""
    positions = jnp.arange(segment_ids.shape[1])
    starts_here = jnp.concatenate([jnp.ones_like(segment_ids[:, :1], bool),
                                   segment_ids[:, 1:] != segment_ids[:, :-1]], axis=1)
    segment_start = jax.lax.cummax(jnp.where(starts_here, positions, 0), axis=1)  # [B, S]
    keys = segment_start[:, :, None] + jnp.arange(num_slots)  # [B, S, N]
    return jnp.where(keys <= positions[:, None], keys, -1).astype(jnp.int32)


def causal_attention(queries: jax.Array, keys: jax.Array, values: jax.Array, segment_ids: jax.Array, *,
                     config: ModelConfig, mesh=None) -> jax.Array:
    """Per-head outputs [B, S, H, P] of queries [B, S, H, K] over keys [B, S, H, K] / values [B, S, H, P] of the
    same tokens, each query seeing the keys at or before it with its segment id; the flash kernel on each
    device's rows (`flash_attends` must hold)."""
    def flash(_, queries, segment_ids, keys, values):
        return causal_flash_attention(queries, keys, values, segment_ids, scale=config.softmax_scale,
                                      **config.pallas_options)

    return context_local(flash, mesh, (queries, segment_ids), (keys, values), local_rows=True)


def causal_attention_with_target(queries: jax.Array, keys: jax.Array, values: jax.Array, segment_ids: jax.Array,
                                 latent_inputs: Callable[[], tuple[jax.Array, jax.Array]], *, config: ModelConfig,
                                 mesh=None) -> tuple[jax.Array, jax.Array]:
    """(`causal_attention`'s per-head outputs, the indexer KL's target over every visible key [B, S, T] fp32, a
    constant). The Mosaic kernels take the target from the flash forward's own log-sum-exp and operands
    (`causal_flash_attention_with_target`); the Triton ones from the latent-row target kernel over
    `latent_inputs()`: (absorbed queries [B, S, H, C+R], latent rows [B, S, C+R]), built only for it."""
    constant = jax.lax.stop_gradient
    if uses_tpu_kernels(config):
        def flash_with_target(_, queries, segment_ids, keys, values):
            return causal_flash_attention_with_target(queries, keys, values, segment_ids,
                                                      scale=config.softmax_scale, **config.pallas_options)

        return context_local(flash_with_target, mesh, (queries, segment_ids), (keys, values), local_rows=True)

    def kernels(_, queries, absorbed, q_segments, keys, values, rows, k_segments):
        heads = causal_flash_attention(queries, keys, values, q_segments, scale=config.softmax_scale,
                                       **config.pallas_options)
        target = dense_attention_target(constant(absorbed), constant(rows), scale=config.softmax_scale,
                                        q_segment_ids=q_segments, k_segment_ids=k_segments,
                                        **config.pallas_options)
        return heads, target

    absorbed, rows = latent_inputs()
    return context_local(kernels, mesh, (queries, absorbed, segment_ids), (keys, values, rows, segment_ids),
                         local_rows=True)
