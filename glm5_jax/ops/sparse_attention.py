"""DSA's absorbed-form attention over selected latent rows, choosing the jnp path or the Pallas kernels in one
place, with the indexer KL's targets (head-mean attention probabilities) for DSA training.

Every head of a query attends over the same selected rows [c ; k_rope] (width C + R) of `rows` [B, T, C+R];
q [B, S, H, C+R] are the absorbed queries, indices [B, S, N] (-1 = unused slot). The jnp path is
`pallas_kernels.sparse_latent.sparse_latent_attention` (its forward also yields the sparse target); the
kernels are `pallas_kernels.sparse_mla_attention` (with the sparse target: `sparse_mla_attention_with_target`,
which on TPU computes it in the attention's own forward) and the dense target kernel. Both run under
`context_local`: each chip's queries over the rows all-gathered over `context` (indices are global), the kernels
always on each device's own rows (`shard_map`), since GSPMD cannot partition a Mosaic kernel.
`cache_attention` reads a decoding cache; under a `context` split of its slots, whole new tokens (decode) are
attended by each chip over the selected rows it owns, and the partial outputs merge by their log-sum-exp."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from glm5_jax.config import ModelConfig
from glm5_jax.config.mesh import CONTEXT_AXIS
from glm5_jax.distributed.batch_local import context_split
from glm5_jax.distributed.context_cache import against_cache
from glm5_jax.distributed.context_local import context_local, require_whole_sequences
from glm5_jax.distributed.context_order import causal_cost_offset, declared_offset
from glm5_jax.ops.platform import uses_kernels
from pallas_kernels import dense_attention_target, sparse_mla_attention, sparse_mla_attention_with_target
from pallas_kernels.sparse_latent import sparse_latent_attention


def _kernel_attention(q, rows, indices, config: ModelConfig, cost_q_offset: int | None = None):
    return sparse_mla_attention(q, rows, indices, scale=config.softmax_scale, kv_lora_rank=config.kv_lora_rank,
                                cost_q_offset=cost_q_offset, row_gradients=config.sparse_row_gradients,
                                **config.pallas_options)


def sparse_attention(q: jax.Array, rows: jax.Array, indices: jax.Array, *, config: ModelConfig, mesh=None,
                     q_offset: int | None = None) -> jax.Array:
    """The latent attention output [B, S, H, C] over the selected rows. q_offset: for a causal selection over the
    queries' own sequence, the row of query 0 (the kernels then declare only the row blocks each query can
    fill); None (decoding against a cache) declares every block."""
    if not uses_kernels(config):
        return context_local(lambda _, q, indices, rows: _jnp_attention(q, rows, indices, config)[0], mesh,
                             (q, indices), (rows,))

    def kernels(chip_offset, q, indices, rows):
        cost = None if q_offset is None else q_offset + causal_cost_offset(chip_offset, rows.shape[1], q.shape[1])
        return _kernel_attention(q, rows, indices, config, cost)[0]

    return context_local(kernels, mesh, (q, indices), (rows,), local_rows=True)


def cache_attention(q: jax.Array, rows: jax.Array, indices: jax.Array, *, config: ModelConfig,
                    mesh=None) -> jax.Array:
    """The latent attention output [B, S, H, C] of new tokens' absorbed queries q [B, S, H, C+R] over the
    selected slots `indices` [B, S, N] (global; -1 = unused) of one layer's cache rows [B, T, C+R]. Under a
    `context` split of the slots (jnp path only), new tokens split like the cache attend over the gathered
    rows; whole new tokens (decode) are attended by each chip over the selected rows it owns, giving a partial
    output and log-sum-exp per query and head, and the chips' partials merge across `context` (flash-decoding)."""
    if context_split(mesh) == 1:
        return sparse_attention(q, rows, indices, config=config, mesh=mesh)
    if uses_kernels(config):
        require_whole_sequences(mesh, "decoding with the sparse MLA kernel (attention_backend pallas)")

    def share(first_slot, rows, q, indices):
        local = indices - first_slot
        owned = (indices >= 0) & (local >= 0) & (local < rows.shape[1])
        out, lse, _ = _jnp_attention(q, rows, jnp.where(owned, local, -1), config)
        return merge_partial_attention(out, lse)

    return against_cache(lambda rows, q, indices: _jnp_attention(q, rows, indices, config)[0], share, mesh,
                         (rows,), (q, indices))


