"""Dropless grouped expert matmuls without `ragged_dot`, for backends that lack a grouped kernel (CPU).

XLA's CPU `ragged_dot` multiplies every row by every expert and masks: E times the useful work. Here the
T*A assignments are sorted by expert and laid out in fixed-size row blocks, each block owned by one
expert (every group padded to a multiple of the block), and each projection is one batched matmul
[Nb, b, D] x [Nb, D, F]. The block count has a static upper bound, so the program shape is fixed.

Moving rows and weights in and out of that layout is done with gathers in both directions (custom VJPs):
XLA differentiates a gather into a scatter-add, which runs element by element on CPU, and autodiff of the
per-block weight gather would also keep [Nb, D, F] copies of the expert weights as residuals of every
layer. The backward here re-gathers the weights, forms per-block weight gradients and sums the blocks of
each expert with a one-hot matmul.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp


class BlockLayout(NamedTuple):
    """Where every assignment sits in the expert-blocked row layout (all int32)."""

    token_of_row: jax.Array   # [Nb * b] source token of each row; n_tokens for a padding row
    row_of_choice: jax.Array  # [T, A] the row holding token t's a-th choice
    block_expert: jax.Array   # [Nb] the expert that owns each block


def block_layout(expert_ids: jax.Array, n_experts: int, block: int) -> BlockLayout:
    """Sort the [T, A] assignments by expert (stable, so ties keep token order) into padded blocks."""
    n_tokens, top_k = expert_ids.shape
    n_assign = n_tokens * top_k
    n_blocks = -(-(n_assign + n_experts * (block - 1)) // block)  # every group padded: a static upper bound
    flat_ids = expert_ids.reshape(-1)
    order = jnp.argsort(flat_ids, stable=True)
    sorted_ids = flat_ids[order]
    sizes = jnp.bincount(flat_ids, length=n_experts)
    padded = -(-sizes // block) * block
    padded_end = jnp.cumsum(padded)
    rank_in_group = jnp.arange(n_assign) - (jnp.cumsum(sizes) - sizes)[sorted_ids]
    row_sorted = (padded_end - padded)[sorted_ids] + rank_in_group
    row_of_choice = jnp.zeros((n_assign,), jnp.int32).at[order].set(row_sorted.astype(jnp.int32))
    token_of_row = jnp.full((n_blocks * block,), n_tokens, jnp.int32).at[row_sorted].set(
        (order // top_k).astype(jnp.int32))
    block_expert = jnp.minimum(jnp.searchsorted(padded_end, jnp.arange(n_blocks) * block, side="right"),
                               n_experts - 1).astype(jnp.int32)
    return BlockLayout(token_of_row, row_of_choice.reshape(n_tokens, top_k), block_expert)


@jax.custom_vjp
def dispatch_rows(x: jax.Array, token_of_row: jax.Array, row_of_choice: jax.Array) -> jax.Array:
    """rows[r] = x[token_of_row[r]] ([T, D] -> [R, D]); padding rows (token T) are zero."""
    return jnp.concatenate([x, jnp.zeros((1, x.shape[1]), x.dtype)])[token_of_row]


def _dispatch_fwd(x, token_of_row, row_of_choice):
    return dispatch_rows(x, token_of_row, row_of_choice), (token_of_row, row_of_choice)


def _dispatch_bwd(residuals, d_rows):
    token_of_row, row_of_choice = residuals
    # Token t's rows are exactly row_of_choice[t, :]: the transpose is a gather and a sum over choices.
    return d_rows[row_of_choice].sum(1), None, None


dispatch_rows.defvjp(_dispatch_fwd, _dispatch_bwd)


@jax.custom_vjp
def combine_rows(rows: jax.Array, weights: jax.Array, token_of_row: jax.Array,
                 row_of_choice: jax.Array) -> jax.Array:
    """out[t] = sum_a weights[t, a] * rows[row_of_choice[t, a]] ([R, D], [T, A] -> [T, D])."""
    return jnp.einsum("TAD,TA->TD", rows[row_of_choice], weights.astype(rows.dtype))


def _combine_fwd(rows, weights, token_of_row, row_of_choice):
    return combine_rows(rows, weights, token_of_row, row_of_choice), (rows, weights, token_of_row, row_of_choice)


def _combine_bwd(residuals, d_out):
    rows, weights, token_of_row, row_of_choice = residuals
    n_tokens, top_k = row_of_choice.shape
    # Each row holds one choice: its weight, scattered once into row order (R ints), then gathers.
    weight_of_row = jnp.zeros((rows.shape[0],), weights.dtype).at[row_of_choice.reshape(-1)].set(
        weights.reshape(-1))
    d_out_pad = jnp.concatenate([d_out, jnp.zeros((1, d_out.shape[1]), d_out.dtype)])
    d_rows = d_out_pad[token_of_row] * weight_of_row[:, None].astype(d_out.dtype)
    d_weights = jnp.einsum("TAD,TD->TA", rows[row_of_choice].astype(jnp.float32), d_out.astype(jnp.float32))
    return d_rows, d_weights.astype(weights.dtype), None, None


combine_rows.defvjp(_combine_fwd, _combine_bwd)


def _per_block(weight: jax.Array, block_expert: jax.Array) -> jax.Array:
    return weight[block_expert]  # [E, X, Y] -> [Nb, X, Y]


def _sum_blocks_per_expert(per_block: jax.Array, block_expert: jax.Array, n_experts: int) -> jax.Array:
    """[Nb, X, Y] -> [E, X, Y]: a one-hot matmul instead of a CPU scatter-add."""
    owner = jax.nn.one_hot(block_expert, n_experts, dtype=per_block.dtype)
    return jnp.einsum("NE,NXY->EXY", owner, per_block)


@jax.custom_vjp
def blocked_swiglu(rows: jax.Array, gate: jax.Array, up: jax.Array, down: jax.Array,
                   block_expert: jax.Array) -> jax.Array:
    """SwiGLU of each block's rows with its expert's weights: rows [Nb, b, D] -> [Nb, b, D]."""
    return _blocked_swiglu_fwd(rows, gate, up, down, block_expert)[0]


def _gate_up(gate: jax.Array, up: jax.Array, block_expert: jax.Array) -> jax.Array:
    """Per-block [gate | up] weights [Nb, D, 2F]: one matmul twice as wide runs faster than two on CPU."""
    return _per_block(jnp.concatenate([gate, up], axis=-1), block_expert)


def _blocked_swiglu_fwd(rows, gate, up, down, block_expert):
    g, u = jnp.split(jnp.einsum("NbD,NDF->NbF", rows, _gate_up(gate, up, block_expert)), 2, axis=-1)
    out = jnp.einsum("NbF,NFD->NbD", jax.nn.silu(g) * u, _per_block(down, block_expert))
    # Residuals: activations only; the weights are re-gathered in the backward pass.
    return out, (rows, g, u, gate, up, down, block_expert)


def _blocked_swiglu_bwd(residuals, d_out):
    rows, g, u, gate, up, down, block_expert = residuals
    n_experts = gate.shape[0]
    sig = jax.nn.sigmoid(g)
    silu = g * sig
    d_act = jnp.einsum("NbD,NFD->NbF", d_out, _per_block(down, block_expert))
    d_down = jnp.einsum("NbF,NbD->NFD", silu * u, d_out)
    d_gate_up = jnp.concatenate([d_act * u * sig * (1 + g * (1 - sig)), d_act * silu], axis=-1)  # [Nb, b, 2F]
    d_rows = jnp.einsum("NbF,NDF->NbD", d_gate_up, _gate_up(gate, up, block_expert))
    d_gate, d_up = jnp.split(_sum_blocks_per_expert(jnp.einsum("NbD,NbF->NDF", rows, d_gate_up), block_expert,
                                                    n_experts), 2, axis=-1)
    return (d_rows, d_gate.astype(gate.dtype), d_up.astype(up.dtype),
            _sum_blocks_per_expert(d_down, block_expert, n_experts).astype(down.dtype), None)


blocked_swiglu.defvjp(_blocked_swiglu_fwd, _blocked_swiglu_bwd)


def experts_blocked(experts: dict, x: jax.Array, expert_ids: jax.Array, weights: jax.Array,
                    block: int = 128) -> jax.Array:
    """Routed experts of x [T, D] for choices expert_ids / weights [T, A]; exact and dropless."""
    n_tokens, top_k = expert_ids.shape
    n_experts = experts["gate_proj"].shape[0]
    block = max(1, min(block, n_tokens * top_k))
    layout = block_layout(expert_ids, n_experts, block)
    dtype = x.dtype
    rows = dispatch_rows(x, layout.token_of_row, layout.row_of_choice).reshape(-1, block, x.shape[1])
    out = blocked_swiglu(rows, experts["gate_proj"].astype(dtype), experts["up_proj"].astype(dtype),
                         experts["down_proj"].astype(dtype), layout.block_expert)
    return combine_rows(out.reshape(-1, x.shape[1]), weights, layout.token_of_row, layout.row_of_choice)
