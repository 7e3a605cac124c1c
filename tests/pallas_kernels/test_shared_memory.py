"""Triton block sizes and pipeline stages fitted to the GPU's shared memory (`pallas_kernels/shared_memory.py`):
the choices at GLM-5's shapes, and the kernels' numerics (interpret mode) when a tiny limit forces the smallest
blocks and the most column parts of the sparse MLA backward, paths the regular tests' small shapes never take."""

import dataclasses

import jax
import numpy as np
import pytest

from pallas_kernels import (
    dense_attention_target,
    indexer_scores,
    shared_memory,
    sparse_attention_target,
    sparse_mla_attention,
)
from pallas_kernels.gpu_targets import GPU_TARGETS, gpu_target_config
from pallas_kernels.mla_layout import SPARSE_MLA_FORWARD_STAGES, MlaLayout, backward_plan, gather_kernel_plan
from pallas_kernels.reference import (
    dense_attention_target_reference,
    indexer_scores_reference,
    sparse_attention_target_reference,
    sparse_mla_attention_reference,
)
from pallas_kernels.shared_memory import SCRATCH_BYTES, fit_block_and_stages

GLM5 = MlaLayout(heads=64, latent_dim=512, rope_dim=64, num_slots=2048, block_n=64)
TOLERANCE = dict(rtol=2e-5, atol=2e-5)


def test_h100_and_h200_allow_227_kib_per_block():
    assert [shared_memory.shared_memory_limit(target) for target in GPU_TARGETS] == [232448, 232448]


def test_unknown_gpu_target_is_rejected():
    with pytest.raises(ValueError, match="h100"):
        gpu_target_config("a100")


def test_fit_takes_the_largest_block_then_the_most_stages():
    footprint = lambda block, stages: 1000 + stages * block * 10  # noqa: E731
    two_stages_of_64 = SCRATCH_BYTES + footprint(64, 2)
    assert fit_block_and_stages(64, footprint, limit=two_stages_of_64) == (64, 2)
    assert fit_block_and_stages(128, footprint, limit=two_stages_of_64) == (128, 1)  # 1280 bytes per stage
    assert fit_block_and_stages(256, footprint, limit=two_stages_of_64) == (128, 1)
    assert fit_block_and_stages(64, footprint, limit=10**9) == (64, shared_memory.MAX_STAGES)
    assert fit_block_and_stages(64, footprint, limit=0) == (16, 1)  # nothing fits: the compiler reports it


def test_glm5_choices_on_hopper():
    """bf16: the asked-for block with two stages, and the backward in two column parts (one needs 272 KiB),
    its block of 128 halved; fp32: the row block halves to fit a single stage."""
    assert gather_kernel_plan(GLM5, 2) == (64, 2)
    assert gather_kernel_plan(GLM5, 4) == (32, 1)
    # The sparse MLA forward runs at one stage (timed faster on an H200); its block is what fits one stage.
    assert gather_kernel_plan(GLM5, 2, max_stages=SPARSE_MLA_FORWARD_STAGES) == (64, 1)
    assert gather_kernel_plan(dataclasses.replace(GLM5, block_n=128), 2, max_stages=1) == (128, 1)
    assert backward_plan(GLM5, 2) == (64, 2)
    assert backward_plan(dataclasses.replace(GLM5, block_n=128), 2) == (64, 2)
    # A forward block of 32 keeps the backward at 64: below it Triton holds the resident tiles twice (308 KiB).
    assert backward_plan(dataclasses.replace(GLM5, block_n=32), 2) == (64, 2)


@pytest.fixture
def no_shared_memory(monkeypatch):
    monkeypatch.setattr(shared_memory, "shared_memory_limit", lambda target=None: 0)


def test_sparse_attention_with_smallest_blocks_and_most_column_parts(no_shared_memory):
    """block_n 32 asked, 16 used; C = 64 in four column parts of 16 in the backward."""
    batch, q_len, num_keys, heads, c_dim, r_dim, slots = 1, 5, 24, 4, 64, 8, 40
    layout = MlaLayout(heads, c_dim, r_dim, slots, 32)
    assert gather_kernel_plan(layout, 4) == (16, 1) and backward_plan(layout, 4) == (16, 4)
    keys = jax.random.split(jax.random.key(3), 5)
    q = jax.random.normal(keys[0], (batch, q_len, heads, c_dim + r_dim))
    latent = jax.random.normal(keys[1], (batch, num_keys, c_dim + r_dim))
    indices = jax.random.randint(keys[2], (batch, q_len, slots), -1, num_keys)
    d_out = jax.random.normal(keys[3], (batch, q_len, heads, c_dim))
    d_lse = jax.random.normal(keys[4], (batch, q_len, heads))

    @jax.jit
    def run(q, latent):
        results = []
        for fn in (sparse_mla_attention, sparse_mla_attention_reference):
            attend = lambda q_, l_: fn(q_, l_, indices, scale=0.2, kv_lora_rank=c_dim, block_n=32)  # noqa: B023,E731
            (out, lse), vjp = jax.vjp(attend, q, latent)
            target = sparse_attention_target if fn is sparse_mla_attention else sparse_attention_target_reference
            results.append((out, lse, *vjp((d_out, d_lse)), target(q, latent, indices, lse, scale=0.2, block_n=32)))
        return results

    kernel, reference = run(q, latent)
    for got, want in zip(kernel, reference):
        np.testing.assert_allclose(got, want, **TOLERANCE)


def test_dense_target_and_indexer_scores_with_smallest_key_blocks(no_shared_memory):
    """block_t 64 asked, 16 used: more key blocks of the online lse and of the score tiles."""
    keys = jax.random.split(jax.random.key(4), 5)
    q, latent = jax.random.normal(keys[0], (1, 7, 2, 40)), jax.random.normal(keys[1], (1, 37, 40))
    q_index, k_index = jax.random.normal(keys[2], (1, 7, 3, 16)), jax.random.normal(keys[3], (1, 37, 16))
    weights = jax.random.normal(keys[4], (1, 7, 3))

    @jax.jit
    def run(q, latent, q_index, k_index, weights):
        return ((dense_attention_target(q, latent, scale=0.2, q_offset=30, block_t=64),
                 dense_attention_target_reference(q, latent, scale=0.2, q_offset=30)),
                (indexer_scores(q_index, k_index, weights, q_offset=30, block_t=64),
                 indexer_scores_reference(q_index, k_index, weights, q_offset=30)))

    for got, want in run(q, latent, q_index, k_index, weights):
        np.testing.assert_allclose(got, want, **TOLERANCE)
