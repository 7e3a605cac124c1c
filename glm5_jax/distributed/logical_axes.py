"""The one table of logical axis rules: every parameter and activation dim has a logical name, every logical
name a list of mesh axes it may be split over.

A dim takes, in order, the candidate mesh axes not yet used by an earlier dim of the same array, as long as
the dim stays divisible by the product of the axes taken (otherwise the axis is left for a later dim, or the
dim is replicated). So an activation ("batch", "seq", "embed") gives `fsdp` to the batch and keeps `embed`
whole, while a weight ("embed", "q_lora") is FSDP-sharded on its embed dim: parameters are FSDP-sharded on
their first (by the table's order, the largest) dim that allows it, tensor-parallel on heads / MLP hidden /
vocabulary, expert weights split over `expert` on E, and the stacked layer axis is never split.
"""

from __future__ import annotations

from typing import Mapping, Sequence

import jax
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from glm5_jax.config.mesh import BATCH_AXES
from glm5_jax.tree_paths import path_names

# Logical name -> candidate mesh axes, in the order they are taken.
LOGICAL_AXIS_RULES: dict[str, tuple[str, ...]] = {
    "batch": BATCH_AXES,
    "seq": (),
    "embed": ("fsdp",),
    "q_lora": ("fsdp",),
    "kv_lora": ("fsdp",),
    "heads": ("tensor",),
    "head_dim": (),
    "index_heads": ("tensor",),
    "index_head_dim": (),
    "mlp": ("tensor",),
    "experts": ("expert",),
    "expert_mlp": ("tensor",),
    "vocab": ("tensor",),
    # Every token needs the score of every expert, so the router's E axis stays whole.
    "router_experts": (),
    "layers": (),
    "norm": (),
    "topk": (),
}

# Parameter leaves, keyed by the tail of their path, with the logical names of their dims (no layer axis).
PARAM_LOGICAL_AXES: dict[tuple[str, ...], tuple[str, ...]] = {
    ("embed", "embedding"): ("vocab", "embed"),
    ("lm_head", "kernel"): ("embed", "vocab"),
    ("scale",): ("norm",),
    ("k_norm", "bias"): ("norm",),
    ("q_a_proj", "kernel"): ("embed", "q_lora"),
    ("q_b_proj", "kernel"): ("q_lora", "heads", "head_dim"),
    ("kv_a_proj", "kernel"): ("embed", "kv_lora"),
    ("kv_b_proj", "kernel"): ("kv_lora", "heads", "head_dim"),
    ("o_proj", "kernel"): ("heads", "head_dim", "embed"),
    ("gate_proj", "kernel"): ("embed", "mlp"),
    ("up_proj", "kernel"): ("embed", "mlp"),
    ("down_proj", "kernel"): ("mlp", "embed"),
    ("router", "kernel"): ("embed", "router_experts"),
    ("e_score_correction_bias",): ("router_experts",),
    ("experts", "gate_proj"): ("experts", "embed", "expert_mlp"),
    ("experts", "up_proj"): ("experts", "embed", "expert_mlp"),
    ("experts", "down_proj"): ("experts", "expert_mlp", "embed"),
    ("wq_b", "kernel"): ("q_lora", "index_heads", "index_head_dim"),
    ("wk", "kernel"): ("embed", "index_head_dim"),
    ("weights_proj", "kernel"): ("embed", "index_heads"),
    # [2D, D]: the concatenated input dim is the larger one and claims `fsdp` first.
    ("eh_proj", "kernel"): ("embed", "embed"),
}

# Top-level sections whose leaves carry a leading stacked-layer axis.
STACKED_SECTIONS = ("dense_layers", "moe_layers", "indexers")
PARAM_SECTIONS = ("embed", "dense_layers", "moe_layers", "indexers", "final_norm", "lm_head", "mtp")


class ShardingRuleError(ValueError):
    """A parameter path or logical axis name has no sharding rule, or disagrees with the array's rank."""


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


def param_logical_axes(names: Sequence[str], ndim: int) -> tuple[str, ...]:
    """Logical names of the dims of the parameter at path `names` (e.g. ("moe_layers", "attn", "o_proj",
    "kernel")), including the leading "layers" axis of stacked sections."""
    names = tuple(names)
    match = next((names[-n:] for n in (3, 2, 1) if names[-n:] in PARAM_LOGICAL_AXES), None)
    if match is None:
        raise ShardingRuleError(f"parameter '{'/'.join(names)}' has no entry in PARAM_LOGICAL_AXES; add one")
    axes = (("layers",) if names[0] in STACKED_SECTIONS else ()) + PARAM_LOGICAL_AXES[match]
    if len(axes) != ndim:
        raise ShardingRuleError(f"parameter '{'/'.join(names)}' has rank {ndim} but its rule gives {len(axes)} "
                                f"dims {axes}")
    return axes


def param_specs(params, mesh: Mesh | Mapping[str, int]):
    """PartitionSpec of every parameter leaf (params may be arrays or `jax.ShapeDtypeStruct`s)."""
    return jax.tree_util.tree_map_with_path(
        lambda path, leaf: logical_to_spec(param_logical_axes(path_names(path), len(leaf.shape)), leaf.shape, mesh),
        params)


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
