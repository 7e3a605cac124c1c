"""The one table of logical axis rules: every parameter and activation dim has a logical name (parameters carry
theirs as metadata, set where the model's modules create them), every logical name a list of mesh axes it may
be split over.

A dim takes, in order, the candidate mesh axes not yet used by an earlier dim of the same array, as long as
the dim stays divisible by the product of the axes taken (otherwise the axis is left for a later dim, or the
dim is replicated). So an activation ("batch", "seq", "embed") gives `fsdp` to the batch and keeps `embed`
whole, while a weight ("embed", "q_lora") is FSDP-sharded on its embed dim: parameters are FSDP-sharded on
their first (by the table's order, the largest) dim that allows it, tensor-parallel on heads / MLP hidden /
vocabulary, expert weights split over `expert` and `context` on E, and the stacked layer axis is never split.
"""

from __future__ import annotations

from typing import Mapping, Sequence

import jax
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from glm5_jax.config.mesh import BATCH_AXES, CONTEXT_AXIS

# Logical name -> candidate mesh axes, in the order they are taken.
LOGICAL_AXIS_RULES: dict[str, tuple[str, ...]] = {
    "batch": BATCH_AXES,
    # Context parallelism: each chip holds a contiguous share of every sequence's tokens.
    "seq": (CONTEXT_AXIS,),
    # Weights other than the routed experts are FSDP-sharded over every chip that holds other tokens: `fsdp`,
    # then `expert` (wide expert parallelism keeps `fsdp` small or 1), then `context` (a split sequence).
    "embed": ("fsdp", "expert", CONTEXT_AXIS),
    "q_lora": ("fsdp", "expert", CONTEXT_AXIS),
    "kv_lora": ("fsdp", "expert", CONTEXT_AXIS),
    # A routed expert's model dim: split over `fsdp` only. With `fsdp` 1 every chip holds its experts whole, so
    # no chip gathers an expert's weights per layer (tokens travel to the experts by all-to-all instead).
    "expert_embed": ("fsdp",),
    "heads": ("tensor",),
    "head_dim": (),
    "index_heads": ("tensor",),
    "index_head_dim": (),
    "mlp": ("tensor",),
    # Routed experts are spread over `expert`, then `context`: the chips of a split sequence hold different
    # experts (their tokens travel to them like any other), so no expert is stored once per context chip.
    "experts": ("expert", CONTEXT_AXIS),
    "expert_mlp": ("tensor",),
    "vocab": ("tensor",),
    # Every token needs the score of every expert, so the router's E axis stays whole.
    "router_experts": (),
    "layers": (),
    "norm": (),
    "topk": (),
}

class ShardingRuleError(ValueError):
    """A logical axis name has no sharding rule, or the names disagree with the array's rank."""


def _axis_sizes(mesh: Mesh | Mapping[str, int]) -> Mapping[str, int]:
    return mesh.shape if hasattr(mesh, "axis_names") else mesh


def logical_to_spec(logical_axes: Sequence[str | None], shape: Sequence[int],
                    mesh: Mesh | Mapping[str, int]) -> PartitionSpec:
    """PartitionSpec for an array of `shape` whose dims carry `logical_axes` (None = never split)."""
    if len(logical_axes) != len(shape):
        raise ShardingRuleError(f"logical_axes {tuple(logical_axes)} has {len(logical_axes)} names but the array "
                                f"has shape {tuple(shape)}")
    sizes = _axis_sizes(mesh)
    used: set[str] = set()
    entries = []
    for name, dim in zip(logical_axes, shape):
        if name is not None and name not in LOGICAL_AXIS_RULES:
            raise ShardingRuleError(f"logical axis {name!r} has no rule; known names: {sorted(LOGICAL_AXIS_RULES)}")
        taken: list[str] = []
        split = 1
        for axis in LOGICAL_AXIS_RULES.get(name, ()) if name else ():
            size = sizes.get(axis, 1)
            if axis in used or size == 1 or dim % (split * size):
                continue
            taken.append(axis)
            split *= size
        used.update(taken)
        entries.append(None if not taken else taken[0] if len(taken) == 1 else tuple(taken))
    return PartitionSpec(*entries)


def expert_split_axes(n_experts: int, mesh: Mesh | Mapping[str, int]) -> tuple[str, ...]:
    """The mesh axes the routed experts are spread over (expert parallelism exchanges tokens among them)."""
    spec = logical_to_spec(("experts",), (n_experts,), mesh)[0]
    return () if spec is None else (spec,) if isinstance(spec, str) else tuple(spec)


def constrain(x: jax.Array, logical_axes: Sequence[str | None], mesh: Mesh | None = None) -> jax.Array:
    """Pin activation `x` to the sharding its logical axes give, e.g. constrain(h, ("batch", "seq", "embed")).

    Uses `mesh`, else the mesh set by `jax.set_mesh`; without either it returns `x` unchanged, so model code
    can call it unconditionally."""
    if mesh is None:
        abstract = jax.sharding.get_abstract_mesh()
        if abstract.empty:
            return x
        return jax.lax.with_sharding_constraint(x, logical_to_spec(logical_axes, x.shape, abstract.shape))
    return jax.lax.with_sharding_constraint(x, NamedSharding(mesh, logical_to_spec(logical_axes, x.shape, mesh)))
