"""Chunked token logprobs against an unchunked float64 / full-logits computation: values, entropy, grads."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from glm5_jax.model.token_logprobs import token_logprobs

B, S, D, V = 2, 3, 5, 11


def _inputs(seed=0):
    rng = np.random.default_rng(seed)
    hidden = rng.normal(size=(B, S, D)).astype(np.float32)
    kernel = rng.normal(size=(D, V)).astype(np.float32)
    targets = rng.integers(0, V, size=(B, S)).astype(np.int32)
    temperature = np.array([0.7, 1.3], np.float32)
    return hidden, kernel, targets, temperature


def _numpy_reference(hidden, kernel, targets, temperature):
    logits = np.einsum("bsd,dv->bsv", hidden.astype(np.float64), kernel.astype(np.float64))
    logits = logits / np.asarray(temperature, np.float64).reshape(-1, 1, 1)
    logits = logits - logits.max(-1, keepdims=True)
    log_probs = logits - np.log(np.exp(logits).sum(-1, keepdims=True))
    logp = np.take_along_axis(log_probs, targets[..., None], -1)[..., 0]
    entropy = -(np.exp(log_probs) * log_probs).sum(-1)
    return logp, entropy


def _full_logits_reference(hidden, kernel, targets, temperature):
    logits = jnp.einsum("BSD,DV->BSV", hidden, kernel) / jnp.reshape(temperature, (-1, 1, 1))
    log_probs = jax.nn.log_softmax(logits)
    logp = jnp.take_along_axis(log_probs, targets[..., None], -1)[..., 0]
    return logp, -(jnp.exp(log_probs) * log_probs).sum(-1)


@pytest.mark.parametrize("vocab_chunk", [1, 4, 11, 64])
def test_values_match_unchunked_for_any_chunk(vocab_chunk):
    hidden, kernel, targets, temperature = _inputs()
    logp, entropy = token_logprobs(hidden, kernel, targets, temperature=temperature, vocab_chunk=vocab_chunk,
                                   compute_entropy=True)
    want_logp, want_entropy = _numpy_reference(hidden, kernel, targets, temperature)
    assert logp.dtype == jnp.float32 and entropy.dtype == jnp.float32
    np.testing.assert_allclose(logp, want_logp, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(entropy, want_entropy, rtol=1e-5, atol=1e-5)


def test_per_sample_temperature_applies_to_its_row_only():
    hidden, kernel, targets, _ = _inputs()
    per_sample, _ = token_logprobs(hidden, kernel, targets, temperature=np.array([0.5, 2.0]), vocab_chunk=4)
    row0, _ = token_logprobs(hidden, kernel, targets, temperature=0.5, vocab_chunk=4)
    row1, _ = token_logprobs(hidden, kernel, targets, temperature=2.0, vocab_chunk=4)
    np.testing.assert_allclose(per_sample[0], row0[0], rtol=1e-6)
    np.testing.assert_allclose(per_sample[1], row1[1], rtol=1e-6)
    assert not np.allclose(row0[1], row1[1])


def test_jit_with_traced_targets_and_temperature():
    hidden, kernel, targets, temperature = _inputs()
    fn = jax.jit(lambda h, w, t, temp: token_logprobs(h, w, t, temperature=temp, vocab_chunk=4)[0])
    want, _ = _numpy_reference(hidden, kernel, targets, temperature)
    np.testing.assert_allclose(fn(hidden, kernel, targets, temperature), want, rtol=1e-5, atol=1e-5)


def test_entropy_is_none_unless_asked():
    hidden, kernel, targets, _ = _inputs()
    assert token_logprobs(hidden, kernel, targets, vocab_chunk=4)[1] is None


def test_gradients_match_full_logits_with_ragged_last_chunk():
    hidden, kernel, targets, temperature = _inputs(1)
    weights = np.arange(B * S, dtype=np.float32).reshape(B, S) - 2.5

    def objective(fn):
        def value(hidden, kernel):
            logp, entropy = fn(hidden, kernel)
            return jnp.sum(weights * logp) + jnp.sum(entropy**2)
        return value

    chunked = objective(lambda h, w: token_logprobs(h, w, targets, temperature=temperature, vocab_chunk=4,
                                                    compute_entropy=True))
    full = objective(lambda h, w: _full_logits_reference(h, w, targets, temperature))
    got = jax.jit(jax.grad(chunked, argnums=(0, 1)))(hidden, kernel)
    want = jax.grad(full, argnums=(0, 1))(hidden, kernel)
    for g, w in zip(got, want):
        np.testing.assert_allclose(g, w, rtol=1e-4, atol=1e-5)
    assert np.abs(got[1]).min() > 0  # every vocabulary column, the ragged tail included, got its gradient


def test_bf16_hidden_gives_fp32_logprobs_and_bf16_grad():
    hidden, kernel, targets, _ = _inputs()
    hidden = jnp.asarray(hidden, jnp.bfloat16)
    logp, _ = token_logprobs(hidden, kernel, targets, vocab_chunk=4)
    want, _ = _numpy_reference(np.asarray(hidden, np.float32), kernel, targets, np.ones(B))
    assert logp.dtype == jnp.float32
    np.testing.assert_allclose(logp, want, rtol=1e-5, atol=1e-5)
    grad = jax.grad(lambda h: token_logprobs(h, kernel, targets, vocab_chunk=4)[0].sum())(hidden)
    assert grad.dtype == jnp.bfloat16


@pytest.mark.parametrize("change, message", [
    (dict(targets=np.full((B, S), V)), "targets contains id 11"),
    (dict(targets=np.zeros((B, S + 1), np.int32)), "targets has shape"),
    (dict(temperature=np.ones(3)), "temperature has shape"),
    (dict(temperature=0.0), "temperature="),
    (dict(vocab_chunk=0), "vocab_chunk=0"),
    (dict(kernel=np.zeros((D + 1, V), np.float32)), "lm_head_kernel has shape"),
])
def test_bad_inputs_are_named(change, message):
    hidden, kernel, targets, temperature = _inputs()
    args = dict(hidden=hidden, kernel=kernel, targets=targets, temperature=temperature, vocab_chunk=4)
    args.update(change)
    with pytest.raises(ValueError, match=message):
        token_logprobs(args["hidden"], args["kernel"], args["targets"], temperature=args["temperature"],
                       vocab_chunk=args["vocab_chunk"])
