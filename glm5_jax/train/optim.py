"""Optimizers for GLM-5: AdamW, and Muon (+ Muon Split) for matrices with AdamW for the rest.

Parameter groups come from what the model's modules say about each weight of `GLM5(config)`
(`glm5_jax.model.metadata`: its logical dim names, its variable type, whether an indexer owns it; see
`param_path_labels`):
  "muon"            every matrix, when `name == "muon"`;
  "adamw"           the embedding and LM head (a "vocab" dim) and the MoE router (and every matrix when
                    `name == "adamw"`);
  "adamw_no_decay"  norm scales/biases and any other leaf with fewer than two matrix axes;
  "frozen"          the router correction bias (a `RouterBias`: updated by the train step, never by the
                    optimizer) and every leaf outside `trainable`: zero update, no optimizer state, excluded
                    from clipping.
The router kernel [D, E] stays in AdamW as the parameter tree fixes: its columns are the expert centroids
whose scale sets the sigmoid scores the correction bias balances, and orthogonalising them would equalise
every expert's update regardless of its load.

Muon follows Moonlight / GLM-5: Nesterov momentum 0.95, 5 Newton-Schulz steps, the orthogonalised update
scaled by `muon_rms * sqrt(max(fan_in, fan_out))` so its RMS matches AdamW's, decoupled weight decay, one
learning rate for both groups. Leading stacked axes (layers L / Lf, experts E) are batch axes: one matrix
per slice; the layer axis is walked one layer at a time (`muon_layerwise`) so a pod never holds every
layer's Newton-Schulz intermediates at once, and with the step's mesh the FSDP-sharded stacks run on whole
matrices, their layers spread over the devices (no Gram-matrix all-reduce). Matrix layouts per leaf:
  q_b_proj  [L, Q, H, K]       split: one [Q, K] per (layer, head);   else one [Q, (H K)] per layer
  kv_b_proj [L, C, H, nope+P]  split: W_UK [C, nope] and W_UV [C, P] per (layer, head), cut at the config's
                               qk_nope_head_dim; else [C, (H (nope+P))]
  o_proj    [L, D, H, P]       one [(H P), D] per layer
  other     [.., in, out...]   the first non-batch axis is the input, the rest the output
"""

from __future__ import annotations

import math
import re
from typing import Callable, NamedTuple

import jax
import jax.numpy as jnp
import optax
from jax.sharding import NamedSharding
from optax.contrib import MuonDimensionNumbers

from glm5_jax.config import ModelConfig
from glm5_jax.config.core import _fail
from glm5_jax.config.optim import OptimConfig
from glm5_jax.distributed.logical_axes import logical_to_spec
from glm5_jax.model.metadata import ParamInfo, param_info
from glm5_jax.tree_paths import path_names, path_string
from glm5_jax.train.muon_layerwise import fans, scale_by_muon_layerwise
from glm5_jax.train.schedules import warmup_then_decay

# Matrices AdamW keeps whatever the optimizer: the embedding and LM head (a "vocab" dim) and the router.
_ADAMW_AXES = ("vocab", "router_experts")
_KV_PARTS = ("uk", "uv")
# The kv up-projection's matrix axes: per head, its head_dim holds the keys' nope dims (W_UK), then the values'.
_KV_UP_AXES = ("kv_lora", "heads", "head_dim")


def learning_rate_schedule(cfg: OptimConfig) -> optax.Schedule:
    """Warm-up to `cfg.lr` over `warmup_steps`, then `cfg.schedule` decay to `cfg.min_lr` at `total_steps`."""
    return warmup_then_decay(cfg.schedule, peak=cfg.lr, end=cfg.min_lr, warmup_steps=cfg.warmup_steps,
                             total_steps=cfg.total_steps)


# ---------------------------------------------------------------------------------------------
# Parameter paths and groups
# ---------------------------------------------------------------------------------------------

def _is_trainable(path: str, info: ParamInfo, trainable) -> bool:
    if trainable == "all":
        return True
    if trainable == "indexer":
        return info.in_indexer
    if trainable == "non_indexer":
        return not info.in_indexer
    return any(re.search(pattern, path) for pattern in trainable)


def _leaf_label(names: tuple[str, ...], shape: tuple[int, ...], cfg: OptimConfig, config: ModelConfig) -> str:
    info = param_info(names, config, shape)
    if info.router_bias or not _is_trainable("/".join(names), info, cfg.trainable):
        return "frozen"
    if len(info.axes) - info.stacked_axes < 2:  # norm scales and biases
        return "adamw_no_decay"
    if cfg.name == "adamw" or any(name in _ADAMW_AXES for name in info.axes):
        return "adamw"
    return "muon"


