"""Every Mosaic (TPU) entry point, forward and backward, compiled ahead of time for TPU v5p and v6e by XLA's TPU
compiler and libtpu's Mosaic compiler, on a machine without a TPU, at GLM-5's shapes (H 64, C 512, R 64, N 2048,
indexer 32 x 128) in bf16, the dtype it trains in: one compile per entry point and chip generation. Interpret
mode does not run Mosaic's compiler, so tile alignment, vector layouts and VMEM limits are checked only here.
Each compiled module must hold the expected number of Mosaic kernels, no Triton, and each kernel's scoped VMEM
(as libtpu allotted it) must fit under the chips' smallest default limit.

Each kernel is compiled once per chip (18 compiles: 9 entry points x 2 chips). Not compiled here any more, to
keep the suite's CPU time down: fp32 at GLM-5's shapes, the interpret tests' small odd shapes (test_tpu_kernels.py
CASES), whose numerics the interpret-mode tests still check, and entry points whose kernels another one compiles
(the sparse MLA backward without the target, the forward with it)."""

from __future__ import annotations

import dataclasses
import functools
import re

import jax
import jax.numpy as jnp
import pytest
from aot_compile import CHIPS, SCOPED_VMEM_LIMIT, compile_for, mosaic_vmem_bytes, on_chip

from pallas_kernels import (
    dense_attention_target,
    indexer_scores,
    indexer_topk,
    sparse_attention_target,
    sparse_mla_attention,
    sparse_mla_attention_with_target,
    selected_scores_backward,
)
from pallas_kernels.flash_attention import causal_flash_attention_with_target


@dataclasses.dataclass(frozen=True)
class Shapes:
    batch: int
    q_len: int
    k_len: int
    heads: int
    latent_dim: int  # C
    rope_dim: int  # R
    slots: int  # N
    block_n: int
    bwd_query_chunk: int
    index_heads: int  # I
    index_dim: int  # J
    block_t: int


GLM5 = Shapes(batch=1, q_len=256, k_len=2048, heads=64, latent_dim=512, rope_dim=64, slots=2048, block_n=64,
              bwd_query_chunk=256, index_heads=32, index_dim=128, block_t=128)


