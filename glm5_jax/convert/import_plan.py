"""Checking a tensor source against the config before reading weights, and building any slice of a leaf.

`plan_import` picks the recipes that fit the source (fused or per-expert experts, tied head, MTP present),
checks that every tensor exists with the expected shape and that nothing is left over, all from names and
shapes alone. `read_leaf_slices` then builds the parts of one leaf that devices own, reading only the HF
tensors under those parts, one at a time.
"""

from __future__ import annotations

import dataclasses
import itertools

import jax
import numpy as np

from glm5_jax.config import ModelConfig
from glm5_jax.convert.hf_layout import (ConversionError, LeafRecipe, ignorable_names, is_recipe, mtp_prefix,
                                        param_recipes)


@dataclasses.dataclass
class ImportPlan:
    recipes: dict          # the tree of LeafRecipes, structured like the params
    dtypes: dict           # the same tree of numpy dtypes the leaves are built in


def plan_import(source, config: ModelConfig, *, dtype=None, require_mtp: bool = False) -> ImportPlan:
    """Recipes for `source` (a `DictSource` or `CheckpointDir`), checked by name and shape."""
    names = source.names()
    first_moe = f"model.layers.{config.num_dense_layers}.mlp."
    fused = config.num_moe_layers > 0 and first_moe + "experts.gate_up_proj" in names
    tied = config.tie_word_embeddings and "lm_head.weight" not in names
    with_mtp = bool(config.num_nextn_predict_layers) and (
        require_mtp or mtp_prefix(config) + "eh_proj.weight" in names)
    fused_mtp = mtp_prefix(config) + "mlp.experts.gate_up_proj" in names
    recipes = param_recipes(config, fused_experts=fused, fused_mtp_experts=fused_mtp, tied_head=tied,
                            with_mtp=with_mtp)
    used: set[str] = set()
    for recipe in jax.tree.leaves(recipes, is_leaf=is_recipe):
        for _, name in recipe.names():
            if name not in names:
                if recipe.default is not None:
                    continue
                raise ConversionError(f"checkpoint tensor {name!r} is missing (expected shape {recipe.hf_shape})")
            if tuple(source.shape(name)) != recipe.hf_shape:
                raise ConversionError(f"checkpoint tensor {name!r} has shape {tuple(source.shape(name))}, the "
                                      f"config needs {recipe.hf_shape}: the checkpoint belongs to another model "
                                      "shape")
            used.add(name)
    leftovers = sorted(n for n in names - used if not n.startswith(ignorable_names(config)))
    if leftovers:
        raise ConversionError(f"checkpoint has {len(leftovers)} tensors the config does not use, e.g. "
                              f"{leftovers[:3]}: check num_hidden_layers / indexer_types / "
                              "first_k_dense_replace")

    def leaf_dtype(recipe: LeafRecipe):
        if dtype is not None:
            return np.dtype(dtype)
        name = next((n for _, n in recipe.names()), None)  # the first item's (stacks hold one dtype)
        if name not in names:  # an omitted optional tensor (the router correction bias), or an empty stack
            return np.dtype(np.float32)
        return np.dtype(source.stored_dtype(name))

    dtypes = jax.tree.map(leaf_dtype, recipes, is_leaf=is_recipe)
    return ImportPlan(recipes, dtypes)


class ItemCache:
    """The last converted HF item, so devices that own different slices of one tensor read it once."""

    def __init__(self):
        self.key, self.value = None, None

    def clear(self) -> None:
        self.key, self.value = None, None

    def get(self, source, recipe: LeafRecipe, index: tuple[int, ...]) -> np.ndarray:
        name = recipe.name(index)
        key = (name, recipe.kind)
        if self.key != key:
            self.key, self.value = None, None  # drop the previous item before reading the next
            if source.has(name):
                value = recipe.to_ours(source.read(name))
            else:
                value = np.full(recipe.item_shape, recipe.default, np.float32)
            self.key, self.value = key, value
        return self.value


def _full_index(recipe: LeafRecipe, index: tuple) -> tuple:
    return tuple(index) + (slice(None),) * (len(recipe.shape) - len(index))


def stack_part(recipe: LeafRecipe, index: tuple) -> tuple:
    """The ranges of the stacked axes an index covers: slices with equal stack parts read the same HF tensors."""
    return tuple(range(*s.indices(n)) for s, n in zip(_full_index(recipe, index), recipe.stack))


def read_leaf_slices(source, recipe: LeafRecipe, dtype, indices: list[tuple],
                     cache: ItemCache | None = None) -> list[np.ndarray]:
    """`[leaf[index] for index in indices]` in `dtype` (unit-step slices, as `jax.make_array_from_callback`
    passes). The indices must cover the same stacked ranges: each HF tensor under them is read once and
    copied into every slice."""
    cache = cache or ItemCache()
    indices = [_full_index(recipe, index) for index in indices]
    k = len(recipe.stack)
    stack_ranges = list(stack_part(recipe, indices[0]))
    if any(list(stack_part(recipe, index)) != stack_ranges for index in indices[1:]):
        raise ValueError(f"slices {indices} cover different stacked layers/experts; read them separately")
    if not stack_ranges:  # one HF tensor: hand over its converted array (or slices) without another copy
        item = cache.get(source, recipe, ())
        return [np.ascontiguousarray(item[index], dtype=dtype) for index in indices]
    outs = [np.empty([len(r) for r in stack_ranges] +
                     [len(range(*s.indices(n))) for s, n in zip(index[k:], recipe.item_shape)], dtype)
            for index in indices]
    for position in itertools.product(*(enumerate(r) for r in stack_ranges)):
        local = tuple(p[0] for p in position)
        item = cache.get(source, recipe, tuple(p[1] for p in position))
        for out, index in zip(outs, indices):
            out[local] = item[index[k:]]
    return outs


def read_leaf_slice(source, recipe: LeafRecipe, dtype, index: tuple = (), cache: ItemCache | None = None
                    ) -> np.ndarray:
    """`leaf[index]` in `dtype`."""
    return read_leaf_slices(source, recipe, dtype, [index], cache)[0]


def materialise(source, plan: ImportPlan) -> dict:
    """Every leaf as a host numpy array (small models, tests and the in-memory state-dict path)."""
    cache = ItemCache()
    return jax.tree.map(lambda recipe, dtype: read_leaf_slice(source, recipe, dtype, cache=cache),
                        plan.recipes, plan.dtypes, is_leaf=is_recipe)
