"""Export parameters (sharded global arrays or host arrays) as a Hugging Face checkpoint directory:
`model-XXXXX-of-YYYYY.safetensors` files of at most `max_shard_bytes` each plus `model.safetensors.index.json`
(one file: `model.safetensors`, as transformers names it), and `config.json`. Released layout: one tensor per
expert, the MTP layer as `model.layers.{num_hidden_layers}`. Dtypes are kept.

Every process takes part in gathering one HF tensor at a time (a jitted slice with a replicated output);
process 0 writes. File headers are computed from shapes first, so at most one tensor is held on the host.
"""

from __future__ import annotations

import functools
import json
from pathlib import Path
from typing import Iterator

import jax
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec

from glm5_jax.config import ModelConfig
from glm5_jax.convert.hf_layout import ConversionError, LeafRecipe, is_recipe, param_recipes
from glm5_jax.convert.safetensors_io import TensorSpec, write_safetensors
from glm5_jax.convert.tensor_source import INDEX_FILE
from glm5_jax.tree_paths import path_string

DEFAULT_MAX_SHARD_BYTES = 5 * 2**30  # transformers' default max_shard_size ("5GB")


def hf_tensors(params: dict, config: ModelConfig, *, include_mtp: bool = True
               ) -> list[tuple[TensorSpec, LeafRecipe, object, tuple[int, ...]]]:
    """(spec, recipe, leaf, stack index) of every HF tensor, checked against the params' shapes."""
    recipes = param_recipes(config, with_mtp=include_mtp and "mtp" in params)
    if not include_mtp:
        params = {k: v for k, v in params.items() if k != "mtp"}
    recipe_paths = {path_string(p): r for p, r in jax.tree_util.tree_flatten_with_path(recipes, is_leaf=is_recipe)[0]}
    leaf_paths = {path_string(p): leaf for p, leaf in jax.tree_util.tree_flatten_with_path(params)[0]}
    if set(recipe_paths) != set(leaf_paths):
        unknown = sorted(set(leaf_paths) ^ set(recipe_paths))
        raise ConversionError(f"params do not match the config: {unknown[0]!r} is in only one of them "
                              f"(with {len(unknown) - 1} more differences)")
    out = []
    for path, recipe in recipe_paths.items():
        leaf = leaf_paths[path]
        if tuple(leaf.shape) != recipe.shape:
            raise ConversionError(f"params['{path}'] has shape {tuple(leaf.shape)}, the config needs {recipe.shape}")
        for index, name in recipe.names():
            out.append((TensorSpec(name, np.dtype(leaf.dtype), recipe.hf_shape), recipe, leaf, index))
    return out


@functools.lru_cache(maxsize=None)
def _replicated_slicer(sharding):
    out_sharding = NamedSharding(sharding.mesh, PartitionSpec()) if isinstance(sharding, NamedSharding) else None
    return jax.jit(lambda array, index: array[tuple(index)], out_shardings=out_sharding)


def _host_item(leaf, index: tuple[int, ...]) -> np.ndarray:
    if not isinstance(leaf, jax.Array):
        return np.asarray(leaf[index] if index else leaf)
    if not index and leaf.is_fully_addressable:
        return np.asarray(leaf)
    return np.asarray(_replicated_slicer(leaf.sharding)(leaf, np.asarray(index, np.int32)))


def shard_files(specs: list[TensorSpec], max_shard_bytes: int) -> list[list[TensorSpec]]:
    """Group tensors, in order, into files of at most `max_shard_bytes` (a larger tensor gets its own)."""
    files: list[list[TensorSpec]] = [[]]
    size = 0
    for spec in specs:
        if files[-1] and size + spec.nbytes > max_shard_bytes:
            files.append([])
            size = 0
        files[-1].append(spec)
        size += spec.nbytes
    return files


def hf_config_dict(config: ModelConfig, dtype: str = "float32") -> dict:
    """A `config.json` for GlmMoeDsaForCausalLM describing this model, with weights stored as `dtype`."""
    return {
        "architectures": ["GlmMoeDsaForCausalLM"], "model_type": "glm_moe_dsa",
        **{k: getattr(config, k) for k in (
            "vocab_size", "hidden_size", "intermediate_size", "moe_intermediate_size", "num_hidden_layers",
            "num_attention_heads", "q_lora_rank", "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim",
            "v_head_dim", "n_routed_experts", "n_shared_experts", "num_experts_per_tok", "n_group",
            "topk_group", "routed_scaling_factor", "norm_topk_prob", "first_k_dense_replace", "index_n_heads",
            "index_head_dim", "index_topk", "rms_norm_eps", "max_position_embeddings", "hidden_act",
            "tie_word_embeddings", "initializer_range", "num_nextn_predict_layers")},
        "num_key_value_heads": config.num_attention_heads,
        "indexer_types": list(config.layer_indexer_types),
        "rope_parameters": {"rope_type": "default", "rope_theta": config.rope_theta},
        "dtype": dtype,
    }


def export_hf(params: dict, config: ModelConfig, out_dir: str | Path, *,
              max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES, include_mtp: bool = True) -> list[Path]:
    """Write the checkpoint directory; returns the safetensors files written (on every process)."""
    if not isinstance(max_shard_bytes, int) or isinstance(max_shard_bytes, bool) or max_shard_bytes <= 0:
        raise ValueError(f"max_shard_bytes={max_shard_bytes!r} is invalid: must be a positive number of bytes")
    tensors = hf_tensors(params, config, include_mtp=include_mtp)
    by_name = {spec.name: (recipe, leaf, index) for spec, recipe, leaf, index in tensors}
    groups = shard_files([spec for spec, *_ in tensors], max_shard_bytes)
    names = (["model.safetensors"] if len(groups) == 1 else
             [f"model-{i + 1:05d}-of-{len(groups):05d}.safetensors" for i in range(len(groups))])
    out_dir = Path(out_dir)
    writer = jax.process_index() == 0
    if writer:
        out_dir.mkdir(parents=True, exist_ok=True)

    def arrays(group: list[TensorSpec]) -> Iterator[np.ndarray]:
        for spec in group:
            recipe, leaf, index = by_name[spec.name]
            yield np.ascontiguousarray(recipe.to_hf(_host_item(leaf, index)))

    for file_name, group in zip(names, groups):
        if writer:
            write_safetensors(out_dir / file_name, group, arrays(group))
        else:  # the gathers are collective: every process runs them
            for _ in arrays(group):
                pass
    if writer:
        if len(groups) > 1:
            index = {"metadata": {"total_size": sum(s.nbytes for s, *_ in tensors)},
                     "weight_map": {spec.name: name for name, group in zip(names, groups) for spec in group}}
            (out_dir / INDEX_FILE).write_text(json.dumps(index, indent=2))
        dtype = np.dtype(params["embed"]["embedding"].dtype).name
        (out_dir / "config.json").write_text(json.dumps(hf_config_dict(config, dtype), indent=2))
    return [out_dir / name for name in names]
