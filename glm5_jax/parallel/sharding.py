"""Shardings of parameters and optimizer state, and creating both already sharded (no host ever holds the
whole model: `init` runs under `jax.jit` with explicit output shardings). Each weight is sharded by the
logical axes `GLM5(config)` creates it with (`glm5_jax.model.metadata`), mapped to mesh axes by the one table
in `glm5_jax.distributed.logical_axes`."""

from __future__ import annotations

from typing import Mapping

import jax
import optax
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from glm5_jax.config import ModelConfig
from glm5_jax.distributed.logical_axes import logical_to_spec
from glm5_jax.model.metadata import is_param_info, model_param_infos, param_infos
from glm5_jax.model.transformer import init
from glm5_jax.tree_paths import path_names

# Muon Split keeps kv_b_proj's state as two halves (W_UK, W_UV) sharded like the whole kernel.
_SPLIT_PART_NAMES = ("uk", "uv")


def _check_mesh(mesh) -> None:
    if not isinstance(mesh, Mesh):
        raise ValueError(f"mesh must be a jax.sharding.Mesh (see glm5_jax.distributed.mesh.make_mesh), "
                         f"got {type(mesh).__name__}")


def param_specs(params, mesh: Mesh | Mapping[str, int], *, config: ModelConfig):
    """PartitionSpec of every leaf of `params` (the weights of `GLM5(config)` or part of them, arrays or
    `jax.ShapeDtypeStruct`s), from the logical axes the model creates it with."""
    return jax.tree.map(lambda info: logical_to_spec(info.axes, info.shape, mesh), param_infos(params, config),
                        is_leaf=is_param_info)


def param_shardings(params, mesh: Mesh, *, config: ModelConfig):
    """NamedSharding of every leaf of `params` (arrays or `jax.ShapeDtypeStruct`s), as `param_specs`."""
    _check_mesh(mesh)
    return jax.tree.map(lambda spec: NamedSharding(mesh, spec), param_specs(params, mesh, config=config),
                        is_leaf=lambda x: isinstance(x, PartitionSpec))


def shard_params(params, mesh: Mesh, *, config: ModelConfig):
    """Move an existing parameter tree onto `mesh` with the rule-table shardings."""
    return jax.device_put(params, param_shardings(params, mesh, config=config))


def abstract_params(config: ModelConfig):
    """Shapes and dtypes of `init(config, rng)` without allocating anything."""
    return jax.eval_shape(lambda key: init(config, key), jax.random.key(0))


def init_sharded(config: ModelConfig, rng: jax.Array, mesh: Mesh):
    """`glm5_jax.model.transformer.init(config, rng)` with every leaf created directly in its shard."""
    _check_mesh(mesh)
    config.validate()
    shardings = param_shardings(abstract_params(config), mesh, config=config)
    return jax.jit(lambda key: init(config, key), out_shardings=shardings)(rng)


def state_leaf_spec(names: tuple[str, ...], shape: tuple[int, ...], mesh: Mesh | Mapping[str, int], *,
                    config: ModelConfig) -> PartitionSpec:
    """A state leaf that mirrors a parameter of `GLM5(config)` (momenta, second moments) is sharded like that
    parameter; anything else (step counts, Newton-Schulz coefficients) is replicated."""
    if names and names[-1] in _SPLIT_PART_NAMES:
        names = names[:-1]
    infos = model_param_infos(config)
    for start in range(len(names)):
        info = infos.get(tuple(names[start:]))
        if info is not None and len(info.axes) == len(shape):
            return logical_to_spec(info.axes, shape, mesh)
    return PartitionSpec()


def opt_state_shardings(opt_state, mesh: Mesh, *, config: ModelConfig):
    """NamedSharding of every optimizer-state leaf (arrays or `jax.ShapeDtypeStruct`s) of an optimizer over the
    weights of `GLM5(config)`."""
    _check_mesh(mesh)
    return jax.tree_util.tree_map_with_path(
        lambda path, leaf: NamedSharding(mesh, state_leaf_spec(path_names(path), tuple(leaf.shape), mesh,
                                                               config=config)),
        opt_state)


def init_opt_state_sharded(tx: optax.GradientTransformation, params, mesh: Mesh, *, config: ModelConfig):
    """`tx.init(params)` with every state leaf created directly in its shard."""
    abstract = jax.eval_shape(tx.init, params)
    return jax.jit(tx.init, out_shardings=opt_state_shardings(abstract, mesh, config=config))(params)
