"""The sparse stage's indexer KL multiplies the gathered bf16 index keys by the bf16 index queries with fp32
products and sums (`preferred_element_type`), never storing fp32 copies of the gathered keys or of their
gradient: values and gradients equal those of the upcast form it replaced."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from glm5_jax.model.indexer_kl import _kl, _selected_kl
from pallas_kernels.sparse_latent import gather_rows

B, S, T, N, I, J = 1, 16, 16, 6, 4, 32


def _upcast_kl(p, q_i, w_i, k_i, topk):
    """The form before: gathered keys and queries upcast to fp32, then multiplied."""
    keys = gather_rows(k_i, topk).astype(jnp.float32)
    logits = jnp.einsum("BSNJ,BSIJ->BSNI", keys, q_i.astype(jnp.float32))
    scores = jnp.einsum("BSI,BSNI->BSN", w_i, jax.nn.relu(logits * J**-0.5))
    return _kl(p, scores, topk >= 0)


def _inputs():
    keys = jax.random.split(jax.random.key(0), 5)
    q_i = jax.random.normal(keys[0], (B, S, I, J)).astype(jnp.bfloat16)
    k_i = jax.random.normal(keys[1], (B, T, J)).astype(jnp.bfloat16)
    w_i = jax.random.normal(keys[2], (B, S, I), jnp.float32)
    topk = jax.random.randint(keys[3], (B, S, N), -1, T).astype(jnp.int32)
    p = jax.nn.softmax(jax.random.normal(keys[4], (B, S, N)), axis=-1) * (topk >= 0)
    return p, q_i, w_i, k_i, topk


def test_bf16_selected_kl_equals_the_upcast_form_in_value_and_gradients():
    p, q_i, w_i, k_i, topk = _inputs()

    def total(fn):
        return lambda q, w, k: fn(p, q, w, k, topk).sum()

    new = jax.value_and_grad(total(lambda p, q, w, k, t: _selected_kl(p, q, w, k, t, 8)), argnums=(0, 1, 2))
    old = jax.value_and_grad(total(_upcast_kl), argnums=(0, 1, 2))
    (value, grads), (ref_value, ref_grads) = new(q_i, w_i, k_i), old(q_i, w_i, k_i)
    assert float(ref_value) > 0
    np.testing.assert_allclose(value, ref_value, rtol=1e-5)
    for name, g, r in zip(("q_i", "w_i", "k_i"), grads, ref_grads):
        assert g.dtype == r.dtype, name
        scale = float(jnp.abs(r.astype(jnp.float32)).max())
        assert scale > 0, name
        np.testing.assert_allclose(np.asarray(g, np.float32), np.asarray(r, np.float32), atol=1e-2 * scale,
                                   rtol=1e-2, err_msg=name)


def test_the_gathered_keys_are_multiplied_in_bf16():
    """The KL's jaxpr holds the gathered keys [B, c, N, J] in bf16 only: no fp32 copy feeds the products. (The
    gradient's transposed product returns fp32 and is converted to the keys' bf16, which XLA:TPU fuses into the
    product: `convolution_convert_fusion` in the compiled pod step.)"""
    p, q_i, w_i, k_i, topk = _inputs()
    text = str(jax.make_jaxpr(lambda q, k: _selected_kl(p, q, w_i, k, topk, 8))(q_i, k_i))
    assert f"bf16[{B},8,{N},{J}]" in text
    assert f"f32[{B},8,{N},{J}]" not in text
