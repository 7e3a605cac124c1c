"""Mosaic TPU versions of the indexer scores and of the dense warm-up KL target.

Both tile a grid (B, S / block_s, T / block_t): a program sees one [block_s, block_t] tile of the output,
its block_s queries and one block of keys, so VMEM use does not depend on T (the Triton kernels hold all T
keys of a batch in one block, which TPU VMEM cannot at T = 200K). On TPU, block_t is rounded up to a
multiple of 128 (the lane width) and block_s to a multiple of 8 (the sublane count).

Indexer scores with bins (for `binned_topk`): the grid's key axis is split in two, (bin block j, slice i), so
that the b tiles of one block of strided bins are consecutive steps and their maxima stay in VMEM.

Causality: each query block's last position is scalar-prefetched into SMEM; key blocks past it are filled
without a matmul, and their key index_map is clamped to the last visible block, so no DMA fetches them (the
declared costs count the visible tiles, `dsa_cost.causal_tiles`, as the Triton kernels' do).

Dense target: two pallas_calls over the key blocks. Pass 1 keeps each (query, head) row's running max and
sum in VMEM scratch across the key axis and writes its lse ([B, S, H] fp32, the only intermediate in HBM);
pass 2 writes [block_s, block_t] tiles of the head sum of exp(logit - lse) / H. A block's rows are its
queries' heads in head-major order ([H * block_s, W]), so the head sum adds H aligned [block_s, block_t]
slices. Rows of padding queries, and of queries without a visible key, get lse = +1e30: probability 0.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from pallas_kernels._common import NEG_INF, dot_nt, key_valid, pad_axis, round_up, tpu_interpret
from pallas_kernels.binned_topk import merge_bin_slice
from pallas_kernels.dsa_cost import QuerySpan, array_bytes, causal_tiles, dense_target_cost, indexer_scores_cost

LANES, SUBLANES = 128, 8
# Query rows of one score program (indexer: queries; dense target: queries x heads, see _dense_block_s).
_INDEXER_BLOCK_S = 128
_DENSE_ROWS = 256
# lse of rows that must add nothing: exp(logit - 1e30) = 0.
_EMPTY_ROW_LSE = -NEG_INF


def _tiles(q_len: int, k_len: int, block_s: int, block_t: int):
    """TPU tile sizes and padded lengths: (block_s, block_t, padded S, padded T)."""
    block_s = min(round_up(block_s, SUBLANES), round_up(q_len, SUBLANES))
    block_t = tpu_block_t(block_t)
    return block_s, block_t, round_up(q_len, block_s), round_up(k_len, block_t)


def tpu_block_t(block_t: int) -> int:
    """The key block the TPU kernels use for a requested block_t: a whole number of lanes."""
    return round_up(block_t, LANES)


def _last_positions(q_pos_p: jax.Array, block_s: int) -> jax.Array:
    """Last query position of each query block, int32 [S / block_s] (scalar-prefetched into SMEM)."""
    return jnp.max(q_pos_p.reshape(-1, block_s), axis=1)


def _visible_key_block(t, last_ref, i, block_t: int):
    """Key block t if it holds a key visible to query block i, else the last such block (no new DMA)."""
    return jnp.minimum(t, lax.div(jnp.maximum(last_ref[i], 0), block_t))  # lax.div: jnp's // lowers via sign


def _tpu_params(*semantics):
    return pltpu.CompilerParams(dimension_semantics=semantics)


def _scores_kernel(last_ref, q_ref, k_ref, w_ref, pos_ref, q_seg_ref, k_seg_ref, out_ref, *bin_refs, scale,
                   num_keys, bin_blocks):
    """One [block_s, block_t] tile of scores. With bins (bin_refs: the two bins-major outputs, then their two VMEM
    accumulators): the tile is key block t = j + i * bin_blocks of grid step (j, i), folded into bin block j's
    running maxima (`binned_topk.merge_bin_slice`), which stay in VMEM over the consecutive steps i and are
    written, transposed, after the last."""
    block_t = out_ref.shape[-1]
    if bin_refs:
        first_key = (pl.program_id(2) + pl.program_id(3) * bin_blocks) * block_t
    else:
        first_key = pl.program_id(2) * block_t
    visible_block = first_key <= last_ref[pl.program_id(1)]

    @pl.when(visible_block)
    def _():
        k = k_ref[...]  # [block_t, J]
        w = w_ref[...]  # [block_s, I]
        # fp32 operands: full-precision passes (the default would round them to bf16). bf16 operands: the MXU's
        # bf16 products are exact in fp32 already, and Mosaic rejects fp32 contract precision on bf16 ("Bad lhs").
        precision = lax.Precision.HIGHEST if k.dtype == jnp.float32 else None
        scores = jnp.zeros(out_ref.shape, jnp.float32)
        for head in range(q_ref.shape[0]):  # [block_s, J] x [J, block_t] per indexer head, ReLU, weighted sum
            logits = dot_nt(q_ref[head], k, precision=precision) * scale
            scores = scores + w[:, head:head + 1] * jnp.maximum(logits, 0.0)
        k_pos = first_key + lax.broadcasted_iota(jnp.int32, (1, block_t), 1)
        visible = key_valid(pos_ref[...], q_seg_ref[...], k_pos, k_seg_ref[...], num_keys)
        # -0.0 (negative weights times ReLU zeros, when the compiler folds the 0 + x of the first head) would rank
        # below +0.0 in the top-k's total order, where the reference has +0.0: zeros are written as +0.0.
        out_ref[...] = jnp.where(visible, jnp.where(scores == 0.0, 0.0, scores), NEG_INF)

    @pl.when(jnp.logical_not(visible_block))
    def _():
        out_ref[...] = jnp.full(out_ref.shape, NEG_INF, jnp.float32)

    if bin_refs:
        order_ref, first_ref, order, first = bin_refs  # outputs [block_t, block_s], running maxima [block_s, block_t]
        step = pl.program_id(3)

        @pl.when(step == 0)
        def _():
            order[...] = jnp.full(order.shape, jnp.iinfo(jnp.int32).max, jnp.int32)
            first[...] = jnp.zeros(first.shape, jnp.int32)

        k_pos = first_key + lax.broadcasted_iota(jnp.int32, out_ref.shape, 1)
        part = jnp.where(k_pos < num_keys, out_ref[...], -jnp.inf)  # keys past the row rank below every score
        order[...], first[...] = merge_bin_slice(order[...], first[...], part, k_pos)

        @pl.when(step == pl.num_programs(3) - 1)
        def _():  # written bins-major: XLA's TPU sort ranks along the major axis, so no relayout before it
            order_ref[...] = order[...].T
            first_ref[...] = first[...].T


def tpu_indexer_scores(q, k, w, q_pos, q_seg, k_seg, *, block_t: int, interpret: bool, span: QuerySpan,
                       bins: int | None = None, num_keys: int | None = None):
    """q [B, S, I, J], k [B, T, J], w fp32 [B, S, I], q_pos [S], q_seg [B, S], k_seg [B, T] -> [B, S, T].
    span: the queries this call's cost covers (`dsa_cost.QuerySpan`). bins: a number of strided bins W (a
    multiple of block_t rounded up to 128, below T): then (scores [B, S, T padded to a multiple of W], keys past T
    scoring NEG_INF; each bin's `binned_topk.bin_maxima`, int32 [B, S, W] twice), the maxima folded on chip as the
    tiles are made, so the top-k reads the scores only to gather its candidates. num_keys: the real keys when k
    (and k_seg) come padded (None: all of k); keys past it are invisible."""
    batch, q_len, heads, head_dim = q.shape
    k_len = k.shape[1] if num_keys is None else num_keys
    block_s, block_t, len_p, keys_p = _tiles(q_len, k.shape[1], _INDEXER_BLOCK_S, block_t)
    bin_blocks = 0
    if bins is not None:
        if bins % block_t or not 0 < bins < k_len:
            raise ValueError(f"bins must be a multiple of block_t={block_t} in (0, T={k_len}); got {bins}")
        bin_blocks, keys_p = bins // block_t, round_up(k.shape[1], bins)
    q_pos_p = pad_axis(q_pos, 0, len_p, value=-1)  # padding queries see no key
    q_heads = jnp.swapaxes(pad_axis(q, 1, len_p), 1, 2)  # [B, I, S, J]: one [block_s, J] slab per head
    k_p = pad_axis(k, 1, keys_p)
    w_p, q_seg_p = pad_axis(w, 1, len_p), pad_axis(q_seg, 1, len_p)[..., None]
    tiles = causal_tiles(span, len_p, block_s, block_t, keys_p // block_t)
    out_shape = [jax.ShapeDtypeStruct((batch, len_p, keys_p), jnp.float32)]
    if bins is None:
        grid = (batch, len_p // block_s, keys_p // block_t)
        key_block = lambda i, t, last: _visible_key_block(t, last, i, block_t)
        out_specs = [pl.BlockSpec((None, block_s, block_t), lambda b, i, t, last: (b, i, t))]
        semantics, scratch = ("parallel", "parallel", "parallel"), []
    else:  # grid step (j, n) makes key block j + n * bin_blocks; bin block j's maxima stay on chip over n
        grid = (batch, len_p // block_s, bin_blocks, keys_p // bins)
        key_block = lambda i, j, n, last: _visible_key_block(j + n * bin_blocks, last, i, block_t)
        out_specs = [pl.BlockSpec((None, block_s, block_t), lambda b, i, j, n, last: (b, i, j + n * bin_blocks))]
        out_specs += 2 * [pl.BlockSpec((None, block_t, block_s), lambda b, i, j, n, last: (b, j, i))]
        out_shape += 2 * [jax.ShapeDtypeStruct((batch, bins, len_p), jnp.int32)]
        semantics = ("parallel", "parallel", "parallel", "arbitrary")
        scratch = 2 * [pltpu.VMEM((block_s, block_t), jnp.int32)]
    grid_spec = pltpu.PrefetchScalarGridSpec(
        num_scalar_prefetch=1,
        grid=grid,
        scratch_shapes=scratch,
        in_specs=[
            pl.BlockSpec((None, heads, block_s, head_dim), lambda b, i, *t_last: (b, 0, i, 0)),
            pl.BlockSpec((None, block_t, head_dim), lambda b, i, *t_last: (b, key_block(i, *t_last), 0)),
            pl.BlockSpec((None, block_s, heads), lambda b, i, *t_last: (b, i, 0)),
            pl.BlockSpec((block_s, 1), lambda b, i, *t_last: (i, 0)),
            pl.BlockSpec((None, block_s, 1), lambda b, i, *t_last: (b, i, 0)),
            pl.BlockSpec((None, 1, block_t), lambda b, i, *t_last: (b, 0, key_block(i, *t_last))),
        ],
        out_specs=out_specs,
    )
    outputs = pl.pallas_call(
        functools.partial(_scores_kernel, scale=head_dim**-0.5, num_keys=k_len, bin_blocks=bin_blocks),
        grid_spec=grid_spec,
        out_shape=out_shape,
        compiler_params=_tpu_params(*semantics),
        cost_estimate=indexer_scores_cost(
            batch, tiles, block_s * heads, block_t, head_dim, q.dtype.itemsize,
            query_bytes=array_bytes(q_heads, w_p, q_seg_p) + batch * array_bytes(q_pos_p),
            out_bytes=array_bytes(*out_shape)).estimate(),
        interpret=tpu_interpret(interpret),
    )(_last_positions(q_pos_p, block_s), q_heads, k_p, w_p, q_pos_p[:, None], q_seg_p,
      pad_axis(k_seg, 1, keys_p)[:, None, :])
    if bins is None:
        return outputs[0][:, :q_len, :k_len]
    # Keys past T stay (scored NEG_INF): slicing them off would copy the scores before the top-k gathers.
    return outputs[0][:, :q_len], *(jnp.swapaxes(x, 1, 2)[:, :q_len] for x in outputs[1:])


def _dense_logits(q_ref, k_ref, pos_ref, seg_ref, k_seg_ref, first_key, *, scale, num_keys):
    """Logits [H * block_s, block_t] of a block's (head, query) rows against one key block, and visibility."""
    block_t = k_ref.shape[0]
    logits = dot_nt(q_ref[...], k_ref[...]) * scale
    k_pos = first_key + lax.broadcasted_iota(jnp.int32, (1, block_t), 1)
    return logits, key_valid(pos_ref[...], seg_ref[...], k_pos, k_seg_ref[...], num_keys)


def _dense_lse_kernel(last_ref, q_ref, k_ref, pos_ref, seg_ref, k_seg_ref, lse_ref, row_max, row_sum, *,
                      scale, num_keys):
    t = pl.program_id(2)
    first_key = t * k_ref.shape[0]

    @pl.when(t == 0)
    def _():
        row_max[...] = jnp.full(row_max.shape, NEG_INF, jnp.float32)
        row_sum[...] = jnp.zeros(row_sum.shape, jnp.float32)

    @pl.when(first_key <= last_ref[pl.program_id(1)])
    def _():  # online log-sum-exp over the key blocks, per (head, query) row
        logits, visible = _dense_logits(q_ref, k_ref, pos_ref, seg_ref, k_seg_ref, first_key, scale=scale,
                                        num_keys=num_keys)
        logits = jnp.where(visible, logits, NEG_INF)
        old_max = row_max[...]
        new_max = jnp.maximum(old_max, jnp.max(logits, axis=1, keepdims=True))
        p = jnp.where(visible, jnp.exp(logits - new_max), 0.0)
        row_sum[...] = row_sum[...] * jnp.exp(old_max - new_max) + jnp.sum(p, axis=1, keepdims=True)
        row_max[...] = new_max

    @pl.when(t == pl.num_programs(2) - 1)
    def _():
        total = row_sum[...]
        counted = total > 0
        lse_ref[...] = jnp.where(counted, row_max[...] + jnp.log(jnp.where(counted, total, 1.0)), _EMPTY_ROW_LSE)


def _dense_probability_kernel(last_ref, q_ref, k_ref, pos_ref, seg_ref, k_seg_ref, lse_ref, out_ref, *,
                              scale, num_keys, heads):
    block_s, block_t = out_ref.shape
    first_key = pl.program_id(2) * block_t
    visible_block = first_key <= last_ref[pl.program_id(1)]

    @pl.when(visible_block)
    def _():
        logits, visible = _dense_logits(q_ref, k_ref, pos_ref, seg_ref, k_seg_ref, first_key, scale=scale,
                                        num_keys=num_keys)
        p = jnp.where(visible, jnp.exp(logits - lse_ref[...]), 0.0)
        out_ref[...] = jnp.sum(p.reshape(heads, block_s, block_t), axis=0) / heads

    @pl.when(jnp.logical_not(visible_block))
    def _():
        out_ref[...] = jnp.zeros(out_ref.shape, jnp.float32)


def _dense_block_s(block_s, heads: int) -> int:
    return max(1, _DENSE_ROWS // heads) if block_s is None else block_s


def tpu_dense_target(q, latent, q_pos, q_seg, k_seg, *, scale: float, block_s, block_t: int, interpret: bool,
                     first_position: int | None):
    """q [B, S, H, X], latent [B, T, X], q_pos [S], q_seg [B, S], k_seg [B, T] -> fp32 [B, S, T].
    first_position: q_pos[0] as a Python int (None when traced: the declared costs then count every tile)."""
    batch, q_len, heads, width = q.shape
    k_len = latent.shape[1]
    block_s, block_t, len_p, keys_p = _tiles(q_len, k_len, _dense_block_s(block_s, heads), block_t)
    num_s, rows, width_p = len_p // block_s, heads * block_s, round_up(width, LANES)

    def head_major(x):  # [B?, S, H, ...] per query block -> [B?, S / block_s, H * block_s, ...]
        lead = x.shape[:-3]
        x = x.reshape(*lead, num_s, block_s, heads, *x.shape[-1:])
        return jnp.swapaxes(x, -3, -2).reshape(*lead, num_s, rows, *x.shape[-1:])

    q_pos_p = pad_axis(q_pos, 0, len_p, value=-1)  # padding queries see no key
    q_rows = head_major(pad_axis(pad_axis(q, 3, width_p), 1, len_p))
    row_pos = head_major(jnp.broadcast_to(q_pos_p[:, None, None], (len_p, heads, 1)))
    row_seg = head_major(jnp.broadcast_to(pad_axis(q_seg, 1, len_p)[:, :, None, None], (batch, len_p, heads, 1)))
    k_p = pad_axis(pad_axis(latent, 2, width_p), 1, keys_p)
    k_seg_p = pad_axis(k_seg, 1, keys_p)[:, None, :]
    last = _last_positions(q_pos_p, block_s)

    row_spec = lambda cols: pl.BlockSpec((None, None, rows, cols), lambda b, i, t, last: (b, i, 0, 0))
    in_specs = [
        row_spec(width_p),
        pl.BlockSpec((None, block_t, width_p), lambda b, i, t, last: (b, _visible_key_block(t, last, i, block_t), 0)),
        pl.BlockSpec((None, rows, 1), lambda b, i, t, last: (i, 0, 0)),
        row_spec(1),
        pl.BlockSpec((None, 1, block_t), lambda b, i, t, last: (b, 0, _visible_key_block(t, last, i, block_t))),
    ]
    operands = (last, q_rows, k_p, row_pos, row_seg, k_seg_p)
    grid = (batch, num_s, keys_p // block_t)
    common = dict(scale=scale, num_keys=k_len)
    lse_shape = jax.ShapeDtypeStruct((batch, num_s, rows, 1), jnp.float32)
    target_shape = jax.ShapeDtypeStruct((batch, len_p, keys_p), jnp.float32)
    # Each pass visits the key blocks up to its query block's last position.
    tiles = causal_tiles((first_position, q_len, 1), len_p, block_s, block_t, keys_p // block_t)
    pass_cost = functools.partial(dense_target_cost, batch, tiles, rows, block_t, width_p, q.dtype.itemsize, passes=1)
    query_bytes = array_bytes(q_rows, row_seg) + batch * array_bytes(row_pos)
    lse = pl.pallas_call(  # pass 1: per-(head, query) lse, [B, S / block_s, H * block_s, 1]
        functools.partial(_dense_lse_kernel, **common),
        grid_spec=pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=1, grid=grid, in_specs=in_specs, out_specs=row_spec(1),
            scratch_shapes=[pltpu.VMEM((rows, 1), jnp.float32), pltpu.VMEM((rows, 1), jnp.float32)]),
        out_shape=lse_shape,
        compiler_params=_tpu_params("parallel", "parallel", "arbitrary"),
        cost_estimate=pass_cost(query_bytes=query_bytes, out_bytes=array_bytes(lse_shape)).estimate(),
        interpret=tpu_interpret(interpret),
    )(*operands)
    target = pl.pallas_call(  # pass 2: [block_s, block_t] tiles of the head-summed probabilities
        functools.partial(_dense_probability_kernel, heads=heads, **common),
        grid_spec=pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=1, grid=grid, in_specs=[*in_specs, row_spec(1)],
            out_specs=pl.BlockSpec((None, block_s, block_t), lambda b, i, t, last: (b, i, t))),
        out_shape=target_shape,
        compiler_params=_tpu_params("parallel", "parallel", "parallel"),
        cost_estimate=pass_cost(query_bytes=query_bytes + array_bytes(lse_shape),
                                out_bytes=array_bytes(target_shape)).estimate(),
        interpret=tpu_interpret(interpret),
    )(*operands, lse)
    return target[:, :q_len, :k_len]
