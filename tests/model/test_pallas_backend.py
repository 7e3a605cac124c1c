"""The `pallas` attention backend (kernels in interpret mode on CPU) equals the `sparse` backend for the whole
model: loss and gradients, in plain training and in the DSA warm-up stage (whose attention over every key is
the Triton flash attention), on the Triton kernels; and where the top-k keeps every key, on both platforms'
flash attention. The sparse DSA stage on the Triton and Mosaic kernels is checked against the jnp path in
tests/model/test_indexer_kl.py."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from pallas_model import small_pallas_model

from glm5_jax.config import ConfigError
from glm5_jax.model.transformer import forward, init

CONFIG = small_pallas_model(compute_dtype="float32", moe_backend="ragged", attention_backend="sparse")


@pytest.mark.slow
# The sparse DSA stage, on the Triton and the Mosaic kernels against the jnp path, is in test_indexer_kl.py.
@pytest.mark.parametrize("indexer_mode", [None, "dense_warmup"])
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


def test_pallas_platform_is_validated():
    pallas = dataclasses.replace(CONFIG, attention_backend="pallas", pallas_platform="tpu").validate()
    valid = r"must be one of \('auto', 'gpu', 'tpu'\)"
    with pytest.raises(ConfigError, match=r"pallas_platform='cuda' is invalid: " + valid):
        dataclasses.replace(pallas, pallas_platform="cuda").validate()
    assert pallas.pallas_options == dict(platform="tpu", interpret=False)
    assert dataclasses.replace(pallas, pallas_platform="auto").pallas_options == {}
    with pytest.raises(ConfigError, match=r"sparse_row_gradients='atomic' is invalid: the TPU kernels scatter"):
        dataclasses.replace(pallas, sparse_row_gradients="atomic").validate()
    with pytest.raises(ConfigError, match=r"sparse_row_gradients='sorted' is invalid: must be one of"):
        dataclasses.replace(pallas, sparse_row_gradients="sorted").validate()
    from glm5_jax.config import core
    from pallas_kernels import sparse_mla

    assert core.ROW_GRADIENTS == sparse_mla.ROW_GRADIENTS


@pytest.mark.parametrize("indexer_mode", [None, "sparse"])
def test_the_row_gradient_mode_reaches_the_sparse_kernels(indexer_mode, monkeypatch):
    """`model.sparse_row_gradients` is what the Triton sparse MLA backward is asked for, in plain training and in
    the sparse DSA stage (its numerics: tests/pallas_kernels/test_sparse_mla.py)."""
    from glm5_jax.ops import sparse_attention

    asked = []
    for name in ("sparse_mla_attention", "sparse_mla_attention_with_target"):
        kernel = getattr(sparse_attention, name)
        monkeypatch.setattr(sparse_attention, name,
                            lambda *a, _kernel=kernel, **k: asked.append(k["row_gradients"]) or _kernel(*a, **k))
    config = dataclasses.replace(CONFIG, attention_backend="pallas", sparse_row_gradients="atomic").validate()
    tokens = jax.random.randint(jax.random.key(1), (1, 10), 0, config.vocab_size)
    jax.make_jaxpr(lambda p: forward(p, tokens, config=config, indexer_mode=indexer_mode).logits)(
        init(config, jax.random.key(0)))
    assert asked and set(asked) == {"atomic"}, asked


@pytest.fixture(scope="module")
def ranked_references():
    """The jnp sparse backend's loss and gradients by indexer mode: computed once for the platforms that share
    them."""
    return {}


@pytest.mark.slow
# The Triton path's dense warm-up (flash and the dense target) is test_pallas_backend_matches_sparse's.
@pytest.mark.parametrize("platform, indexer_mode", [("tpu", None), ("tpu", "dense_warmup"), ("tpu", "sparse"),
                                                    ("gpu", "sparse")])
def test_kernels_attend_by_flash_where_the_top_k_keeps_every_key(platform, indexer_mode, monkeypatch,
                                                                 plain_tpu_interpret, ranked_references):
    """T <= index_topk: the kernels run flash attention over every visible key (expanded form; Mosaic on
    TPU, Triton on GPU) and, in the DSA stages, the dense KL target (on TPU from the flash forward's statistics,
    `tpu_flash_target`; on GPU the latent-row kernel) instead of the sparse MLA kernel, and no
    top-k (the sparse stage's KL over every visible key); loss and gradients, the indexer's included, equal the
    jnp sparse backend's, which ranks them (plain interpret mode: the kernels' own tests run the Mosaic ones in
    TPU interpret mode)."""
    from glm5_jax.config import ModelConfig
    from glm5_jax.model import indexer
    from glm5_jax.ops import causal_attention

    config = dataclasses.replace(CONFIG, index_topk=16)
    params = init(config, jax.random.key(0))
    tokens = jax.random.randint(jax.random.key(1), (1, 10), 0, config.vocab_size)
    segment_ids = jnp.array([[1] * 6 + [2] * 4])
    flash_calls, topk_calls, latent_target_calls = [], [], []
    for name, calls in (("causal_flash_attention", flash_calls), ("causal_flash_attention_with_target", flash_calls),
                        ("dense_attention_target", latent_target_calls)):
        kernel = getattr(causal_attention, name)
        monkeypatch.setattr(causal_attention, name,
                            lambda *a, _calls=calls, _kernel=kernel, **k: _calls.append(1) or _kernel(*a, **k))
    topk = indexer.indexer_topk_with_scores
    monkeypatch.setattr(indexer, "indexer_topk_with_scores", lambda *a, **k: topk_calls.append(1) or topk(*a, **k))

    def loss(p, backend):
        out = forward(p, tokens, config=dataclasses.replace(config, attention_backend=backend),
                      segment_ids=segment_ids, indexer_mode=indexer_mode)
        value = jnp.mean(out.logits ** 2) + jnp.mean(out.mtp_logits ** 2)
        return value + out.aux["indexer_kl_sum"].sum() if indexer_mode is not None else value

    grad_fn = jax.jit(jax.value_and_grad(loss), static_argnums=1)
    if indexer_mode not in ranked_references:
        ranked_references[indexer_mode] = grad_fn(params, "sparse")
        assert not flash_calls and topk_calls
    ref_value, ref_grads = ranked_references[indexer_mode]
    topk_calls.clear()
    monkeypatch.setattr(ModelConfig, "pallas_options", property(lambda _: dict(platform=platform, interpret=True)))
    value, grads = grad_fn(params, "pallas")
    assert flash_calls  # every layer and the MTP step attended through it
    # The Mosaic path takes the DSA stages' target from the flash kernel's statistics, the Triton one from the
    # latent rows.
    assert bool(latent_target_calls) == (platform == "gpu" and indexer_mode is not None)
    assert not topk_calls  # and none ranked keys it would all keep, nor saved a selection for the backward
    np.testing.assert_allclose(value, ref_value, rtol=1e-4, atol=1e-6)
    for (path, g), r in zip(jax.tree_util.tree_flatten_with_path(grads)[0], jax.tree.leaves(ref_grads)):
        np.testing.assert_allclose(g, r, atol=2e-6, rtol=1e-4, err_msg=jax.tree_util.keystr(path))
