"""The dispatch's row permutations (`glm5_jax.model.token_permutation`): the values and gradients of the plain
indexing they replace, with backward passes that gather instead of scatter."""

import jax
import jax.numpy as jnp
import numpy as np

from glm5_jax.model.token_permutation import inverse_permutation, permute_rows, repeat_rows

TOKENS, TOP_K, DIM = 6, 3, 5


def _inputs():
    keys = jax.random.split(jax.random.key(0), 4)
    x = jax.random.normal(keys[0], (TOKENS, DIM))
    experts = jax.random.randint(keys[1], (TOKENS * TOP_K,), 0, 4)  # ties: the stable sort keeps token order
    order = jnp.argsort(experts, stable=True)
    weights = jax.random.normal(keys[2], (TOKENS * TOP_K, 1))
    probe = jax.random.normal(keys[3], (TOKENS * TOP_K, DIM))
    return x, order, weights, probe


def test_inverse_permutation_undoes_the_order():
    _, order, _, _ = _inputs()
    inverse = inverse_permutation(order)
    np.testing.assert_array_equal(order[inverse], np.arange(order.shape[0]))
    np.testing.assert_array_equal(inverse[order], np.arange(order.shape[0]))


def test_dispatch_and_combine_equal_plain_indexing_in_values_and_gradients():
    x, order, weights, probe = _inputs()
    inverse = inverse_permutation(order)

    def plain(x, probe):
        send = x[order // TOP_K]
        back = jnp.tanh(send) * probe  # stands in for the experts
        combined = jnp.zeros_like(back).at[order].set(back, unique_indices=True)
        return (combined * weights).reshape(TOKENS, TOP_K, DIM).sum(1)

    def gathers(x, probe):
        send = repeat_rows(x, order, inverse)
        back = jnp.tanh(send) * probe
        combined = permute_rows(back, inverse, order)
        return (combined * weights).reshape(TOKENS, TOP_K, DIM).sum(1)

    cotangent = jax.random.normal(jax.random.key(5), (TOKENS, DIM))
    want, want_vjp = jax.vjp(plain, x, probe)
    got, got_vjp = jax.vjp(gathers, x, probe)
    np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-6)
    compiled_grads = jax.jit(lambda c: jax.vjp(gathers, x, probe)[1](c))(cotangent)
    for grads in (got_vjp(cotangent), compiled_grads):
        for g, w in zip(grads, want_vjp(cotangent)):
            np.testing.assert_allclose(g, w, rtol=1e-5, atol=1e-6)


def test_the_backward_passes_hold_no_scatter():
    x, order, _, probe = _inputs()
    inverse = inverse_permutation(order)

    def loss(x, probe):
        return jnp.sum(permute_rows(repeat_rows(x, order, inverse) * probe, inverse, order) ** 2)

    text = jax.jit(jax.grad(loss, argnums=(0, 1))).lower(x, probe).as_text()
    assert "scatter" not in text, [line for line in text.splitlines() if "scatter" in line][:3]


def test_a_padded_buffer_equals_plain_indexing_in_values_and_gradients():
    """A send buffer with more rows than assignments (chunks padded to whole blocks): its unfilled rows (fill
    -1) reach neither the output nor the gradients, whatever the computation does to them."""
    x, order, weights, _ = _inputs()
    rows = TOKENS * TOP_K + 7
    slot = jnp.asarray(np.random.RandomState(0).permutation(rows)[:TOKENS * TOP_K], jnp.int32)  # assignment -> row
    fill = jnp.full((rows,), -1, jnp.int32).at[slot].set(jnp.arange(TOKENS * TOP_K, dtype=jnp.int32))
    probe = jax.random.normal(jax.random.key(3), (rows, DIM))
    empty = np.asarray(fill) < 0

    def plain(x, probe):
        send = jnp.full((rows, DIM), 5.0).at[slot].set(x[jnp.arange(TOKENS * TOP_K) // TOP_K])
        back = jnp.tanh(send) * probe + 3.0  # the empty rows come back nonzero
        return (back[slot] * weights).reshape(TOKENS, TOP_K, DIM).sum(1)

    def gathers(x, probe):
        send = repeat_rows(x, fill, slot)
        back = jnp.tanh(send) * probe + 3.0
        return (permute_rows(back, slot, fill) * weights).reshape(TOKENS, TOP_K, DIM).sum(1)

    cotangent = jax.random.normal(jax.random.key(5), (TOKENS, DIM))
    want, want_vjp = jax.vjp(plain, x, probe)
    got, got_vjp = jax.vjp(gathers, x, probe)
    np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-6)
    for g, w in zip(got_vjp(cotangent), want_vjp(cotangent)):
        np.testing.assert_allclose(g, w, rtol=1e-5, atol=1e-6)
    assert not np.asarray(got_vjp(cotangent)[1])[empty].any()
