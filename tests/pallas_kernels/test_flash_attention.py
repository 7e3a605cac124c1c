"""Causal flash attention over every visible key (the project's Mosaic flash kernels behind
`pallas_kernels.flash_attention`, TPU interpret mode on CPU; jax's Triton ones, Pallas's interpret mode) equals
the masked softmax attention: values and the gradients in q, k and v, with packed segments, head dims that are
not lane multiples (nor equal, nor powers of two) and a sequence that is not a block multiple; and its declared
costs count the key blocks it computes and re-reads."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels.flash_attention import causal_flash_attention
from pallas_kernels.gpu_flash_attention import TritonFlashPlan, triton_flash_plan
from pallas_kernels.reference import causal_flash_attention_reference
from pallas_kernels import tpu_flash_attention
from pallas_kernels.tpu_flash_attention import flash_backward, flash_costs, flash_forward, fused_backward


@pytest.mark.parametrize("platform", [pytest.param("tpu", marks=pytest.mark.slow),  # ~9 s of TPU interpret mode
                                      "gpu"])
def test_values_and_gradients_equal_the_masked_attention(platform):
    # Padded to 384 tokens: on TPU 3 blocks of 128, dims to 128; on GPU 3 query blocks of 128 (6 key blocks of
    # 64, 6 backward blocks of 64), q, k and v to one head dim of 24.
    b, s, h, k_dim, p_dim, scale = 2, 300, 3, 24, 16, 0.2
    keys = jax.random.split(jax.random.key(0), 4)
    q, k = (jax.random.normal(key, (b, s, h, k_dim), jnp.float32) for key in keys[:2])
    v = jax.random.normal(keys[2], (b, s, h, p_dim), jnp.float32)
    segment_ids = jnp.array([[1] * 140 + [2] * 160, [1] * 300])
    cotangent = jax.random.normal(keys[3], (b, s, h, p_dim), jnp.float32)

    def loss(attention):
        return lambda q, k, v: jnp.sum(attention(q, k, v) * cotangent)

    flash = jax.jit(lambda q, k, v: causal_flash_attention(q, k, v, segment_ids, scale=scale, interpret=True,
                                                           platform=platform))
    reference = lambda q, k, v: causal_flash_attention_reference(q, k, v, segment_ids, scale=scale)  # noqa: E731
    np.testing.assert_allclose(flash(q, k, v), reference(q, k, v), rtol=1e-5, atol=1e-5)
    got = jax.jit(jax.grad(loss(flash), argnums=(0, 1, 2)))(q, k, v)
    want = jax.grad(loss(reference), argnums=(0, 1, 2))(q, k, v)
    for name, g, w in zip("qkv", got, want):
        assert np.abs(np.asarray(w)).max() > 0, name
        np.testing.assert_allclose(g, w, rtol=1e-5, atol=1e-5, err_msg=name)


def test_declared_costs_count_the_computed_and_reread_key_blocks():
    costs = flash_costs(batch=1, heads=2, length=1024, dim=256, block=256, itemsize=2)
    pairs = 2 * 4 * 5 // 2  # per head, the block pairs on or below the diagonal of 4 x 4 blocks
    pair = 2 * 256 * 256 * 256  # one [256, D] x [D, 256] product
    tile = 256 * 256 * 2  # one [256, D] bf16 block
    whole = 2 * 1024 * 256 * 2  # one [B, H, L, D] bf16 array
    stats = 2 * 1024 * 4  # one row of fp32 statistics per (head, query)
    # The forward streams k and v past each query block and reads q, writes o and the lse once.
    assert costs["forward"] == (2 * pairs * pair, 2 * pairs * tile + 2 * whole + stats, pairs * 256 * 256)
    # dk/dv: q and do streamed past each key block, with their lse and di rows; k, v read and dk, dv written.
    assert costs["dkv"] == (4 * pairs * pair, 2 * pairs * tile + 2 * pairs * 256 * 4 + 4 * whole, pairs * 256 * 256)
    # dq: k and v streamed past each query block; q, do, lse, di read and dq written once.
    assert costs["dq"] == (3 * pairs * pair, 2 * pairs * tile + 3 * whole + 2 * stats, pairs * 256 * 256)
    # One kernel for all three: dk/dv's steps with dq's product added, dq written once.
    assert costs["fused_backward"] == (5 * pairs * pair, costs["dkv"][1] + whole, pairs * 256 * 256)


def test_the_fused_backward_equals_the_two_kernels(monkeypatch):
    """One head's dq summed in VMEM by the dk/dv kernel's steps: the same dq, dk and dv as the dk/dv and dq
    kernels (the same products, dq summed over the key blocks in the same order), with two segments and padding."""
    b, h, length, dim, block = 1, 2, 384, 128, 128
    keys = jax.random.split(jax.random.key(1), 4)
    q, k, v, d_out = (jax.random.normal(key, (b, h, length, dim), jnp.float32) for key in keys)
    segments = jnp.array([[1] * 150 + [2] * 200 + [-1] * 34], jnp.int32)
    out, lse = flash_forward(q, k, v, segments, scale=0.3, block=block, interpret=True)
    di = jnp.einsum("BHLD,BHLD->BHL", out, d_out)
    assert fused_backward(length, dim) and not fused_backward(4096, 512)
    fused = flash_backward(q, k, v, segments, lse, d_out, di, scale=0.3, block=block, interpret=True)
    monkeypatch.setattr(tpu_flash_attention, "FUSED_DQ_BYTES", 0)
    assert not fused_backward(length, dim)
    separate = flash_backward(q, k, v, segments, lse, d_out, di, scale=0.3, block=block, interpret=True)
    for name, got, want in zip(("dq", "dk", "dv"), fused, separate):
        assert np.abs(np.asarray(want)).max() > 0, name
        np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-6, err_msg=name)


def test_triton_declared_costs_count_the_visited_blocks():
    plan = TritonFlashPlan(batch=1, heads=2, length=512, dim=192, itemsize=2, block_q=128, block_k=64, stages=2,
                           block_bwd=64)
    assert plan.dim_padded == 256  # the kernels' dots run at the next power of two
    assert plan.forward_key_blocks() == 2 * (1 + 2 + 3 + 4)  # query block i visits 2 (i + 1) key blocks of 64
    flops, accessed, exps = plan.forward_cost()
    assert flops == 2 * 20 * 2 * (2 * 128 * 64 * 256) and exps == 2 * 20 * 128 * 64
    assert accessed == 2 * (2 * 20 * 64 * 192 * 2) + 2 * (2 * 512 * 192 * 2) + 2 * 512 * 4
    assert plan.backward_pairs() == 8 * 9 // 2
    assert plan.backward_cost()[0] == 2 * 36 * 7 * 2 * 64 * 64 * 256


def test_triton_blocks_fit_the_gpus_shared_memory():
    h100 = 232448  # bytes per block (opt-in) of H100 and H200
    glm5 = triton_flash_plan(1, 4096, 64, 256, 2, h100)  # bf16: the blocks AOT-compiled for H100 in test_gpu_compile
    assert (glm5.block_q, glm5.block_k, glm5.stages, glm5.block_bwd, glm5.length) == (128, 64, 2, 64, 4096)
    fp32 = triton_flash_plan(1, 4096, 64, 256, 4, h100)
    assert (fp32.block_q, fp32.block_k, fp32.stages, fp32.block_bwd) == (64, 64, 1, 32)
    short = triton_flash_plan(2, 10, 4, 12, 4, h100)  # blocks no larger than the sequence: 16 tokens, not 128
    assert (short.block_q, short.block_k, short.block_bwd, short.length) == (16, 16, 16, 16)
    odd = triton_flash_plan(1, 300, 4, 24, 4, h100)
    assert odd.length == 384 and odd.length % odd.block_bwd == 0


@pytest.mark.parametrize("bad, match", [
    (dict(k=jnp.zeros((1, 8, 2, 4))), "k.shape"),
    (dict(segment_ids=jnp.zeros((1, 7), jnp.int32)), "segment_ids.shape"),
    (dict(v=jnp.zeros((1, 8, 2), jnp.float32)), "v must have rank 4"),
    (dict(platform="cuda"), "platform must be one of"),
])
def test_bad_shapes_are_refused_by_name(bad, match):
    args = dict(q=jnp.zeros((1, 8, 2, 6)), k=jnp.zeros((1, 8, 2, 6)), v=jnp.zeros((1, 8, 2, 4)),
                segment_ids=jnp.ones((1, 8), jnp.int32), platform="tpu") | bad
    with pytest.raises(ValueError, match=match):
        causal_flash_attention(**args, scale=1.0, interpret=True)
