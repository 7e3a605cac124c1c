"""Row permutations of the expert dispatch whose forward and backward are both gathers.

The dispatch sorts each device's t * A token-expert assignments by expert (and, with several local experts, the
received rows by expert), and puts the experts' outputs back in the original order. Written as `x[rows]` and
`zeros.at[rows].set(y)`, one direction of each is a scatter, and the gradient of `x[order // A]` is a
scatter-add of A rows into each token's row: XLA:GPU runs such a scatter-add with atomic adds, whose order (and
so whose bf16 sum) varies from run to run. The rows move by a permutation whose inverse is known, so every
transpose here is a gather, and a token's A gradient rows are summed in fp32 in a fixed order. The buffers may
hold rows no assignment fills (chunks padded to whole row blocks, `expert_parallel`): marked -1, they hold a
token's row going in and get no gradient coming back. On TPU it moves few bytes (the v5p-512 step: 14.04 -> 13.84
TB of HBM traffic, benchmarks/BENCHMARKS.md).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp


def inverse_permutation(order: jax.Array) -> jax.Array:
    """inverse[order[i]] = i, for a permutation `order` of range(n) (int32)."""
    n = order.shape[0]
    return jnp.zeros((n,), jnp.int32).at[order].set(jnp.arange(n, dtype=jnp.int32), unique_indices=True)


@functools.partial(jax.custom_vjp, nondiff_argnums=(3,))
def permute_rows(x: jax.Array, order: jax.Array, inverse: jax.Array, zero_unread: bool = True) -> jax.Array:
    """x[order] for a permutation `order` with inverse `inverse`; the gradient is g[inverse]. x may have more rows
    than `order` reads (a buffer padded with rows nothing reads): `inverse` marks those -1, their gradient zero, or
    with `zero_unread` False some read row's gradient (no select pass over the buffer), for a caller whose rows
    nothing reads contribute nothing whatever their finite gradient."""
    return x[order]


def _permute_fwd(x, order, inverse, zero_unread):
    return x[order], inverse


def _permute_bwd(zero_unread, inverse, g):
    return (_rows_or_zero(g, inverse) if zero_unread else g[jnp.maximum(inverse, 0)]), None, None


permute_rows.defvjp(_permute_fwd, _permute_bwd)


def _rows_or_zero(x: jax.Array, rows: jax.Array) -> jax.Array:
    """x[rows], zero where rows < 0 (rows can be -1 only when there are more of them than x has rows)."""
    if rows.shape[0] <= x.shape[0]:
        return x[rows]
    return jnp.where((rows >= 0)[:, None], x[jnp.maximum(rows, 0)], jnp.zeros((), x.dtype))


@jax.custom_vjp
def repeat_rows(x: jax.Array, fill: jax.Array, slot: jax.Array) -> jax.Array:
    """The dispatch buffer's rows from the tokens' rows x [t, D]: row i is x[fill[i] // A], assignment fill[i]
    belonging to token fill[i] // A (A = len(slot) // t). `slot` [t * A] is where each assignment sits (fill's
    inverse). A buffer of more rows than assignments has rows no assignment fills (fill -1): they hold the first
    token's row, which costs no select pass over the buffer (XLA:TPU runs one apart from the gather), and must
    reach nothing: `permute_rows` gives them no gradient. The gradient sums each token's A rows, gathered back by
    `slot`, instead of scatter-adding them."""
    return x[jnp.maximum(fill, 0) // (slot.shape[0] // x.shape[0])]


def _repeat_fwd(x, fill, slot):
    return repeat_rows(x, fill, slot), (slot, x.shape[0])


def _repeat_bwd(residuals, g):
    slot, tokens = residuals
    summed = g[slot].reshape(tokens, -1, g.shape[-1]).astype(jnp.float32).sum(1)  # fp32: A rows per token
    return summed.astype(g.dtype), None, None


repeat_rows.defvjp(_repeat_fwd, _repeat_bwd)