def entry_points(shape: Shapes, dtype) -> dict:
    """name: (function, abstract arguments, Mosaic kernels in its compiled module)."""
    b, s, t, h = shape.batch, shape.q_len, shape.k_len, shape.heads
    width, ih, ij = shape.latent_dim + shape.rope_dim, shape.index_heads, shape.index_dim
    sds = jax.ShapeDtypeStruct
    q, latent = sds((b, s, h, width), dtype), sds((b, t, width), dtype)
    indices, lse = sds((b, s, shape.slots), jnp.int32), sds((b, s, h), jnp.float32)
    q_index, k_index, weights = sds((b, s, ih, ij), dtype), sds((b, t, ij), dtype), sds((b, s, ih), jnp.float32)
    q_seg, k_seg = sds((b, s), jnp.int32), sds((b, t), jnp.int32)
    compiled = dict(platform="tpu", interpret=False)
    scale = width**-0.5
    attention = functools.partial(sparse_mla_attention, scale=scale, kv_lora_rank=shape.latent_dim,
                                  block_n=shape.block_n, bwd_query_chunk=shape.bwd_query_chunk, **compiled)
    masks = lambda qs, ks: dict(q_segment_ids=qs, k_segment_ids=ks, q_offset=t - s)  # noqa: E731

    with_target = functools.partial(sparse_mla_attention_with_target, scale=scale, kv_lora_rank=shape.latent_dim,
                                    block_n=shape.block_n, bwd_query_chunk=shape.bwd_query_chunk, **compiled)

    def with_target_loss(q, latent, indices):  # gradients through out and lse; the target a constant
        out, lse, target = with_target(q, latent, indices)
        return jnp.sum(out.astype(jnp.float32)) + jnp.sum(jnp.sin(lse)) + jnp.sum(target)

    def scores_loss(q, k, w, qs, ks):
        return jnp.sum(jnp.sin(indexer_scores(q, k, w, block_t=shape.block_t, **masks(qs, ks), **compiled)))

    def topk(q, k, w, qs, ks, slots=shape.slots):
        return indexer_topk(q, k, w, topk=slots, block_t=shape.block_t, **masks(qs, ks), **compiled)

    def sparse_target(q, latent, indices, lse):
        return sparse_attention_target(q, latent, indices, lse, scale=scale, block_n=shape.block_n, **compiled)

    def dense_target(q, latent, qs, ks):
        return dense_attention_target(q, latent, scale=scale, block_t=shape.block_t, **masks(qs, ks), **compiled)

    def selected_scores_grad(q, k, w, indices, d_scores):  # the sparse KL's backward
        return selected_scores_backward(q, k, w, indices, d_scores, block_n=shape.block_n,
                                        bwd_query_chunk=shape.bwd_query_chunk, **compiled)

    # Every key selected (T <= N): the flash kernels over the expanded heads (qk 192 + 64, v 256), T tokens.
    q_heads, v_heads, segments = sds((b, t, h, 256), dtype), sds((b, t, h, 256), dtype), sds((b, t), jnp.int32)

    def flash_loss(q, k, v, segments):  # the KL target (a constant) from the forward's statistics, and the backward
        out, target = causal_flash_attention_with_target(q, k, v, segments, scale=256**-0.5, **compiled)
        return jnp.sum(out.astype(jnp.float32)) + jnp.sum(target)

    grad = lambda fn, n: jax.grad(fn, argnums=tuple(range(n)))  # noqa: E731
    return {
        # Flash forward, the target from its statistics (`tpu_flash_target`) and one backward kernel for dq, dk and
        # dv (one head's fp32 dq, [2048, 256], fits VMEM): `causal_flash_attention` runs the same flash kernels.
        "causal_flash_attention_with_target_and_backward": (  # the loss's value needs the target (a constant)
            jax.value_and_grad(flash_loss, argnums=(0, 1, 2)), (q_heads, q_heads, v_heads, segments), 3),
        # No sparse MLA backward without the target: the backward with it holds the same backward kernel
        # (same function, same shapes: 60 s of compiles).
        "sparse_mla_forward": (attention, (q, latent, indices), 1),
        "sparse_mla_with_target_forward": (with_target, (q, latent, indices), 1),  # compiled by the next one
        # The backwards write dq (and dw) in place into buffers nothing initialises: one more (empty) kernel each.
        "sparse_mla_with_target_backward": (grad(with_target_loss, 2), (q, latent, indices), 3),
        "indexer_scores_with_backward": (grad(scores_loss, 3), (q_index, k_index, weights, q_seg, k_seg), 1),
        "indexer_topk": (topk, (q_index, k_index, weights, q_seg, k_seg), 1),
        # The top 128 of 2048 keys: the score kernel folds 512 bins' maxima on chip (binned_topk), as at 202,752
        # keys and N 2048 (4-D grid, VMEM accumulators, bins-major writes).
        "indexer_topk_binned": (functools.partial(topk, slots=128), (q_index, k_index, weights, q_seg, k_seg), 1),
        "sparse_attention_target": (sparse_target, (q, latent, indices, lse), 1),
        "dense_attention_target": (dense_target, (q, latent, q_seg, k_seg), 2),  # lse pass, probability pass
        "selected_scores_backward": (selected_scores_grad,
                                     (q_index, k_index, weights, indices, sds((b, s, shape.slots), jnp.float32)), 3),
    }


# Entry points whose kernels another one compiles (its declared cost is still read below).
COMPILED_ELSEWHERE = {"sparse_mla_with_target_forward"}
NAMES = sorted(set(entry_points(GLM5, jnp.bfloat16)) - COMPILED_ELSEWHERE)


def _params():
    # 3-60 s each (XLA's share: the indexer scores' jnp backward, top-k over [B, chunk, T], the d(latent)
    # scatter): all in the slow tier.
    for chip in CHIPS:
        for name in NAMES:
            yield pytest.param(chip, name, id=f"{chip}-glm5-bf16-{name}", marks=[pytest.mark.tpu_aot, pytest.mark.slow])


@pytest.mark.parametrize("chip,name", list(_params()))
def test_mosaic_kernel_compiles_for_tpu(chip, name):
    fn, args, kernels = entry_points(GLM5, jnp.bfloat16)[name]
    compiled = compile_for(fn, args, chip)
    vmem = mosaic_vmem_bytes(compiled)
    assert len(vmem) == kernels, vmem
    assert "triton" not in compiled.as_text()
    # 0 where XLA placed a small call's operands in VMEM already (no pipeline buffers needed).
    assert max(vmem) < SCOPED_VMEM_LIMIT, vmem


