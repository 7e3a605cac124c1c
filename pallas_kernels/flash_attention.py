"""Causal attention of every head over every visible key: on TPU jax's Mosaic flash attention kernels
(`jax.experimental.pallas.ops.tpu.flash_attention`), on GPU jax's Triton ones (`gpu_flash_attention`), in MLA's
expanded form (per-head keys and values).

For DSA layers whose top-k selects every visible key (T <= N: the selection is the causal mask) and for the
dense warm-up's attention. The sparse MLA kernels would gather every visible latent row per query there, O(S x T)
row reads, where flash attention streams key blocks past query blocks (one layer's sparse stage at S = T = 2048
on v6e, forward and backward: 26.5 GB and 16.2 ms by roofline with the sparse kernels, 8.3 GB and 5.1 ms with
this, the top-k and the dense KL target; benchmarks/tpu_kernels_aot.py).

q [B, S, H, K] and k [B, S, H, K] (K = nope + rope), v [B, S, H, P], segment_ids [B, S]: query s sees key t iff
t <= s and both carry the same segment id. Head dims are zero-padded to one multiple of 128 (the kernels' lane
width; q.k and the output are unchanged; GLM-5's are 256 already), the sequence to a block multiple (padding
tokens get segment id -1: they see only each other). The forward and both backward kernels (dk/dv, then dq)
are jax's, called through their module's functions so that each kernel declares its cost: FLOPs of the key
blocks it computes and HBM bytes counting the blocks it re-reads (jax declares the forward's inputs once and
nothing for the backward).
`interpret` runs them in TPU interpret mode on CPU (the Triton ones in Pallas's interpret mode). The rest of this
module is the TPU path.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax.experimental.pallas import tpu as pltpu

from pallas_kernels._common import (check_equal, check_float_dtype, check_rank, pad_axis, resolve_interpret,
                                   resolve_platform, round_up)
from pallas_kernels.gpu_flash_attention import triton_flash, triton_flash_plan
from pallas_kernels.kernel_cost import declared_cost
from pallas_kernels.tpu_flash_target import tpu_flash_target

LANES = 128  # jax's flash kernels tile the head dim and hold l, m, di as 128-lane rows
BLOCKS = (512, 256, 128)  # the largest dividing the padded sequence (jax's kernels need key blocks of 128k)
PADDING_SEGMENT = -1


@dataclasses.dataclass(frozen=True)
class _Plan:
    batch: int
    heads: int
    length: int  # padded sequence
    dim: int  # padded head dim
    block: int
    itemsize: int

    @property
    def blocks(self) -> int:
        return self.length // self.block

    @property
    def block_pairs(self) -> int:
        """(query block, key block) pairs on or below the diagonal, per batch row and head: those computed."""
        return self.blocks * (self.blocks + 1) // 2

    def tile_bytes(self, rows: int, width: int, itemsize: int) -> int:
        return self.batch * self.heads * rows * width * itemsize

    def pair_flops(self, matmuls: int) -> int:
        return self.batch * self.heads * self.block_pairs * matmuls * 2 * self.block * self.block * self.dim

    def forward_cost(self):
        """q, o, l, m once; k and v for each computed block pair (each query block streams its keys)."""
        streamed = 2 * self.tile_bytes(self.block_pairs * self.block, self.dim, self.itemsize)
        once = 2 * self.tile_bytes(self.length, self.dim, self.itemsize) + 2 * self.tile_bytes(self.length, LANES, 4)
        return self.pair_flops(2), streamed + once, self.batch * self.heads * self.block_pairs * self.block ** 2

    def dkv_cost(self):
        """Per key block: q, do (and l, m, di) of each query block that sees it; k, v read and dk, dv written."""
        per_query_row = 2 * self.dim * self.itemsize + 3 * LANES * 4
        streamed = self.batch * self.heads * self.block_pairs * self.block * per_query_row
        once = 4 * self.tile_bytes(self.length, self.dim, self.itemsize)
        return self.pair_flops(4), streamed + once, self.batch * self.heads * self.block_pairs * self.block ** 2

    def dq_cost(self):
        """Per query block: k and v of each key block it sees; q, do, l, m, di read and dq written once."""
        streamed = 2 * self.tile_bytes(self.block_pairs * self.block, self.dim, self.itemsize)
        once = 3 * self.tile_bytes(self.length, self.dim, self.itemsize) + 3 * self.tile_bytes(self.length, LANES, 4)
        return self.pair_flops(3), streamed + once, self.batch * self.heads * self.block_pairs * self.block ** 2


def _module():
    # Imported on use: only the TPU path needs jax's TPU flash attention module.
    from jax.experimental.pallas.ops.tpu import flash_attention as module

    return module


def _interpreting(interpret: bool):
    return pltpu.force_tpu_interpret_mode() if interpret else contextlib.nullcontext()


def _forward(q, k, v, segments, scale, plan, interpret):
    fa = _module()
    with _interpreting(interpret), declared_cost(*plan.forward_cost()):
        return fa._flash_attention_impl(q, k, v, None, fa.SegmentIds(segments, segments), True, True, scale, 1,
                                        plan.block, plan.block, plan.block, False)


@functools.partial(jax.custom_vjp, nondiff_argnums=(4, 5, 6))
def _flash(q, k, v, segments, scale, plan, interpret):
    return _forward(q, k, v, segments, scale, plan, interpret)[0]


def _flash_fwd(q, k, v, segments, scale, plan, interpret):
    out, l, m = _forward(q, k, v, segments, scale, plan, interpret)
    return out, (q, k, v, segments, out, l, m)


def _flash_bwd(scale, plan, interpret, residuals, d_out):
    fa = _module()
    q, k, v, segments, out, l, m = residuals
    segment_ids = fa.SegmentIds(segments, segments)
    di = jnp.sum(out.astype(jnp.float32) * d_out.astype(jnp.float32), axis=-1)
    blocks = dict(block_k_major=plan.block, block_k=plan.block, sm_scale=scale, causal=True,
                  mask_value=fa.DEFAULT_MASK_VALUE, debug=False)
    with _interpreting(interpret):
        with declared_cost(*plan.dkv_cost()):
            dk, dv = fa._flash_attention_bwd_dkv(q, k, v, None, segment_ids, l, m, d_out, di,
                                                 block_q_major=plan.block, block_q=plan.block, **blocks)
        with declared_cost(*plan.dq_cost()):
            dq, _ = fa._flash_attention_bwd_dq(q, k, v, None, segment_ids, l, m, d_out, di,
                                               block_q_major=plan.block, **blocks)
    return dq, dk, dv, None


_flash.defvjp(_flash_fwd, _flash_bwd)


def _lse(l, m):
    """Each (head, query) row's log-sum-exp [B, H, L] from the forward's final sum and max ([B, H, L] each)."""
    return m + jnp.log(l)


@functools.partial(jax.custom_vjp, nondiff_argnums=(4, 5, 6))
def _flash_with_lse(q, k, v, segments, scale, plan, interpret):
    out, l, m = _forward(q, k, v, segments, scale, plan, interpret)
    return out, _lse(l, m)


def _flash_with_lse_fwd(q, k, v, segments, scale, plan, interpret):
    out, l, m = _forward(q, k, v, segments, scale, plan, interpret)
    return (out, _lse(l, m)), (q, k, v, segments, out, l, m)


def _flash_with_lse_bwd(scale, plan, interpret, residuals, cotangents):
    d_out, _ = cotangents  # the lse is a statistic for a stop-gradient target (`causal_flash_attention_with_target`)
    return _flash_bwd(scale, plan, interpret, residuals, d_out)


_flash_with_lse.defvjp(_flash_with_lse_fwd, _flash_with_lse_bwd)


def _validate(q, k, v, segment_ids):
    check_rank("q", q, 4, "[B, S, H, K]")
    check_rank("k", k, 4, "[B, S, H, K]")
    check_rank("v", v, 4, "[B, S, H, P]")
    for name, x in (("q", q), ("k", k), ("v", v)):
        check_float_dtype(name, x)
    check_equal("k.shape", tuple(k.shape), tuple(q.shape), "q's [B, S, H, K] (self-attention)")
    check_equal("v.shape[:3]", tuple(v.shape[:3]), tuple(q.shape[:3]), "q's [B, S, H]")
    check_equal("segment_ids.shape", tuple(segment_ids.shape), tuple(q.shape[:2]), "q's [B, S]")


def _padded(q, k, v, segment_ids, dim: int, length: int):
    """q, k, v [B, S, H, *] -> [B, L, H, dim] in their promoted dtype, and segment ids [B, L] (padding tokens
    get their own segment: they see only each other)."""
    dtype = jnp.promote_types(jnp.promote_types(q.dtype, k.dtype), v.dtype)
    rows = [pad_axis(pad_axis(x.astype(dtype), 3, dim), 1, length) for x in (q, k, v)]
    return rows, pad_axis(segment_ids.astype(jnp.int32), 1, length, value=PADDING_SEGMENT)


def _tpu_plan(q, v) -> _Plan:
    batch, seq, heads, _ = q.shape
    length = round_up(seq, BLOCKS[-1])
    itemsize = jnp.dtype(jnp.promote_types(q.dtype, v.dtype)).itemsize
    return _Plan(batch, heads, length, round_up(max(q.shape[-1], v.shape[-1]), LANES),
                 next(b for b in BLOCKS if length % b == 0), itemsize)


def causal_flash_attention(q, k, v, segment_ids, *, scale: float, interpret: bool | None = None,
                           platform: str | None = None) -> jax.Array:
    """softmax(scale * q.k) v over the keys each query sees (causal within its segment): [B, S, H, P] in the
    inputs' promoted dtype, differentiable in q, k and v (fp32 statistics and accumulation inside the kernels).
    platform: "tpu" (jax's Mosaic kernels), "gpu" (jax's Triton kernels, `gpu_flash_attention`) or None (TPU on
    a TPU backend, else GPU)."""
    _validate(q, k, v, segment_ids)
    batch, seq, heads, _ = q.shape
    values = v.shape[-1]
    interpret = resolve_interpret(interpret)
    if resolve_platform(platform) == "gpu":
        # One head dim for q, k and v (jax's Triton kernels take one); [B, L, H, D] is their layout already.
        itemsize = jnp.dtype(jnp.promote_types(jnp.promote_types(q.dtype, k.dtype), v.dtype)).itemsize
        gpu_plan = triton_flash_plan(batch, seq, heads, max(q.shape[-1], values), itemsize)
        rows, segments = _padded(q, k, v, segment_ids, gpu_plan.dim, gpu_plan.length)
        return triton_flash(*rows, segments, float(scale), gpu_plan, interpret)[:, :seq, :, :values]
    plan = _tpu_plan(q, v)
    rows, segments = _padded(q, k, v, segment_ids, plan.dim, plan.length)
    out = _flash(*(jnp.swapaxes(x, 1, 2) for x in rows), segments, float(scale), plan, interpret)  # [B, H, L, dim]
    return jnp.swapaxes(out, 1, 2)[:, :seq, :, :values]


def causal_flash_attention_with_target(q, k, v, segment_ids, *, scale: float, interpret: bool | None = None,
                                       platform: str | None = None) -> tuple[jax.Array, jax.Array]:
    """(`causal_flash_attention`'s output, the indexer KL's dense target): the target fp32 [B, S, S] is the head
    mean of the probabilities softmax(scale * q.k) over the keys each query sees (0 elsewhere), a constant (no
    gradient), computed by `tpu_flash_target` from the flash forward's own log-sum-exp and operands. The Mosaic
    kernels only (platform "tpu", or None on a TPU backend); on GPU the target comes from the latent rows
    (`indexer_kl_target.dense_attention_target`)."""
    _validate(q, k, v, segment_ids)
    if resolve_platform(platform) != "tpu":
        raise ValueError(f"causal_flash_attention_with_target runs the Mosaic (TPU) kernels; platform={platform!r} "
                         "resolves to GPU: use causal_flash_attention with dense_attention_target there")
    seq, values = q.shape[1], v.shape[-1]
    interpret = resolve_interpret(interpret)
    plan = _tpu_plan(q, v)
    rows, segments = _padded(q, k, v, segment_ids, plan.dim, plan.length)
    q_t, k_t, v_t = (jnp.swapaxes(x, 1, 2) for x in rows)  # [B, H, L, dim]
    out, lse = _flash_with_lse(q_t, k_t, v_t, segments, float(scale), plan, interpret)
    constant = jax.lax.stop_gradient
    target = tpu_flash_target(constant(q_t), constant(k_t), constant(lse), segments, scale=float(scale),
                              block=plan.block, interpret=interpret)
    return jnp.swapaxes(out, 1, 2)[:, :seq, :, :values], target[:, :seq, :seq]
