"""How the model's NNX modules hold their weights.

Every weight is created with the logical names of its dims as metadata (`out_sharding`, e.g.
("embed", "q_lora")); stacking a module with `nnx.vmap` prepends "layers". One table
(`glm5_jax.distributed.logical_axes.LOGICAL_AXIS_RULES`) maps those names to mesh axes, so nothing else
describes the tree's shape. The router's correction bias is a `RouterBias`, not an `nnx.Param`: gradients
never train it (the train step moves it toward balance), and optimizer masks select it by that type.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx


class RouterBias(nnx.Variable):
    """The MoE router's correction bias: shifts expert selection only; updated outside the optimizer."""


def param(value: jax.Array, axes: tuple[str, ...]) -> nnx.Param:
    """A trainable weight whose dims carry the logical names `axes` (mapped to mesh axes later, by the table;
    no mesh is needed to create it)."""
    if len(axes) != value.ndim:
        raise ValueError(f"logical axes {axes} name {len(axes)} dims but the weight has shape {value.shape}")
    return nnx.Param(value, out_sharding=tuple(axes), eager_sharding=False)


def router_bias(value: jax.Array, axes: tuple[str, ...]) -> RouterBias:
    return RouterBias(value, out_sharding=tuple(axes), eager_sharding=False)


def normal(rngs: nnx.Rngs, shape: tuple[int, ...], std: float, dtype) -> jax.Array:
    return (std * jax.random.normal(rngs.params(), shape, jnp.float32)).astype(dtype)


def logical_axes(variable: nnx.Variable) -> tuple[str, ...]:
    """The logical dim names a weight was created with (with "layers" first when it is stacked)."""
    return tuple(variable.get_metadata()["out_sharding"])
