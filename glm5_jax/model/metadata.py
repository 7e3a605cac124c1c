"""What the model's modules say about each weight, looked up for a parameter tree (the pure dict of a `GLM5`
state, or part of it): the logical names of its dims, its shape, whether it is the router's correction bias
(a `RouterBias`, never trained by gradients) and whether it belongs to a lightning indexer. Sharding, the
optimizer's groups and the bias update read these instead of matching paths.

The answers are read off the weights of `GLM5(config)` itself, the model built from the run's own config by
`nnx.eval_shape` (shapes only: nothing is allocated; about 0.5 s for configs/glm5_744b.yaml on one CPU core),
once per config.
"""

from __future__ import annotations

import dataclasses
import functools
import types
from typing import Mapping

import jax
from flax import nnx

from glm5_jax.config import ModelConfig
from glm5_jax.model.indexer import Indexer
from glm5_jax.model.transformer import GLM5
from glm5_jax.model.variables import RouterBias, logical_axes
from glm5_jax.tree_paths import path_names


class ParamMetadataError(ValueError):
    """A parameter tree holds a leaf that is not a weight of the model, or one of another shape."""


@dataclasses.dataclass(frozen=True)
class ParamInfo:
    axes: tuple[str, ...]   # logical dim names; "layers" first for a stacked layer's weight
    shape: tuple[int, ...]  # the weight's shape in GLM5(config)
    router_bias: bool       # the MoE router's correction bias (a `RouterBias`)
    in_indexer: bool        # a weight of a lightning indexer (the stacked ones or the MTP layer's own)

    @property
    def stacked_axes(self) -> int:
        """Leading dims that index copies of a matrix (stacked layers, routed experts), not its rows/columns."""
        return sum(name in ("layers", "experts") for name in self.axes)


def _check_config(config) -> None:
    if not isinstance(config, ModelConfig):
        raise TypeError(f"config must be the ModelConfig the parameters were built from, got "
                        f"{type(config).__name__}")


@functools.lru_cache(maxsize=8)
def _model_infos(config: ModelConfig) -> Mapping[tuple[str, ...], ParamInfo]:
    model = nnx.eval_shape(lambda: GLM5(config, nnx.Rngs(0)))
    indexers = [tuple(path) for path, node in nnx.iter_graph(model) if isinstance(node, Indexer)]
    return types.MappingProxyType({
        tuple(map(str, path)): ParamInfo(logical_axes(variable), tuple(variable.shape),
                                         isinstance(variable, RouterBias),
                                         any(tuple(path[:len(p)]) == p for p in indexers))
        for path, variable in nnx.to_flat_state(nnx.state(model))})


def model_param_infos(config: ModelConfig) -> Mapping[tuple[str, ...], ParamInfo]:
    """Every weight of `GLM5(config)` by path (for trees that mirror parameters, such as optimizer state)."""
    _check_config(config)
    return _model_infos(config)


def param_info(names: tuple[str, ...], config: ModelConfig, shape: tuple[int, ...] | None = None) -> ParamInfo:
    """The metadata of the weight at path `names` (e.g. ("moe_layers", "attn", "o_proj", "kernel")) in
    `GLM5(config)`; `shape`, when given, must be the weight's."""
    infos = model_param_infos(config)
    info = infos.get(tuple(names))
    if info is None:
        known = sorted("/".join(p) for p in infos)
        raise ParamMetadataError(f"parameter '{'/'.join(names)}' is not a weight of the GLM5 model of this config "
                                 f"(its weights are {known[:3]} ... {known[-2:]})")
    if shape is not None and tuple(shape) != info.shape:
        raise ParamMetadataError(f"parameter '{'/'.join(names)}' has shape {tuple(shape)} but the model of this "
                                 f"config creates it with shape {info.shape} {info.axes}")
    return info


def param_infos(params, config: ModelConfig):
    """A `ParamInfo` for every leaf of `params` (arrays or `jax.ShapeDtypeStruct`s, the weights of
    `GLM5(config)` or any part of them), as a tree of the same structure."""
    return jax.tree_util.tree_map_with_path(lambda path, leaf: param_info(path_names(path), config, leaf.shape),
                                            params)


def is_param_info(x) -> bool:
    return isinstance(x, ParamInfo)
