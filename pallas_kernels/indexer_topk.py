"""Lightning-indexer scores and top-k selection for DSA.

I[s, t] = sum_i w[s, i] * relu(q[s, i] . k[t] * J^-0.5) in fp32; a key is visible to query s iff
t <= q_offset + s and (with segment ids) both carry the same segment id; invisible keys score NEG_INF.

The score kernel gives each program block_s queries, whose [block_s * I, J] indexer queries stay on chip
while key blocks stream past: a [block_s * I, J] x [J, block_t] product per block, ReLU, weighted sum over
the I heads, so no [S, I, T] tensor exists; blocks past the causal horizon are filled without a matmul.
`indexer_topk` runs over query chunks under `lax.map`: only a [B, query_chunk, T] score block exists at a
time, and `jax.lax.top_k` takes the top N = min(topk, T) of it. With a static q_offset the chunks are grouped in
bands whose scores and top-k stop at the band's last visible key (`query_chunks.causal_bands`): XLA's top-k sorts
each score row whole, so the causal self-selection's masked half would otherwise cost as much as the rest. Long
rows are ranked through strided bins (`binned_topk`): the top N bins by their max, then the top N of their
scores; on TPU the score kernel folds the bins' maxima as it writes the tiles.

Tie-break rule: exactly that of `jax.lax.top_k` on the same scores, i.e. among equal scores the lowest
key index comes first (ReLU makes many scores exactly 0, so this decides which tied keys fill the last
slots). Selected slots on invisible keys (a query with fewer than N visible keys) come back as -1.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from pallas_kernels._common import (
    MIN_BLOCK,
    NEG_INF,
    check_block,
    check_equal,
    check_float_dtype,
    check_positive_int,
    check_q_offset,
    check_rank,
    check_segments,
    dot_nt,
    key_valid,
    next_power_of_two,
    pad_axis,
    positions_and_segments,
    resolve_interpret,
    resolve_platform,
    round_up,
    static_q_offset,
    triton_params,
)
from pallas_kernels.binned_topk import bin_width, binned_topk, topk_from_bins
from pallas_kernels.dsa_cost import QuerySpan, array_bytes, causal_tiles, indexer_scores_cost
from pallas_kernels.query_chunks import Band, causal_bands
from pallas_kernels.shared_memory import fit_block_and_stages
from pallas_kernels.tpu_indexer import tpu_block_t, tpu_indexer_scores

# Rows (query x indexer head) of one score tile: big enough for the tensor cores, small enough for registers.
_TILE_ROWS = 128


def _block_s(heads_padded: int) -> int:
    return max(1, _TILE_ROWS // heads_padded)


def scores_plan(rows: int, head_dim: int, itemsize: int, block_t: int) -> tuple[int, int]:
    """(keys per step, pipeline stages) of the Triton score kernel on the target GPU: a block's `rows`
    (queries x indexer heads) x J stay in shared memory, each pipeline stage holds block_t x J keys."""
    return fit_block_and_stages(block_t, lambda block, stages: (rows + stages * block) * head_dim * itemsize)


def _scores_kernel(q_ref, k_ref, w_ref, q_pos_ref, q_seg_ref, k_seg_ref, out_ref, *, scale, num_keys, block_t):
    block_s, keys_padded = out_ref.shape
    heads = w_ref.shape[-1]
    q = q_ref[...]  # [block_s * I, J]: stays on chip while the key blocks stream past
    w = w_ref[...][:, :, None]
    q_pos = q_pos_ref[...]
    q_seg = q_seg_ref[...][:, None]
    num_blocks = keys_padded // block_t
    # Causality: blocks past the last query's position hold only masked scores and need no matmul.
    visible_blocks = jnp.clip(jnp.max(q_pos) // block_t + 1, 0, num_blocks)

    def score_block(j, carry):
        keys = pl.ds(j * block_t, block_t)
        logits = dot_nt(q, k_ref[keys, :], precision=lax.Precision.HIGHEST) * scale  # [block_s * I, block_t]
        scores = jnp.sum(jnp.maximum(logits, 0.0).reshape(block_s, heads, block_t) * w, axis=1)
        k_pos = j * block_t + lax.broadcasted_iota(jnp.int32, (1, block_t), 1)
        visible = key_valid(q_pos[:, None], q_seg, k_pos, k_seg_ref[keys][None, :], num_keys)
        out_ref[:, keys] = jnp.where(visible, scores, NEG_INF)
        return carry

    def masked_block(j, carry):
        out_ref[:, pl.ds(j * block_t, block_t)] = jnp.full((block_s, block_t), NEG_INF, jnp.float32)
        return carry

    lax.fori_loop(0, visible_blocks, score_block, 0)
    lax.fori_loop(visible_blocks, num_blocks, masked_block, 0)


def _scores_call(q, k, w, q_pos, q_seg, k_seg, *, block_t: int, interpret: bool, span: QuerySpan):
    """Padded-operand kernel call: q [B, S, I, J], k [B, T, J], w [B, S, I] -> [B, S, T] (S, T unpadded)."""
    batch, q_len, heads, head_dim = q.shape
    k_len = k.shape[1]
    heads_p = next_power_of_two(heads)
    dim_p = next_power_of_two(head_dim, MIN_BLOCK)
    block_s = _block_s(heads_p)
    itemsize = q.dtype.itemsize
    block_t, stages = scores_plan(block_s * heads_p, dim_p, itemsize, block_t)
    len_p, keys_p = round_up(q_len, block_s), round_up(k_len, block_t)
    q_rows = pad_axis(pad_axis(pad_axis(q, 3, dim_p), 2, heads_p), 1, len_p).reshape(batch, len_p * heads_p, dim_p)
    k_p = pad_axis(pad_axis(k, 2, dim_p), 1, keys_p)
    w_p = pad_axis(pad_axis(w, 2, heads_p), 1, len_p)
    q_pos_p = pad_axis(q_pos, 0, len_p, value=-1)  # padding queries see no key
    q_seg_p = pad_axis(q_seg, 1, len_p)
    k_seg_p = pad_axis(k_seg, 1, keys_p)
    out_shape = jax.ShapeDtypeStruct((batch, len_p, keys_p), jnp.float32)
    call = pl.pallas_call(
        functools.partial(_scores_kernel, scale=head_dim**-0.5, num_keys=k_len, block_t=block_t),
        grid=(batch, len_p // block_s),
        in_specs=[
            pl.BlockSpec((None, block_s * heads_p, dim_p), lambda b, i: (b, i, 0)),
            pl.BlockSpec((None, keys_p, dim_p), lambda b, i: (b, 0, 0)),
            pl.BlockSpec((None, block_s, heads_p), lambda b, i: (b, i, 0)),
            pl.BlockSpec((block_s,), lambda b, i: (i,)),
            pl.BlockSpec((None, block_s), lambda b, i: (b, i)),
            pl.BlockSpec((None, keys_p), lambda b, i: (b, 0)),
        ],
        out_specs=pl.BlockSpec((None, block_s, keys_p), lambda b, i: (b, i, 0)),
        out_shape=out_shape,
        interpret=interpret,
        compiler_params=triton_params(num_warps=4, num_stages=stages),
    )
    tiles = causal_tiles(span, len_p, block_s, block_t, keys_p // block_t)
    cost = indexer_scores_cost(batch, tiles, block_s * heads_p, block_t, dim_p, itemsize,
                               query_bytes=array_bytes(q_rows, w_p, q_seg_p) + batch * array_bytes(q_pos_p),
                               out_bytes=array_bytes(out_shape))
    with cost.declared():
        scores = call(q_rows, k_p, w_p, q_pos_p, q_seg_p, k_seg_p)
    return scores[:, :q_len, :k_len]


def _platform_scores(q, k, w, q_pos, q_seg, k_seg, block_t, interpret, platform, span):
    call = tpu_indexer_scores if platform == "tpu" else _scores_call
    return call(q, k, w, q_pos, q_seg, k_seg, block_t=block_t, interpret=interpret, span=span)


@functools.partial(jax.custom_vjp, nondiff_argnums=(6, 7, 8, 9, 10))
def _scores(q, k, w, q_pos, q_seg, k_seg, block_t, bwd_query_chunk, interpret, platform, span):
    return _platform_scores(q, k, w, q_pos, q_seg, k_seg, block_t, interpret, platform, span)


def _scores_fwd(q, k, w, q_pos, q_seg, k_seg, block_t, bwd_query_chunk, interpret, platform, span):
    out = _platform_scores(q, k, w, q_pos, q_seg, k_seg, block_t, interpret, platform, span)
    return out, (q, k, w, q_pos, q_seg, k_seg)


def _scores_bwd(block_t, bwd_query_chunk, interpret, platform, span, residuals, d_scores):
    """jnp backward over query chunks: a [B, chunk, I, T] fp32 block at a time, never [B, S, I, T]."""
    q, k, w, q_pos, q_seg, k_seg = residuals
    batch, q_len, heads, head_dim = q.shape
    k_len = k.shape[1]
    scale = head_dim**-0.5
    chunk = min(bwd_query_chunk, q_len)
    len_p = round_up(q_len, chunk)
    q32 = pad_axis(q.astype(jnp.float32), 1, len_p)
    k32 = k.astype(jnp.float32)
    w_p = pad_axis(w, 1, len_p)
    q_pos_p = pad_axis(q_pos, 0, len_p, value=-1)
    q_seg_p = pad_axis(q_seg, 1, len_p)
    d_p = pad_axis(d_scores, 1, len_p)
    k_pos = jnp.arange(k_len, dtype=jnp.int32)

    def chunk_step(c, carry):
        dq, dw, dk = carry
        start = c * chunk

        def take(x, axis=1):
            return lax.dynamic_slice_in_dim(x, start, chunk, axis=axis)

        q_c, w_c = take(q32), take(w_p)
        visible = key_valid(take(q_pos_p, 0)[None, :, None], take(q_seg_p)[:, :, None], k_pos[None, None, :],
                            k_seg[:, None, :], k_len)
        g = jnp.where(visible, take(d_p), 0.0)  # masked scores are constants
        logits = jnp.einsum("BSIJ,BTJ->BSIT", q_c, k32, precision=lax.Precision.HIGHEST) * scale
        active = logits > 0
        dw_c = jnp.einsum("BST,BSIT->BSI", g, jnp.where(active, logits, 0.0), precision=lax.Precision.HIGHEST)
        d_logits = jnp.where(active, g[:, :, None, :] * w_c[..., None], 0.0) * scale
        dq_c = jnp.einsum("BSIT,BTJ->BSIJ", d_logits, k32, precision=lax.Precision.HIGHEST)
        dk = dk + jnp.einsum("BSIT,BSIJ->BTJ", d_logits, q_c, precision=lax.Precision.HIGHEST)
        dq = lax.dynamic_update_slice_in_dim(dq, dq_c, start, axis=1)
        dw = lax.dynamic_update_slice_in_dim(dw, dw_c, start, axis=1)
        return dq, dw, dk

    init = (jnp.zeros(q32.shape, jnp.float32), jnp.zeros(w_p.shape, jnp.float32), jnp.zeros(k32.shape, jnp.float32))
    dq, dw, dk = lax.fori_loop(0, len_p // chunk, chunk_step, init)
    return (dq[:, :q_len].astype(q.dtype), dk.astype(k.dtype), dw[:, :q_len].astype(w.dtype), None, None, None)


_scores.defvjp(_scores_fwd, _scores_bwd)


@functools.partial(jax.custom_vjp, nondiff_argnums=(6, 7, 8, 9, 10, 11))
def _binned_scores(q, k, w, q_pos, q_seg, k_seg, block_t, bwd_query_chunk, interpret, span, bins, num_keys):
    """TPU scores with their bin maxima made on chip (`tpu_indexer_scores(..., bins=)`): k (and k_seg) padded to a
    multiple of `bins`, num_keys the real keys. Differentiable in the scores like `_scores` (the maxima are
    integers)."""
    return tpu_indexer_scores(q, k, w, q_pos, q_seg, k_seg, block_t=block_t, interpret=interpret, span=span,
                              bins=bins, num_keys=num_keys)


def _binned_scores_fwd(q, k, w, q_pos, q_seg, k_seg, block_t, bwd_query_chunk, interpret, span, bins, num_keys):
    out = tpu_indexer_scores(q, k, w, q_pos, q_seg, k_seg, block_t=block_t, interpret=interpret, span=span, bins=bins,
                             num_keys=num_keys)
    return out, (q, k, w, q_pos, q_seg, k_seg)


def _binned_scores_bwd(block_t, bwd_query_chunk, interpret, span, bins, num_keys, residuals, cotangents):
    # The padding keys' scores are never selected (NEG_INF, past every real key): their cotangent is 0.
    return _scores_bwd(block_t, bwd_query_chunk, interpret, "tpu", span, residuals, cotangents[0])


_binned_scores.defvjp(_binned_scores_fwd, _binned_scores_bwd)


def _scores_topk(q, k, w, q_pos, q_seg, k_seg, block_t, bwd_query_chunk, interpret, platform, span, width, bins,
                 num_keys):
    """(values, indices) of the top `width` of one query chunk's scores against its band's num_keys keys, binned
    (`binned_topk`). bins: on TPU, the bin count the score kernel folds the bins' maxima for (k and k_seg then
    come padded to a multiple of it), so the top-k reads the scores only to gather its candidates; None: the
    maxima (if binning pays) are read off the scores."""
    if bins is None:
        return binned_topk(_scores(q, k, w, q_pos, q_seg, k_seg, block_t, bwd_query_chunk, interpret, platform,
                                   span), width)
    scores, order, first_key = _binned_scores(q, k, w, q_pos, q_seg, k_seg, block_t, bwd_query_chunk, interpret,
                                              span, bins, num_keys)
    return topk_from_bins(scores, order, first_key, width, num_keys=num_keys)


def _validate(q_index, k_index, weights, q_segment_ids, k_segment_ids, q_offset, block_t):
    check_rank("q_index", q_index, 4, "[B, S, I, J]")
    check_rank("k_index", k_index, 3, "[B, T, J]")
    check_rank("weights", weights, 3, "[B, S, I]")
    for name, x in (("q_index", q_index), ("k_index", k_index), ("weights", weights)):
        check_float_dtype(name, x)
    batch, q_len, heads, head_dim = q_index.shape
    check_equal("k_index.shape[0]", k_index.shape[0], batch, "batch of q_index")
    check_equal("k_index.shape[-1]", k_index.shape[-1], head_dim, "J of q_index")
    check_equal("weights.shape", tuple(weights.shape), (batch, q_len, heads), "[B, S, I] of q_index")
    if k_index.shape[1] < 1:
        raise ValueError(f"k_index needs at least one key; got shape {k_index.shape}")
    check_segments(q_segment_ids, k_segment_ids, batch, q_len, k_index.shape[1])
    check_q_offset(q_offset)
    check_block("block_t", block_t)


def _operands(q_index, k_index, weights, q_segment_ids, k_segment_ids, q_offset):
    dtype = jnp.promote_types(q_index.dtype, k_index.dtype)
    batch, q_len = q_index.shape[:2]
    q_pos, q_seg, k_seg = positions_and_segments(q_offset, q_segment_ids, k_segment_ids, batch, q_len,
                                                 k_index.shape[1])
    return q_index.astype(dtype), k_index.astype(dtype), weights.astype(jnp.float32), q_pos, q_seg, k_seg


def indexer_scores(q_index, k_index, weights, *, q_segment_ids=None, k_segment_ids=None, q_offset=0,
                   block_t=64, bwd_query_chunk=64, interpret=None, platform=None, cost_q_offset=None):
    """Masked fp32 index scores [B, S, T] (the dense warm-up's logits); invisible keys get NEG_INF.

    q_index [B, S, I, J] (roped), k_index [B, T, J], weights [B, S, I] (already scaled); segment ids
    [B, S] / [B, T] or both None; q_offset: position of query 0 (int or integer scalar array).
    Differentiable in q_index, k_index and weights; the backward holds a [B, bwd_query_chunk, I, T]
    fp32 block at a time. platform: "gpu" (Triton), "tpu" (Mosaic, `tpu_indexer.py`; block_t is rounded
    up to a multiple of 128 there) or None (TPU kernels on a TPU backend). cost_q_offset: for a traced
    q_offset, the static offset the declared cost assumes (None: every key tile).
    """
    _validate(q_index, k_index, weights, q_segment_ids, k_segment_ids, q_offset, block_t)
    check_positive_int("bwd_query_chunk", bwd_query_chunk)
    operands = _operands(q_index, k_index, weights, q_segment_ids, k_segment_ids, q_offset)
    span = (static_q_offset(q_offset, cost_q_offset), q_index.shape[1], 1)
    return _scores(*operands, block_t, bwd_query_chunk, resolve_interpret(interpret), resolve_platform(platform),
                   span)


def indexer_topk(q_index, k_index, weights, *, topk, q_segment_ids=None, k_segment_ids=None, q_offset=0,
                 query_chunk=256, block_t=64, interpret=None, platform=None, cost_q_offset=None):
    """Top-k keys per query: (indices int32 [B, S, N], scores fp32 [B, S, N]) with N = min(topk, T).

    Indices are ordered by descending score, ties broken like jax.lax.top_k (lowest index first); slots
    on invisible keys hold -1 and score NEG_INF. Scores are differentiable like `indexer_scores`'.
    Memory: one [B, query_chunk, T] fp32 score block at a time; with a static q_offset each band of chunks scores
    and ranks only the keys its queries can see (`causal_bands`). platform, cost_q_offset: as in `indexer_scores`.
    """
    _validate(q_index, k_index, weights, q_segment_ids, k_segment_ids, q_offset, block_t)
    check_positive_int("topk", topk)
    check_positive_int("query_chunk", query_chunk)
    interpret, platform = resolve_interpret(interpret), resolve_platform(platform)
    q, k, w, q_pos, q_seg, k_seg = _operands(q_index, k_index, weights, q_segment_ids, k_segment_ids, q_offset)
    batch, q_len, heads, _ = q.shape
    k_len = k.shape[1]
    num_selected = min(topk, k_len)
    chunk = round_up(min(query_chunk, q_len), _block_s(next_power_of_two(heads)))
    n_chunks = -(-q_len // chunk)
    len_p = n_chunks * chunk
    q_p, w_p = pad_axis(q, 1, len_p), pad_axis(w, 1, len_p)
    q_pos_p = pad_axis(q_pos, 0, len_p, value=-1)
    q_seg_p = pad_axis(q_seg, 1, len_p)
    first_position = static_q_offset(q_offset, cost_q_offset)

    def band_topk(band: Band):
        keys, key_segments = k[:, :band.num_keys], k_seg[:, :band.num_keys]
        width = min(num_selected, band.num_keys)
        bins = bin_width(band.num_keys, width, align=tpu_block_t(block_t)) if platform == "tpu" else None
        if bins is not None:  # padded once per band, not by the kernel's wrapper in every chunk
            score_keys = pad_axis(keys, 1, round_up(band.num_keys, bins))
            score_segments = pad_axis(key_segments, 1, score_keys.shape[1])
        else:
            score_keys, score_segments = keys, key_segments
        real_queries = min(band.num_queries, q_len - band.first_query)  # the last band ends in padding
        span = (None if first_position is None else first_position + band.first_query, real_queries,
                band.num_queries // chunk)

        def select(c):
            def take(x, axis=1):
                return lax.dynamic_slice_in_dim(x, band.first_query + c * chunk, chunk, axis=axis)

            pos_c, seg_c = take(q_pos_p, 0), take(q_seg_p)
            values, indices = _scores_topk(take(q_p), score_keys, take(w_p), pos_c, seg_c, score_segments, block_t,
                                           chunk, interpret, platform, span, width, bins, band.num_keys)
            picked_seg = jnp.take_along_axis(key_segments[:, None, :], indices, axis=-1)
            visible = key_valid(pos_c[None, :, None], seg_c[:, :, None], indices, picked_seg, k_len)
            pad = [(0, 0), (0, 0), (0, num_selected - width)]
            return (jnp.pad(jnp.where(visible, indices, -1).astype(jnp.int32), pad, constant_values=-1),
                    jnp.pad(values, pad, constant_values=NEG_INF))

        return lax.map(select, jnp.arange(band.num_queries // chunk))

    def unchunk(x):  # [n_chunks, B, chunk, N] -> [B, S, N]
        return jnp.moveaxis(x, 0, 1).reshape(batch, len_p, num_selected)[:, :q_len]

    # Each band of query chunks ranks only the keys its queries can see (static key lengths; `causal_bands`). The
    # bands write into one buffer in place: a concatenation would hold every band's result and the whole twice.
    indices = jnp.full((n_chunks, batch, chunk, num_selected), -1, jnp.int32)
    values = jnp.full((n_chunks, batch, chunk, num_selected), NEG_INF, jnp.float32)
    for band in causal_bands(len_p, k_len, q_offset, n_chunks):
        band_indices, band_values = band_topk(band)
        first = band.first_query // chunk
        indices = lax.dynamic_update_slice_in_dim(indices, band_indices, first, axis=0)
        values = lax.dynamic_update_slice_in_dim(values, band_values, first, axis=0)
    return unchunk(indices), unchunk(values)
