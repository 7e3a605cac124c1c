"""The model's sparse DSA stage tells the row-gathering kernels where its queries sit, so their declared cost
(what `glm5 compile`'s roofline and XLA's scheduler see) counts only the row blocks a causal selection can fill:
on TPU the sparse MLA forward with the target, its backward and the KL's backward; on GPU (Triton) the sparse MLA
forward, the target kernel and the backward. Lowered for a v5p chip (libtpu describes it) and for an H100 (the
CUDA plugin describes it), nothing compiled: the small model with N = 128 slots in blocks of 64 over 256
positions, whose first 64 queries fill at most 64 slots, one block of two."""

from __future__ import annotations

import dataclasses
import json
import re

import jax
import jax.numpy as jnp
import pytest
from aot_compile import on_chip
from gpu_compile import lower_for, require_cuda_plugin
from pallas_model import small_pallas_model

from glm5_jax.model.transformer import forward, init
from pallas_kernels.dsa_cost import causal_row_blocks

SEQ, TOPK, BLOCK_N = 256, 128, 64
MODEL = small_pallas_model("tpu", index_topk=TOPK, mtp_num_steps=0)
VISITED = causal_row_blocks(0, SEQ, TOPK, BLOCK_N)


def _declared_costs(text: str) -> list[dict[str, int]]:
    """Each Mosaic kernel's `pl.CostEstimate` in a lowered module, in order."""
    return [{key: int(value) for key, value in re.findall(r"\\22(\w+)\\22:(\d+)", estimate)}
            for estimate in re.findall(r"cost_estimate\\22: \{(.*?)\}", text)]


def _sparse_stage_gradient(model):
    """(gradient of a loss over the sparse stage's logits and indexer KL, its abstract arguments)."""
    abstract = jax.eval_shape(lambda: init(model, jax.random.key(0)))
    tokens = jax.ShapeDtypeStruct((1, SEQ), jnp.int32)

    def loss(params, tokens):
        out = forward(params, tokens, config=model, indexer_mode="sparse")
        return jnp.mean(out.logits**2) + out.aux["indexer_kl_sum"].sum()

    return jax.grad(loss), (abstract, tokens)


@pytest.mark.tpu_aot
def test_sparse_stage_declares_the_blocks_a_causal_selection_fills():
    grad, args = _sparse_stage_gradient(MODEL)
    costs = _declared_costs(jax.jit(grad).trace(*on_chip(args, "v5p")).lower().as_text())
    # Per sparse layer: the top-k (no row blocks), the forward with the target, its backward, the KL's backward.
    assert len(costs) >= 4, json.dumps(costs)
    assert VISITED == 64 + (SEQ - 64) * 2  # of SEQ x 2
    heads = 16  # 2 heads padded to 16 on TPU; row width 16 + 4 -> 128 lanes, values 128
    forward_flops = VISITED * 2 * heads * BLOCK_N * (128 + 128)  # scores and values
    target_flops = VISITED * 2 * heads * BLOCK_N
    assert any(c["flops"] == forward_flops + target_flops for c in costs), json.dumps(costs)
    backward_flops = VISITED * 2 * heads * BLOCK_N * (3 * 128 + 2 * 128)
    assert any(c["flops"] == backward_flops for c in costs), json.dumps(costs)
    kl_backward_flops = VISITED * 3 * 2 * heads * BLOCK_N * 128  # indexer: 2 heads -> 16, J 8 -> 128 lanes
    assert any(c["flops"] == kl_backward_flops for c in costs), json.dumps(costs)


@pytest.mark.gpu_aot
def test_triton_sparse_stage_declares_the_blocks_a_causal_selection_fills():
    require_cuda_plugin()
    grad, args = _sparse_stage_gradient(dataclasses.replace(MODEL, pallas_platform="gpu"))
    text = lower_for(grad, args, "h100").as_text()
    costs = [{key: int(value) for key, value in re.findall(r"pallas_(\w+) = \"(\d+)\"", attributes)}
             for attributes in re.findall(r"frontend_attributes = \{([^}]*pallas_flops[^}]*)\}", text)]
    heads, values = 16, 16  # 2 heads -> 16; the row's latent part 16 and rope part 4 -> 16 each for Triton
    width = values + 16
    per_block = 2 * heads * BLOCK_N
    expected = {"forward": VISITED * per_block * (width + values),  # scores and values
                "target": VISITED * per_block * width,  # scores
                "backward": VISITED * per_block * (3 * width + 2 * values)}
    flops = [c["flops"] for c in costs]
    for kernel, want in expected.items():
        assert want in flops, (kernel, want, json.dumps(costs))
    assert all(c["transcendentals"] in (0, VISITED * heads * BLOCK_N) for c in costs), json.dumps(costs)
