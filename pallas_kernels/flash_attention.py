"""Causal attention of every head over every visible key: on TPU the project's Mosaic flash attention kernels
(`tpu_flash_attention`), on GPU jax's Triton ones (`gpu_flash_attention`), in MLA's expanded form (per-head keys
and values).

For DSA layers whose top-k selects every visible key (T <= N: the selection is the causal mask) and for the
dense warm-up's attention. The sparse MLA kernels would gather every visible latent row per query there, O(S x T)
row reads, where flash attention streams key blocks past query blocks (one layer's sparse stage at S = T = 2048
on v6e, forward and backward: 26.5 GB and 16.2 ms by roofline with the sparse kernels, 8.3 GB and 5.1 ms with
jax's flash kernels, the top-k and the latent-row KL target, before the kernels and the target here;
benchmarks/tpu_kernels_aot.py).

q [B, S, H, K] and k [B, S, H, K] (K = nope + rope), v [B, S, H, P], segment_ids [B, S]: query s sees key t iff
t <= s and both carry the same segment id. Head dims are zero-padded to one multiple of 128 (the kernels' lane
width; q.k and the output are unchanged; GLM-5's are 256 already), the sequence to a block multiple (padding
tokens get segment id -1: they see only each other). The forward keeps each row's log-sum-exp, which the
backward (one kernel for dq, dk and dv where a head's fp32 dq fits VMEM; dk/dv, then dq otherwise) and the KL
target (`tpu_flash_target`) read; each kernel declares its cost. `interpret` runs them in TPU interpret mode on
CPU (the Triton ones in Pallas's interpret mode). The rest of this module is the TPU path.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp

from pallas_kernels._common import (check_equal, check_float_dtype, check_rank, pad_axis, resolve_interpret,
                                   resolve_platform, round_up)
from pallas_kernels.gpu_flash_attention import triton_flash, triton_flash_plan
from pallas_kernels.tpu_flash_attention import flash_backward, flash_forward
from pallas_kernels.tpu_flash_target import tpu_flash_target

LANES = 128  # the kernels tile the head dim by lanes
BLOCKS = (512, 256, 128)  # the largest dividing the padded sequence
PADDING_SEGMENT = -1


@dataclasses.dataclass(frozen=True)
class _Plan:
    length: int  # padded sequence
    dim: int  # padded head dim
    block: int


def _forward(q, k, v, segments, scale, plan, interpret):
    return flash_forward(q, k, v, segments, scale=scale, block=plan.block, interpret=interpret)


@functools.partial(jax.custom_vjp, nondiff_argnums=(4, 5, 6))
def _flash(q, k, v, segments, scale, plan, interpret):
    return _forward(q, k, v, segments, scale, plan, interpret)[0]


def _flash_fwd(q, k, v, segments, scale, plan, interpret):
    out, lse = _forward(q, k, v, segments, scale, plan, interpret)
    return out, (q, k, v, segments, out, lse)


def _flash_bwd(scale, plan, interpret, residuals, d_out):
    q, k, v, segments, out, lse = residuals
    di = jnp.einsum("BHLD,BHLD->BHL", out.astype(jnp.float32), d_out.astype(jnp.float32))
    dq, dk, dv = flash_backward(q, k, v, segments, lse, d_out, di, scale=scale, block=plan.block,
                                interpret=interpret)
    return dq, dk, dv, None


_flash.defvjp(_flash_fwd, _flash_bwd)


@functools.partial(jax.custom_vjp, nondiff_argnums=(4, 5, 6))
def _flash_with_lse(q, k, v, segments, scale, plan, interpret):
    return _forward(q, k, v, segments, scale, plan, interpret)


def _flash_with_lse_fwd(q, k, v, segments, scale, plan, interpret):
    out, lse = _forward(q, k, v, segments, scale, plan, interpret)
    return (out, lse), (q, k, v, segments, out, lse)


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
    length = round_up(q.shape[1], BLOCKS[-1])
    return _Plan(length, round_up(max(q.shape[-1], v.shape[-1]), LANES), next(b for b in BLOCKS if length % b == 0))


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
