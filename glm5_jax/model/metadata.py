"""What the model's modules say about each weight, looked up for a parameter tree (the pure dict of a `GLM5`
state): the logical names of its dims, whether it is the router's correction bias (a `RouterBias`, never
trained by gradients) and whether it belongs to a lightning indexer. Sharding, the optimizer's groups and
the bias update read these instead of matching paths.

The answers depend only on which sections a tree has (dense stack, MoE stack, MTP), not on any size, so
they are read once per combination off a small model built from shapes only.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
from flax import nnx

from glm5_jax.config import ModelConfig
from glm5_jax.model.indexer import Indexer
from glm5_jax.model.transformer import GLM5
from glm5_jax.model.variables import RouterBias, logical_axes
from glm5_jax.tree_paths import path_names

SECTIONS = ("embed", "dense_layers", "moe_layers", "indexers", "final_norm", "lm_head", "mtp")


class ParamMetadataError(ValueError):
    """A parameter tree holds a leaf that is not a weight of the model, or one of another rank."""


@dataclasses.dataclass(frozen=True)
class ParamInfo:
    axes: tuple[str, ...]  # logical dim names; "layers" first for a stacked layer's weight
    router_bias: bool      # the MoE router's correction bias (a `RouterBias`)
    in_indexer: bool       # a weight of a lightning indexer (the stacked ones or the MTP layer's own)

    @property
    def stacked_axes(self) -> int:
        """Leading dims that index copies of a matrix (stacked layers, routed experts), not its rows/columns."""
        return sum(name in ("layers", "experts") for name in self.axes)


def _structural_config(dense: bool, moe: bool, mtp: bool) -> ModelConfig:
    layers = int(dense) + int(moe)
    return ModelConfig(vocab_size=8, hidden_size=8, intermediate_size=8, moe_intermediate_size=8,
                       num_hidden_layers=layers, first_k_dense_replace=int(dense) if moe else layers,
                       num_attention_heads=1, q_lora_rank=8, kv_lora_rank=8, qk_nope_head_dim=8,
                       qk_rope_head_dim=4, v_head_dim=8, n_routed_experts=2, n_shared_experts=1,
                       num_experts_per_tok=1, n_group=1, topk_group=1, index_n_heads=1, index_head_dim=8,
                       index_topk=2, num_nextn_predict_layers=int(mtp))


@functools.lru_cache(maxsize=8)
def _infos(dense: bool, moe: bool, mtp: bool) -> dict[tuple[str, ...], ParamInfo]:
    model = nnx.eval_shape(lambda: GLM5(_structural_config(dense, moe, mtp), nnx.Rngs(0)))
    indexers = [path for path, node in nnx.iter_graph(model) if isinstance(node, Indexer)]
    return {tuple(map(str, path)): ParamInfo(logical_axes(variable), isinstance(variable, RouterBias),
                                             any(tuple(path[:len(p)]) == tuple(p) for p in indexers))
            for path, variable in nnx.to_flat_state(nnx.state(model))}


def all_param_infos() -> dict[tuple[str, ...], ParamInfo]:
    """Every weight the model can have, by path (for trees that mirror parameters, such as optimizer state)."""
    return _infos(True, True, True)


def param_info(names: tuple[str, ...], ndim: int) -> ParamInfo:
    """The metadata of the weight at path `names` (e.g. ("moe_layers", "attn", "o_proj", "kernel"))."""
    info = all_param_infos().get(tuple(names))
    if info is None:
        known = sorted("/".join(p) for p in all_param_infos())
        raise ParamMetadataError(f"parameter '{'/'.join(names)}' is not a weight of the GLM5 model (its weights "
                                 f"are {known[:3]} ... {known[-2:]})")
    if len(info.axes) != ndim:
        raise ParamMetadataError(f"parameter '{'/'.join(names)}' has rank {ndim} but the model creates it with "
                                 f"{len(info.axes)} dims {info.axes}")
    return info


def param_infos(params):
    """A `ParamInfo` for every leaf of `params` (arrays or `jax.ShapeDtypeStruct`s), as a tree of the same
    structure."""
    return jax.tree_util.tree_map_with_path(lambda path, leaf: param_info(path_names(path), len(leaf.shape)),
                                            params)


def is_param_info(x) -> bool:
    return isinstance(x, ParamInfo)
