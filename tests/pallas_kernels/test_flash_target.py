"""The indexer KL's dense target from the flash kernel's own statistics (`causal_flash_attention_with_target`:
the Mosaic flash forward, then `tpu_flash_target` over its operands and log-sum-exp; TPU interpret mode on
CPU) equals the head mean of the masked softmax, with packed segments, a sequence that is not a block multiple,
heads in several groups and a head dim that is not a lane multiple; the attention output and its gradients are
the flash kernel's; the declared cost counts the tiles on or below the diagonal."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels.flash_attention import causal_flash_attention_with_target
from pallas_kernels.reference import causal_flash_attention_with_target_reference
from pallas_kernels.tpu_flash_target import flash_target_cost


@pytest.mark.slow  # ~10 s of TPU interpret mode
def test_target_and_attention_equal_the_masked_softmax():
    # 300 tokens pad to 384: 3 blocks of 128 (3 x 3 tiles, 6 on or below the diagonal); 8 heads in 2 groups.
    b, s, h, k_dim, p_dim, scale = 2, 300, 8, 48, 32, 0.3
    keys = jax.random.split(jax.random.key(1), 4)
    q, k = (2 * jax.random.normal(key, (b, s, h, k_dim), jnp.float32) for key in keys[:2])
    v = jax.random.normal(keys[2], (b, s, h, p_dim), jnp.float32)
    segment_ids = jnp.array([[1] * 100 + [2] * 150 + [3] * 50, [4] * 300])
    cotangent = jax.random.normal(keys[3], (b, s, h, p_dim), jnp.float32)

    kernel = jax.jit(lambda q, k, v: causal_flash_attention_with_target(q, k, v, segment_ids, scale=scale,
                                                                        interpret=True, platform="tpu"))
    reference = lambda q, k, v: causal_flash_attention_with_target_reference(  # noqa: E731
        q, k, v, segment_ids, scale=scale)
    (out, target), (want_out, want_target) = kernel(q, k, v), reference(q, k, v)
    np.testing.assert_allclose(out, want_out, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(target, want_target, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(target.sum(-1), 1.0, rtol=1e-5)  # every row a distribution over its visible keys
    assert float(target[0, 120, 99]) == 0.0 and float(target[0, 120, 121]) == 0.0  # another segment, the future

    def loss(attention):  # the target is a constant: gradients are the attention's alone
        return lambda q, k, v: jnp.sum(attention(q, k, v)[0] * cotangent) + jnp.sum(attention(q, k, v)[1])

    got = jax.jit(jax.grad(loss(kernel), argnums=(0, 1, 2)))(q, k, v)
    want = jax.grad(loss(lambda q, k, v: (reference(q, k, v)[0], jax.lax.stop_gradient(reference(q, k, v)[1]))),
                    argnums=(0, 1, 2))(q, k, v)
    for name, g, w in zip("qkv", got, want):
        np.testing.assert_allclose(g, w, rtol=1e-5, atol=3e-5, err_msg=name)


def test_gpu_platform_is_refused_by_name():
    x = jnp.zeros((1, 128, 4, 8))
    with pytest.raises(ValueError, match="Mosaic"):
        causal_flash_attention_with_target(x, x, x, jnp.zeros((1, 128), jnp.int32), scale=1.0, platform="gpu")


def test_declared_cost_counts_the_tiles_on_or_below_the_diagonal():
    flops, accessed, exps = flash_target_cost(batch=1, heads=8, length=1024, dim=256, block=256, itemsize=2)
    tiles = 4 * 5 // 2
    assert flops == tiles * 8 * 2 * 256 * 256 * 256 and exps == tiles * 8 * 256 * 256
    assert accessed == tiles * (8 * (2 * 256 * 256 * 2 + 256 * 4) + 2 * 256 * 4) + 1024 * 1024 * 4
