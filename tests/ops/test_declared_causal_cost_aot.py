"""The model's sparse DSA stage tells the row-gathering TPU kernels where its queries sit, so their declared
cost (what `glm5 compile`'s roofline and XLA's scheduler see) counts only the row blocks a causal selection can
fill: the sparse MLA forward with the target, its backward and the KL's backward. Lowered for a v5p chip (libtpu
describes it; nothing compiled), the small model with N = 128 slots in blocks of 64 over 256 positions: the
first 64 queries fill at most 64 slots, one block of two."""

from __future__ import annotations

import json
import re

import jax
import jax.numpy as jnp
import pytest
from aot_compile import on_chip
from pallas_model import small_pallas_model

from glm5_jax.model.transformer import forward, init
from pallas_kernels.dsa_cost import causal_row_blocks

SEQ, TOPK, BLOCK_N = 256, 128, 64
MODEL = small_pallas_model("tpu", index_topk=TOPK, mtp_num_steps=0)


def _declared_costs(text: str) -> list[dict[str, int]]:
    """Each Mosaic kernel's `pl.CostEstimate` in a lowered module, in order."""
    return [{key: int(value) for key, value in re.findall(r"\\22(\w+)\\22:(\d+)", estimate)}
            for estimate in re.findall(r"cost_estimate\\22: \{(.*?)\}", text)]


@pytest.mark.tpu_aot
def test_sparse_stage_declares_the_blocks_a_causal_selection_fills():
    abstract = jax.eval_shape(lambda: init(MODEL, jax.random.key(0)))
    tokens = jax.ShapeDtypeStruct((1, SEQ), jnp.int32)

    def loss(params, tokens):
        out = forward(params, tokens, config=MODEL, indexer_mode="sparse")
        return jnp.mean(out.logits**2) + out.aux["indexer_kl_sum"].sum()

    text = jax.jit(jax.grad(loss)).trace(*on_chip((abstract, tokens), "v5p")).lower().as_text()
    costs = _declared_costs(text)
    # Per sparse layer: the top-k (no row blocks), the forward with the target, its backward, the KL's backward.
    assert len(costs) >= 4, json.dumps(costs)
    visited = causal_row_blocks(0, SEQ, TOPK, BLOCK_N)
    assert visited == 64 + (SEQ - 64) * 2  # of SEQ x 2
    heads = 16  # 2 heads padded to 16 on TPU; row width 16 + 4 -> 128 lanes, values 128
    forward_flops = visited * 2 * heads * BLOCK_N * (128 + 128)  # scores and values
    target_flops = visited * 2 * heads * BLOCK_N
    assert any(c["flops"] == forward_flops + target_flops for c in costs), json.dumps(costs)
    backward_flops = visited * 2 * heads * BLOCK_N * (3 * 128 + 2 * 128)
    assert any(c["flops"] == backward_flops for c in costs), json.dumps(costs)
    kl_backward_flops = visited * 3 * 2 * heads * BLOCK_N * 128  # indexer: 2 heads -> 16, J 8 -> 128 lanes
    assert any(c["flops"] == kl_backward_flops for c in costs), json.dumps(costs)