def param_path_labels(params, cfg: OptimConfig | None = None, *, config: ModelConfig):
    """The optimizer group ("muon" | "adamw" | "adamw_no_decay" | "frozen") of every leaf of `params` (the
    weights of `GLM5(config)` or part of them), as a pytree.

    Only shapes are read, so `params` may be abstract (`jax.eval_shape` output).
    """
    cfg = cfg or OptimConfig()
    return jax.tree_util.tree_map_with_path(
        lambda path, leaf: _leaf_label(path_names(path), tuple(leaf.shape), cfg, config), params)


def _muon_dimension_numbers(names: tuple[str, ...], ndim: int, split: bool,
                            config: ModelConfig) -> MuonDimensionNumbers:
    """Which axes of a Muon leaf form each matrix's input and output; all other axes are batch axes."""
    if names[-1] in _KV_PARTS:  # one half of a split kv_b_proj: [.., C, H, nope or P] per head
        return MuonDimensionNumbers(reduction_axis=ndim - 3, output_axis=ndim - 1)
    info = param_info(names, config)
    core = tuple(range(info.stacked_axes, ndim))
    if info.axes[core[0]] == "embed" and "heads" in info.axes:  # o_proj [.., D, H, P]: the heads' outputs, one input
        return MuonDimensionNumbers(reduction_axis=core[1:], output_axis=core[:1])
    if split and "heads" in info.axes:  # q_b_proj / kv_b_proj [.., in, H, out]: one matrix per head
        return MuonDimensionNumbers(reduction_axis=core[0], output_axis=core[-1])
    return MuonDimensionNumbers(reduction_axis=core[0], output_axis=core[1:])


def _kv_up_projections(params, labels, config: ModelConfig) -> frozenset[str]:
    """The paths of the Muon leaves that are kv up-projections (logical axes [.., kv_lora, heads, head_dim])."""
    return frozenset(path_string(path) for (path, _), label in
                     zip(jax.tree_util.tree_flatten_with_path(params)[0], jax.tree.leaves(labels))
                     if label == "muon" and param_info(path_names(path), config).axes[-3:] == _KV_UP_AXES)


# ---------------------------------------------------------------------------------------------
# Transformations
# ---------------------------------------------------------------------------------------------

class _KVParts(NamedTuple):
    """kv_b_proj split along its last axis into W_UK (keys, nope dims) and W_UV (values)."""

    uk: jax.Array
    uv: jax.Array


def _split_kv_heads(inner: optax.GradientTransformation, kv_paths: frozenset[str], nope: int):
    """Run `inner` on trees whose kv up-projections (at `kv_paths`) are split after each head's `nope` key
    dims into W_UK / W_UV, then rejoin the updates."""
    is_parts = lambda x: isinstance(x, _KVParts)

    def split(tree):
        def split_leaf(path, x):
            return _KVParts(x[..., :nope], x[..., nope:]) if path_string(path) in kv_paths else x
        return jax.tree_util.tree_map_with_path(split_leaf, tree)

    def join(tree):
        return jax.tree.map(lambda x: jnp.concatenate(x, axis=-1) if is_parts(x) else x, tree, is_leaf=is_parts)

    def init_fn(params):
        return inner.init(split(params))

    def update_fn(updates, state, params=None):
        updates, state = inner.update(split(updates), state, None if params is None else split(params))
        return join(updates), state

    return optax.GradientTransformation(init_fn, update_fn)


def _dimension_numbers_fn(split: bool, config: ModelConfig) -> Callable:
    def dims(tree):
        return jax.tree_util.tree_map_with_path(
            lambda path, x: _muon_dimension_numbers(path_names(path), x.ndim, split, config), tree)
    return dims


def _leaf_axes(path, config: ModelConfig) -> tuple:
    """The logical axes of the weight an optimizer leaf at `path` belongs to."""
    names = path_names(path)
    names = names[:-1] if names[-1] in _KV_PARTS else names  # a half of a split kv_b_proj kernel
    return param_info(names, config).axes


def _layer_stacked_fn(config: ModelConfig) -> Callable:
    """True for every leaf whose axis 0 is a stacked layer axis (the scanned stacks), which Muon maps over."""
    return lambda tree: jax.tree_util.tree_map_with_path(lambda path, x: _leaf_axes(path, config)[0] == "layers",
                                                         tree)


