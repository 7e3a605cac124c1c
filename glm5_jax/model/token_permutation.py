"""Row permutations of the expert dispatch whose forward and backward are both gathers.

The dispatch sorts each device's t * A token-expert assignments by expert (and, with several local experts, the
received rows by expert), and puts the experts' outputs back in the original order. Written as `x[rows]` and
`zeros.at[rows].set(y)`, one direction of each is a scatter, and the gradient of `x[order // A]` is a
scatter-add of A rows into each token's row: XLA:GPU runs such a scatter-add with atomic adds, whose order (and
so whose bf16 sum) varies from run to run. The rows move by a permutation whose inverse is known, so every
transpose here is a gather, and a token's A gradient rows are summed in fp32 in a fixed order. On TPU it moves
few bytes (the v5p-512 step: 14.04 -> 13.84 TB of HBM traffic, benchmarks/BENCHMARKS.md).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


def inverse_permutation(order: jax.Array) -> jax.Array:
    """inverse[order[i]] = i, for a permutation `order` of range(n) (int32)."""
    n = order.shape[0]
    return jnp.zeros((n,), jnp.int32).at[order].set(jnp.arange(n, dtype=jnp.int32), unique_indices=True)


@jax.custom_vjp
def permute_rows(x: jax.Array, order: jax.Array, inverse: jax.Array) -> jax.Array:
    """x[order] for a permutation `order` with inverse `inverse`; the gradient is g[inverse]."""
    return x[order]


def _permute_fwd(x, order, inverse):
    return x[order], inverse


def _permute_bwd(inverse, g):
    return g[inverse], None, None


permute_rows.defvjp(_permute_fwd, _permute_bwd)


@jax.custom_vjp
def repeat_rows(x: jax.Array, order: jax.Array, inverse: jax.Array) -> jax.Array:
    """Rows of the assignments [t * A, D] in `order` from their tokens' rows x [t, D]: x[order // A], where
    A = len(order) // t and assignment i belongs to token i // A. The gradient sums each token's A rows,
    gathered back by `inverse`, instead of scatter-adding them."""
    return x[order // (order.shape[0] // x.shape[0])]


def _repeat_fwd(x, order, inverse):
    return repeat_rows(x, order, inverse), (inverse, x.shape[0])


def _repeat_bwd(residuals, g):
    inverse, tokens = residuals
    summed = g[inverse].reshape(tokens, -1, g.shape[-1]).astype(jnp.float32).sum(1)  # fp32: A rows per token
    return summed.astype(g.dtype), None, None


repeat_rows.defvjp(_repeat_fwd, _repeat_bwd)