def merge_partial_attention(out: jax.Array, lse: jax.Array) -> jax.Array:
    """Inside a `context` split: the attention over every chip's keys from each chip's output over its own
    keys, out [B, S, H, C], and their log-sum-exp lse [B, S, H] (fp32). A chip that owns none of a query's
    keys has an lse near NEG_INF and weighs nothing; a query with no key anywhere gets zeros, as on one chip."""
    weight = jnp.exp(lse - jax.lax.pmax(lse, CONTEXT_AXIS))
    total = jax.lax.psum(weight, CONTEXT_AXIS)
    merged = jax.lax.psum(out.astype(jnp.float32) * weight[..., None], CONTEXT_AXIS)
    return (merged / total[..., None]).astype(out.dtype)


def _jnp_attention(q, rows, indices, config: ModelConfig):
    return sparse_latent_attention(q, rows, indices, config.softmax_scale, config.kv_lora_rank,
                                   config.index_query_chunk)


def sparse_attention_with_target(q: jax.Array, rows: jax.Array, indices: jax.Array, *, config: ModelConfig,
                                 mesh=None) -> tuple[jax.Array, jax.Array]:
    """(latent output [B, S, H, C], the head-mean probabilities at the selected keys [B, S, N] fp32, a constant).
    The jnp path returns the target from its forward pass; the kernels from theirs too on TPU (one gather of the
    selected rows for both), on GPU from a second kernel over the lse (`sparse_mla_attention_with_target`).
    Neither keeps gathered rows for the backward. `indices` are the queries' own causal selection (DSA training):
    the kernels declare only the row blocks it can fill."""
    if not uses_kernels(config):
        def jnp_path(_, q, indices, rows):
            latent, _, target = _jnp_attention(q, rows, indices, config)
            return latent, target
        return context_local(jnp_path, mesh, (q, indices), (rows,))

    def kernels(chip_offset, q, indices, rows):
        latent, _, target = sparse_mla_attention_with_target(
            q, rows, indices, scale=config.softmax_scale, kv_lora_rank=config.kv_lora_rank,
            cost_q_offset=causal_cost_offset(chip_offset, rows.shape[1], q.shape[1]),
            row_gradients=config.sparse_row_gradients, **config.pallas_options)
        return latent, target

    return context_local(kernels, mesh, (q, indices), (rows,), local_rows=True)


def dense_attention_with_target(q: jax.Array, rows: jax.Array, visible: jax.Array, segment_ids: jax.Array, *,
                                config: ModelConfig, mesh=None) -> tuple[jax.Array, jax.Array]:
    """The kernels' dense warm-up: (latent output [B, S, H, C] over every visible key, the head-mean
    probabilities over them [B, S, T] fp32). `visible` [B, S, T] must be causal within `segment_ids` [B, S].
    The jnp path has no absorbed form of this: it takes the probabilities of the expanded attention that
    produces its output (`glm5_jax.model.attention.MLA.attend_dense_with_target`)."""
    if not uses_kernels(config):
        raise ValueError(f"dense_attention_with_target runs the kernels of attention_backend "
                         f"'pallas'; attention_backend={config.attention_backend!r} uses the expanded form")

    def kernels(q_offset, q, visible, q_segment_ids, rows, k_segment_ids):
        every_visible = jnp.where(visible, jnp.arange(visible.shape[-1]), -1).astype(jnp.int32)
        latent, _ = _kernel_attention(q, rows, every_visible, config,
                                      causal_cost_offset(q_offset, rows.shape[1], q.shape[1]))
        target = dense_attention_target(jax.lax.stop_gradient(q), jax.lax.stop_gradient(rows),
                                        scale=config.softmax_scale, q_segment_ids=q_segment_ids,
                                        k_segment_ids=k_segment_ids, q_offset=q_offset,
                                        cost_q_offset=declared_offset(q_offset, rows.shape[1], q.shape[1]),
                                        **config.pallas_options)
        return latent, target

    return context_local(kernels, mesh, (q, visible, segment_ids), (rows, segment_ids), local_rows=True)