def _home_fn(config: ModelConfig, mesh) -> Callable | None:
    """Per leaf, its `NamedSharding` on `mesh` where Newton-Schulz should run on layers spread over the mesh
    (stacked matrices without an expert axis: a routed expert's matrices already sit whole on one chip), else
    False."""
    if mesh is None:
        return None

    def home(path, x):
        axes = _leaf_axes(path, config)
        if axes[0] != "layers" or "experts" in axes:
            return False
        return NamedSharding(mesh, logical_to_spec(axes, x.shape, mesh))
    return lambda tree: jax.tree_util.tree_map_with_path(home, tree)


def _scale_to_rms(dims_fn: Callable, rms: float) -> optax.GradientTransformation:
    """Scale each orthogonalised matrix by rms * sqrt(max(fan_in, fan_out)) so its update RMS is ~`rms`."""
    def update_fn(updates, state, params=None):
        del params
        scaled = jax.tree.map(
            lambda u, dims: u * (rms * math.sqrt(max(fans(u.shape, dims)))),
            updates, dims_fn(updates), is_leaf=lambda x: isinstance(x, MuonDimensionNumbers))
        return scaled, state
    return optax.GradientTransformation(optax.init_empty_state, update_fn)


def _zero_where_frozen(labels) -> optax.GradientTransformation:
    """Zero the gradients of frozen leaves before clipping, so they do not count in the global norm."""
    def update_fn(updates, state, params=None):
        del params
        return jax.tree.map(lambda u, label: jnp.zeros_like(u) if label == "frozen" else u, updates, labels), state
    return optax.GradientTransformation(optax.init_empty_state, update_fn)


def _muon(cfg: OptimConfig, schedule, kv_paths: frozenset[str], config: ModelConfig,
          mesh) -> optax.GradientTransformation:
    dims_fn = _dimension_numbers_fn(cfg.muon_split, config)
    orthogonalise = optax.chain(
        scale_by_muon_layerwise(dims_fn, _layer_stacked_fn(config), ns_steps=cfg.ns_steps,
                                beta=cfg.muon_momentum, eps=cfg.eps, mu_dtype=cfg.mu_dtype,
                                home_fn=_home_fn(config, mesh) if cfg.muon_spread_layers else None),
        _scale_to_rms(dims_fn, cfg.muon_rms),
    )
    return optax.chain(
        _split_kv_heads(orthogonalise, kv_paths, config.qk_nope_head_dim),
        optax.add_decayed_weights(cfg.weight_decay),
        optax.scale_by_learning_rate(schedule),
    )


def make_optimizer(cfg: OptimConfig, params, *, config: ModelConfig, mesh=None) -> optax.GradientTransformation:
    """The optax transformation for `cfg` over a parameter tree shaped like `params` (arrays or abstract): the
    weights of `GLM5(config)`, or part of them. With the `mesh` the step runs on, Muon orthogonalises the
    FSDP-sharded matrices on whole layers spread over its devices (`muon_layerwise`)."""
    if not isinstance(cfg, OptimConfig):
        raise TypeError(f"cfg must be an OptimConfig, got {type(cfg).__name__}")
    leaves = jax.tree_util.tree_flatten_with_path(params)[0]
    if not leaves:
        raise ValueError("params is empty: make_optimizer needs the parameter tree it will update")
    if isinstance(cfg.trainable, tuple):
        paths = [path_string(path) for path, _ in leaves]
        for pattern in cfg.trainable:
            if not any(re.search(pattern, path) for path in paths):
                _fail("optim.trainable", pattern, f"matches no parameter path; paths look like {paths[:4]}")
    labels = param_path_labels(params, cfg, config=config)
    present = set(jax.tree.leaves(labels))
    if present == {"frozen"}:
        _fail("optim.trainable", cfg.trainable, "leaves no trainable parameter")
    schedule = learning_rate_schedule(cfg)
    adamw = lambda decay: optax.adamw(schedule, b1=cfg.b1, b2=cfg.b2, eps=cfg.eps, weight_decay=decay,
                                      mu_dtype=cfg.mu_dtype)
    groups = {
        "adamw": adamw(cfg.weight_decay),
        "adamw_no_decay": adamw(0.0),
        "frozen": optax.set_to_zero(),
    }
    if "muon" in present:
        kv_paths = _kv_up_projections(params, labels, config) if cfg.muon_split else frozenset()
        groups["muon"] = _muon(cfg, schedule, kv_paths, config, mesh)
    clip = [optax.clip_by_global_norm(cfg.grad_clip_norm)] if cfg.grad_clip_norm > 0 else []
    return optax.chain(
        _zero_where_frozen(labels),
        *clip,
        optax.multi_transform({name: tx for name, tx in groups.items() if name in present}, labels),
    )
