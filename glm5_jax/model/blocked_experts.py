"""Dropless grouped expert matmuls without `ragged_dot`, for backends that lack a grouped kernel (CPU).

XLA's CPU `ragged_dot` multiplies every row by every expert and masks: E times the useful work. Here the
T*A assignments are sorted by expert and laid out in fixed-size row blocks, each block owned by one
expert (every group padded to a multiple of the block). The block count has a static upper bound, so the
program shape is fixed; a loop runs only the blocks that hold assignments, each against its expert's
weights sliced in place.

Everything has a hand-written VJP built from gathers and in-place slice updates: XLA differentiates a
gather into a scatter-add, which runs element by element on CPU, and autodiff through per-block weight
copies would keep [Nb, D, F] copies of the expert weights as residuals of every layer.
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
    n_used: jax.Array         # scalar: blocks [0, n_used) hold assignments, the rest are empty


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
    n_used = (padded_end[-1] // block).astype(jnp.int32)
    return BlockLayout(token_of_row, row_of_choice.reshape(n_tokens, top_k), block_expert, n_used)


@jax.custom_vjp
def dispatch_rows(x: jax.Array, token_of_row: jax.Array, row_of_choice: jax.Array) -> jax.Array:
    """rows[r] = x[token_of_row[r]] ([T, D] -> [R, D]); padding rows (token T) are zero."""
    return jnp.concatenate([x, jnp.zeros((1, x.shape[1]), x.dtype)])[token_of_row]


def _dispatch_fwd(x, token_of_row, row_of_choice):
    return dispatch_rows(x, token_of_row, row_of_choice), row_of_choice


def _dispatch_bwd(row_of_choice, d_rows):
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
    # Each row holds one choice: its weight, scattered once into row order (R ints), then gathers.
    weight_of_row = jnp.zeros((rows.shape[0],), weights.dtype).at[row_of_choice.reshape(-1)].set(
        weights.reshape(-1))
    d_out_pad = jnp.concatenate([d_out, jnp.zeros((1, d_out.shape[1]), d_out.dtype)])
    d_rows = d_out_pad[token_of_row] * weight_of_row[:, None].astype(d_out.dtype)
    d_weights = jnp.einsum("TAD,TD->TA", rows[row_of_choice].astype(jnp.float32), d_out.astype(jnp.float32))
    return d_rows, d_weights.astype(weights.dtype), None, None


combine_rows.defvjp(_combine_fwd, _combine_bwd)


def _take(x: jax.Array, i) -> jax.Array:
    return jax.lax.dynamic_index_in_dim(x, i, 0, keepdims=False)


def _put(buffer: jax.Array, value: jax.Array, i) -> jax.Array:
    return jax.lax.dynamic_update_index_in_dim(buffer, value.astype(buffer.dtype), i, 0)


@jax.custom_vjp
def blocked_swiglu(rows: jax.Array, gate: jax.Array, up: jax.Array, down: jax.Array,
                   block_expert: jax.Array, n_used: jax.Array) -> jax.Array:
    """SwiGLU of each block's rows with its expert's weights: rows [Nb, b, D] -> [Nb, b, D].

    A loop over the `n_used` blocks that hold assignments, each one [b, D] x [D, 2F] and one [b, F] x [F, D]
    matmul against its expert's weights sliced in place: on CPU this runs ~2x faster than one batched
    matmul over per-block weight copies, and skips the empty blocks of the static bound (blocks from
    n_used on stay zero)."""
    return _blocked_swiglu_fwd(rows, gate, up, down, block_expert, n_used)[0]


def _blocked_swiglu_fwd(rows, gate, up, down, block_expert, n_used):
    gate_up = jnp.concatenate([gate, up], axis=-1)  # [E, D, 2F]: one matmul twice as wide runs faster
    width = gate.shape[-1]

    def block(i, carry):
        out, pre = carry
        expert = _take(block_expert, i)
        g_u = _take(rows, i) @ _take(gate_up, expert)
        act = jax.nn.silu(g_u[:, :width]) * g_u[:, width:]
        return _put(out, act @ _take(down, expert), i), _put(pre, g_u, i)

    init = (jnp.zeros_like(rows), jnp.zeros((*rows.shape[:2], 2 * width), rows.dtype))
    out, pre = jax.lax.fori_loop(0, n_used, block, init)
    # Residuals: the pre-activations, and the weights as given (the concatenation is redone, not kept).
    return out, (rows, pre, gate, up, down, block_expert, n_used)


def _blocked_swiglu_bwd(residuals, d_out):
    rows, pre, gate, up, down, block_expert, n_used = residuals
    gate_up = jnp.concatenate([gate, up], axis=-1)
    width = down.shape[1]

    def block(i, carry):
        d_rows, d_gate_up, d_down = carry
        expert = _take(block_expert, i)
        g, u = _take(pre, i)[:, :width], _take(pre, i)[:, width:]
        sig = jax.nn.sigmoid(g)
        silu = g * sig
        d_o = _take(d_out, i)
        d_act = d_o @ _take(down, expert).T
        d_g_u = jnp.concatenate([d_act * u * sig * (1 + g * (1 - sig)), d_act * silu], axis=-1)  # [b, 2F]
        d_rows = _put(d_rows, d_g_u @ _take(gate_up, expert).T, i)
        # Expert weight gradients accumulate in fp32 over that expert's blocks.
        d_gate_up = _put(d_gate_up, _take(d_gate_up, expert) + jnp.einsum(
            "bD,bF->DF", _take(rows, i), d_g_u, preferred_element_type=jnp.float32), expert)
        d_down = _put(d_down, _take(d_down, expert) + jnp.einsum(
            "bF,bD->FD", silu * u, d_o, preferred_element_type=jnp.float32), expert)
        return d_rows, d_gate_up, d_down

    init = (jnp.zeros_like(rows), jnp.zeros(gate_up.shape, jnp.float32), jnp.zeros(down.shape, jnp.float32))
    d_rows, d_gate_up, d_down = jax.lax.fori_loop(0, n_used, block, init)
    return (d_rows, d_gate_up[..., :width].astype(gate.dtype), d_gate_up[..., width:].astype(up.dtype),
            d_down.astype(down.dtype), None, None)


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
                         experts["down_proj"].astype(dtype), layout.block_expert, layout.n_used)
    return combine_rows(out.reshape(-1, x.shape[1]), weights, layout.token_of_row, layout.row_of_choice)
