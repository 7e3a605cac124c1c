"""Hugging Face GlmMoeDsa checkpoints <-> the glm5_jax parameter pytree, in host memory (small models, tests).

The leaf <-> tensor table is `hf_layout`; large checkpoints go through `streaming_import.import_hf` (onto a
mesh, one tensor at a time) and `sharded_export.export_hf` (sharded files, one tensor at a time).
"""

from __future__ import annotations

from pathlib import Path

import jax
import numpy as np

from glm5_jax.config import ModelConfig
from glm5_jax.convert.checkpoint_config import model_config_from_checkpoint
from glm5_jax.convert.hf_layout import ConversionError  # noqa: F401  (re-exported: the error of every import)
from glm5_jax.convert.import_plan import materialise, plan_import
from glm5_jax.convert.sharded_export import export_hf, hf_config_dict, hf_tensors  # noqa: F401
from glm5_jax.convert.tensor_source import CheckpointDir, DictSource


def to_hf_state_dict(params: dict, config: ModelConfig, *, fused_experts: bool = False,
                     include_mtp: bool = True) -> dict[str, np.ndarray]:
    """Export to HF tensor names. `fused_experts=False` gives the released checkpoint layout, True the
    in-memory transformers layout (`experts.gate_up_proj` [E, 2F, D], `experts.down_proj` [E, D, F])."""
    params = jax.tree.map(np.asarray, params)  # one transfer per leaf, then host slicing per tensor
    out = {spec.name: np.ascontiguousarray(recipe.to_hf(leaf[index] if index else leaf))
           for spec, recipe, leaf, index in hf_tensors(params, config, include_mtp=include_mtp)}
    if fused_experts:
        _fuse_experts(out, config)
    return out


def _fuse_experts(state: dict, config: ModelConfig) -> None:
    layers = list(range(config.num_dense_layers, config.num_hidden_layers))
    if config.num_nextn_predict_layers and f"model.layers.{config.num_hidden_layers}.eh_proj.weight" in state:
        layers.append(config.num_hidden_layers)
    for layer in layers:
        p = f"model.layers.{layer}.mlp.experts."
        per = {n: [state.pop(f"{p}{e}.{n}.weight") for e in range(config.n_routed_experts)]
               for n in ("gate_proj", "up_proj", "down_proj")}
        state[p + "gate_up_proj"] = np.concatenate([np.stack(per["gate_proj"]), np.stack(per["up_proj"])], axis=1)
        state[p + "down_proj"] = np.stack(per["down_proj"])


def from_hf_state_dict(state_dict: dict, config: ModelConfig, *, require_mtp: bool = False,
                       dtype=None) -> dict:
    """Import HF tensors (either layout; numpy arrays or torch tensors) as host numpy arrays. The MTP layer
    is read when present (or required). Torch tensors arrive as float32; numpy arrays keep their dtype."""
    source = DictSource(state_dict)
    return materialise(source, plan_import(source, config, dtype=dtype, require_mtp=require_mtp))


def save_hf_checkpoint(params: dict, config: ModelConfig, path: str | Path, *,
                       max_shard_bytes: int | None = None) -> Path:
    """Write `config.json` and safetensors in the released checkpoint layout (MTP layer included), dtypes
    kept; sharded with an index when `max_shard_bytes` is given and exceeded."""
    kwargs = {} if max_shard_bytes is None else {"max_shard_bytes": max_shard_bytes}
    export_hf(params, config, path, **kwargs)
    return Path(path)


def load_hf_checkpoint(path: str | Path, config: ModelConfig | None = None, dtype=None,
                       compute_dtype: str | None = None) -> tuple[dict, ModelConfig]:
    """Read a checkpoint directory into host numpy arrays; the config comes from its config.json (dtype
    and mlp_layer_types honoured) unless given. `dtype` casts the parameters. Returns (params, config)."""
    source = CheckpointDir(path)
    if config is None:
        config, _ = model_config_from_checkpoint(source.config, param_dtype=None if dtype is None else
                                                 np.dtype(dtype).name, compute_dtype=compute_dtype)
    return materialise(source, plan_import(source, config, dtype=dtype)), config
