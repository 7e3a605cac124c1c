"""The routed experts' SwiGLU on one device: every expert on every token (the reference), and the dropless
sort-by-expert dispatch with grouped matmuls (`ragged`). Expert parallelism (`expert_parallel`) runs the same
grouped matmuls on each device's share of the experts.

`grouped_swiglu` runs the ops layer's grouped matmul (`glm5_jax.ops.grouped_matmul`: megablox kernels on TPU,
Triton kernels on GPU, `ragged_dot` on CPU, where the model itself uses the blocked layout of `blocked_experts`
instead)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.ad_checkpoint import checkpoint_name

from glm5_jax.model.blocked_experts import experts_blocked
from glm5_jax.ops.grouped_matmul import grouped_matmul
from glm5_jax.ops.platform import compiled_platform


def experts_reference(experts: dict, x: jax.Array, expert_ids: jax.Array, weights: jax.Array) -> jax.Array:
    """Every expert on every token; combine with the dense [T, E] routing weights."""
    n_experts = experts["gate_proj"].shape[0]
    dtype = x.dtype
    dense_weights = jnp.zeros((x.shape[0], n_experts), jnp.float32).at[
        jnp.arange(x.shape[0])[:, None], expert_ids].add(weights)
    gate = jnp.einsum("TD,EDF->TEF", x, experts["gate_proj"].astype(dtype))
    up = jnp.einsum("TD,EDF->TEF", x, experts["up_proj"].astype(dtype))
    out = jnp.einsum("TEF,EFD->TED", jax.nn.silu(gate) * up, experts["down_proj"].astype(dtype))
    return jnp.einsum("TED,TE->TD", out, dense_weights.astype(dtype))


def grouped_swiglu(experts: dict, x_sorted: jax.Array, group_sizes: jax.Array,
                   platform: str | None = None, zero_outside: bool = True, vmem_limit: int | None = None,
                   row_weights: jax.Array | None = None, expected_rows: int | None = None) -> jax.Array:
    """SwiGLU of rows already sorted by expert; `group_sizes` int32 [E] rows per expert; rows past their sum
    give zeros, or with `zero_outside` False (a caller that never reads them) whatever the kernels leave there,
    in the output and the input gradient. Grouped matmuls for `platform` (see
    `glm5_jax.ops.platform.compiled_platform`); `vmem_limit` and `expected_rows` (the rows filled on average,
    which the kernels declare the work of) as `ops.grouped_matmul`'s.

    `row_weights` [rows] (the routing weights) scale each row's hidden activations before the down projection,
    which is the same as scaling its output: then no gradient needs the output, so under remat the backward
    recomputes neither the down projection nor what carries its output back to the tokens."""
    dtype = x_sorted.dtype
    platform = compiled_platform(platform)
    matmul = lambda x, w: grouped_matmul(x, w, group_sizes, platform, zero_outside, vmem_limit,  # noqa: E731
                                         expected_rows)
    # The gate and up projections as one grouped matmul of [E, D, 2F] weights (concatenated here; a copy of the
    # weights, not of the rows): its backward's input gradient is one matmul over both, instead of two whose
    # [rows, D] results are then summed (v6e-256: 66 GB of HBM traffic per step, benchmarks/BENCHMARKS.md).
    width = experts["gate_proj"].shape[-1]
    gate_up = jnp.concatenate([experts["gate_proj"].astype(dtype), experts["up_proj"].astype(dtype)], axis=-1)
    projected = checkpoint_name(matmul(x_sorted, gate_up), "expert_gate_up")  # remat "full_keep_experts"
    hidden = jax.nn.silu(projected[:, :width]) * projected[:, width:]
    if row_weights is not None:
        hidden = hidden * row_weights[:, None].astype(dtype)
    return matmul(hidden, experts["down_proj"].astype(dtype))


def experts_gathered(experts: dict, x: jax.Array, expert_ids: jax.Array, weights: jax.Array) -> jax.Array:
    """Each of the T*A assignments with its own expert's weights, gathered: for a handful of tokens (a decode
    step) this reads only the chosen experts' weights, with no sort, no padded blocks and no loop."""
    dtype = x.dtype
    take = lambda name: experts[name].astype(dtype)[expert_ids]  # noqa: E731  [T, A, ...]
    gate = jnp.einsum("TD,TADF->TAF", x, take("gate_proj"))
    up = jnp.einsum("TD,TADF->TAF", x, take("up_proj"))
    out = jnp.einsum("TAF,TAFD->TAD", jax.nn.silu(gate) * up, take("down_proj"))
    return jnp.einsum("TAD,TA->TD", out, weights.astype(dtype))


def experts_ragged(experts: dict, x: jax.Array, expert_ids: jax.Array, weights: jax.Array,
                   platform: str | None = None) -> jax.Array:
    """Dropless dispatch: sort the T*A assignments by expert, grouped matmuls, weighted unsort-and-sum.
    On CPU the grouped matmul uses the blocked layout (`experts_blocked`), elsewhere `grouped_swiglu`'s kernels;
    with no more assignments than experts (decode steps) each assignment gathers its expert's weights.
    `platform` is the one compiled for (default: see `compiled_platform`)."""
    n_tokens, top_k = expert_ids.shape
    if n_tokens * top_k <= experts["gate_proj"].shape[0]:
        return experts_gathered(experts, x, expert_ids, weights)
    platform = compiled_platform(platform)
    if platform == "cpu":
        return experts_blocked(experts, x, expert_ids, weights)
    n_experts = experts["gate_proj"].shape[0]
    flat_ids = expert_ids.reshape(-1)
    order = jnp.argsort(flat_ids, stable=True)
    token_of = order // top_k
    group_sizes = jnp.bincount(flat_ids, length=n_experts).astype(jnp.int32)
    out_sorted = grouped_swiglu(experts, x[token_of], group_sizes, platform)
    out_sorted = out_sorted * weights.reshape(-1)[order][:, None].astype(out_sorted.dtype)
    return jnp.zeros_like(x).at[token_of].add(out_sorted)