def _declared_costs(fn, args, chip: str) -> list[dict[str, int]]:
    """The `pl.CostEstimate` of each Mosaic kernel in `fn`'s lowered (not compiled) module that declares work
    (not the empty kernels of `pallas_kernels.uninitialized`)."""
    text = jax.jit(fn).trace(*on_chip(args, chip)).lower().as_text()
    costs = [{key: int(value) for key, value in re.findall(r"\\22(\w+)\\22:(\d+)", estimate)}
             for estimate in re.findall(r"cost_estimate\\22: \{(.*?)\}", text)]
    return [cost for cost in costs if any(cost.values())]


@pytest.mark.tpu_aot
def test_forward_with_target_declares_the_target_work():
    """The forward that writes the KL target declares the plain forward's cost plus the target's: per query and
    (padded head, slot) 2 FLOPs and one exp, and its fp32 output [B, S, N]."""
    points = entry_points(GLM5, jnp.bfloat16)
    (plain,), (fused,) = (_declared_costs(*points[name][:2], "v5p")
                          for name in ("sparse_mla_forward", "sparse_mla_with_target_forward"))
    scores = GLM5.batch * GLM5.q_len * GLM5.heads * GLM5.slots  # 64 heads: no head padding
    assert fused["flops"] - plain["flops"] == 2 * scores
    assert fused["transcendentals"] - plain["transcendentals"] == scores
    assert fused["bytes_accessed"] - plain["bytes_accessed"] == 4 * GLM5.batch * GLM5.q_len * GLM5.slots


@pytest.mark.tpu_aot
def test_causal_selection_declares_only_the_row_blocks_it_can_fill():
    """With cost_q_offset (queries at positions q_offset.. of a causal self-selection) the sparse MLA forward and
    backward and the KL's backward declare the rows, FLOPs and per-slot row gradients of `causal_row_blocks`
    instead of every block: their programs stop after the last block with a valid slot."""
    from pallas_kernels.dsa_cost import causal_row_blocks

    g, sds = GLM5, jax.ShapeDtypeStruct
    width, dtype = g.latent_dim + g.rope_dim, jnp.bfloat16
    q, latent = sds((g.batch, g.q_len, g.heads, width), dtype), sds((g.batch, g.k_len, width), dtype)
    q_index = sds((g.batch, g.q_len, g.index_heads, g.index_dim), dtype)
    k_index = sds((g.batch, g.k_len, g.index_dim), dtype)
    weights = sds((g.batch, g.q_len, g.index_heads), jnp.float32)
    d_scores = sds((g.batch, g.q_len, g.slots), jnp.float32)
    indices = jnp.zeros((g.batch, g.q_len, g.slots), jnp.int32)  # concrete: the functions trace the rest only
    offset = 64  # queries at positions 64..319 select at most 65..320 of the 2048 slots
    compiled = dict(block_n=g.block_n, bwd_query_chunk=g.q_len, platform="tpu", interpret=False)

    def attention_grad(cost_q_offset):
        attention = functools.partial(sparse_mla_attention, scale=width**-0.5, kv_lora_rank=g.latent_dim,
                                      cost_q_offset=cost_q_offset, **compiled)
        return jax.grad(lambda q, latent: jnp.sum(attention(q, latent, indices)[0].astype(jnp.float32)),
                        argnums=(0, 1))

    def kl_backward(cost_q_offset):
        return lambda q, k, w, g: selected_scores_backward(q, k, w, indices, g, cost_q_offset=cost_q_offset,
                                                           **compiled)

    every, causal = ([*_declared_costs(attention_grad(c), (q, latent), "v5p"),
                      *_declared_costs(kl_backward(c), (q_index, k_index, weights, d_scores), "v5p")]
                     for c in (None, offset))
    blocks = g.slots // g.block_n
    visited = causal_row_blocks(offset, g.q_len, g.slots, g.block_n)
    assert visited < g.q_len * blocks // 5  # a sixth of the blocks at most
    assert len(every) == len(causal) == 3  # the forward (for the backward's residuals), its backward, the KL's
    for full, fewer in zip(every, causal):
        assert fewer["flops"] == full["flops"] * visited // (g.q_len * blocks)
        assert fewer["bytes_accessed"] < full["bytes_accessed"] * 0.2
