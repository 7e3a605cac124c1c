"""The `pallas` attention backend (kernels in interpret mode on CPU) equals the `sparse` backend for the whole
model: loss and gradients, in plain training and in both DSA indexer-KL modes, on the Triton kernels and, for the
sparse DSA stage (whose KL target the TPU attention forward writes itself), on the Mosaic ones."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from glm5_jax.config import ConfigError, ModelConfig
from glm5_jax.model.transformer import forward, init

CONFIG = ModelConfig(vocab_size=64, hidden_size=32, intermediate_size=48, moe_intermediate_size=16,
                     num_hidden_layers=2, num_attention_heads=2, q_lora_rank=16, kv_lora_rank=16,
                     qk_nope_head_dim=8, qk_rope_head_dim=4, v_head_dim=8, n_routed_experts=4,
                     num_experts_per_tok=2, first_k_dense_replace=1, index_n_heads=2, index_head_dim=8,
                     index_topk=4, mtp_num_steps=1, compute_dtype="float32", moe_backend="ragged").validate()


@pytest.mark.slow
@pytest.mark.parametrize("indexer_mode", [None, "sparse", "dense_warmup"])
def test_pallas_backend_matches_sparse_in_loss_and_gradients(indexer_mode):
    params = init(CONFIG, jax.random.key(0))
    tokens = jax.random.randint(jax.random.key(1), (1, 10), 0, CONFIG.vocab_size)
    segment_ids = jnp.array([[1] * 6 + [2] * 4])

    def loss(p, backend):
        out = forward(p, tokens, config=dataclasses.replace(CONFIG, attention_backend=backend),
                      segment_ids=segment_ids, indexer_mode=indexer_mode)
        value = jnp.mean(out.logits ** 2) + jnp.mean(out.mtp_logits ** 2)
        if indexer_mode is not None:
            value += out.aux["indexer_kl_sum"].sum()
        return value

    grad_fn = jax.jit(jax.value_and_grad(loss), static_argnums=1)
    ref_value, ref_grads = grad_fn(params, "sparse")
    value, grads = grad_fn(params, "pallas")
    np.testing.assert_allclose(value, ref_value, rtol=1e-4, atol=1e-6)
    for (path, g), r in zip(jax.tree_util.tree_flatten_with_path(grads)[0], jax.tree.leaves(ref_grads)):
        np.testing.assert_allclose(g, r, atol=2e-6, rtol=1e-4, err_msg=jax.tree_util.keystr(path))


@pytest.mark.slow
def test_tpu_kernels_keep_the_sparse_dsa_loss(monkeypatch):
    """The sparse stage on the Mosaic kernels (TPU interpret mode), the target from the attention's own forward:
    loss with the indexer KL, and gradients, equal the sparse backend's (which takes its target from the jnp
    attention). No remat here: TPU interpret mode's host callbacks do not go through `checkpoint`."""
    config = CONFIG
    params = init(config, jax.random.key(0))
    tokens = jax.random.randint(jax.random.key(1), (1, 10), 0, config.vocab_size)
    segment_ids = jnp.array([[1] * 6 + [2] * 4])

    def loss(p, backend):
        out = forward(p, tokens, config=dataclasses.replace(config, attention_backend=backend),
                      segment_ids=segment_ids, indexer_mode="sparse")
        return jnp.mean(out.logits ** 2) + out.aux["indexer_kl_sum"].sum(), out.aux["indexer_kl_sum"]

    grad_fn = jax.jit(jax.value_and_grad(loss, has_aux=True), static_argnums=1)
    (ref_value, ref_kl), ref_grads = grad_fn(params, "sparse")
    monkeypatch.setattr(ModelConfig, "pallas_options", property(lambda _: dict(platform="tpu", interpret=True)))
    (value, kl), grads = grad_fn(params, "pallas")
    assert np.all(np.asarray(ref_kl) > 0)
    np.testing.assert_allclose(kl, ref_kl, rtol=1e-4, atol=1e-6)
    np.testing.assert_allclose(value, ref_value, rtol=1e-4, atol=1e-6)
    for (path, g), r in zip(jax.tree_util.tree_flatten_with_path(grads)[0], jax.tree.leaves(ref_grads)):
        np.testing.assert_allclose(g, r, atol=2e-6, rtol=1e-4, err_msg=jax.tree_util.keystr(path))


def test_pallas_platform_is_validated():
    pallas = dataclasses.replace(CONFIG, attention_backend="pallas", pallas_platform="tpu").validate()
    valid = r"must be one of \('auto', 'gpu', 'tpu'\)"
    with pytest.raises(ConfigError, match=r"pallas_platform='cuda' is invalid: " + valid):
        dataclasses.replace(pallas, pallas_platform="cuda").validate()
    assert pallas.pallas_options == dict(platform="tpu", interpret=False)
    assert dataclasses.replace(pallas, pallas_platform="auto").pallas_options == {}
