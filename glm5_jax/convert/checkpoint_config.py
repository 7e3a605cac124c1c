"""A checkpoint's config.json -> ModelConfig, with the checks the HF config mapping alone does not make.

- `dtype` (transformers 5; `torch_dtype` before) sets the parameter and compute dtypes: HF computes in the
  dtype it loads, so a float32 checkpoint computed in bfloat16 would give logits that differ from HF's.
- `mlp_layer_types` is what transformers builds its layers from; this model has `first_k_dense_replace`
  dense layers then MoE layers, so the list must be that pattern and agree with `first_k_dense_replace`.
"""

from __future__ import annotations

import dataclasses

from glm5_jax.config import DTYPES, ModelConfig, model_config_from_hf
from glm5_jax.convert.hf_layout import ConversionError

MLP_LAYER_TYPES = ("dense", "sparse")


def checkpoint_dtype(hf_config: dict) -> str | None:
    """The dtype config.json declares (None when it declares none)."""
    value = hf_config.get("dtype", hf_config.get("torch_dtype"))
    if value is None:
        return None
    value = str(value).removeprefix("torch.")
    if value not in DTYPES:
        raise ConversionError(f"config.json dtype={value!r} is not supported: the weights must be one of {DTYPES} "
                              "(FP8 checkpoints declare their unquantized dtype next to quantization_config)")
    return value


def dense_layers_from_types(hf_config: dict) -> int | None:
    """`first_k_dense_replace` implied by `mlp_layer_types` (None when absent); refuses lists this model cannot
    build and lists that contradict `first_k_dense_replace`."""
    types = hf_config.get("mlp_layer_types")
    if types is None:
        return None
    layers = hf_config.get("num_hidden_layers")
    if not isinstance(types, (list, tuple)):
        raise ConversionError(f"config.json mlp_layer_types={types!r} is invalid: must be a list of "
                              f"{MLP_LAYER_TYPES}, one per layer")
    if len(types) != layers:
        raise ConversionError(f"config.json mlp_layer_types has {len(types)} entries; num_hidden_layers={layers} "
                              "needs one per layer")
    bad = [t for t in types if t not in MLP_LAYER_TYPES]
    if bad:
        raise ConversionError(f"config.json mlp_layer_types contains {bad[0]!r}; valid types are {MLP_LAYER_TYPES}")
    dense = types.index("sparse") if "sparse" in types else len(types)
    if any(t == "dense" for t in types[dense:]):
        raise ConversionError(f"config.json mlp_layer_types={list(types)} has a dense layer after a sparse one: this "
                              "model supports only dense layers first, then MoE layers")
    declared = hf_config.get("first_k_dense_replace")
    if declared is not None and min(declared, layers) != dense:
        raise ConversionError(f"config.json mlp_layer_types has {dense} dense layers first but first_k_dense_replace"
                              f"={declared}: the two disagree, so the checkpoint's layers are ambiguous; fix one")
    return dense


def model_config_from_checkpoint(hf_config: dict, *, param_dtype: str | None = None,
                                 compute_dtype: str | None = None) -> tuple[ModelConfig, str]:
    """(config, a line saying which dtypes were chosen and why)."""
    for name, value in (("param_dtype", param_dtype), ("compute_dtype", compute_dtype)):
        if value is not None and value not in DTYPES:
            raise ConversionError(f"{name}={value!r} is invalid: must be one of {DTYPES}")
    hf_config = dict(hf_config)
    dense = dense_layers_from_types(hf_config)
    if dense is not None:
        hf_config["first_k_dense_replace"] = dense
    declared = checkpoint_dtype(hf_config)
    chosen_params = param_dtype or declared or "float32"
    chosen_compute = compute_dtype or declared or "bfloat16"
    config = dataclasses.replace(model_config_from_hf(hf_config), param_dtype=chosen_params,
                                 compute_dtype=chosen_compute).validate()
    source = f"config.json dtype={declared}" if declared else "config.json declares no dtype"
    note = (f"parameters {chosen_params}{' (asked)' if param_dtype else ''}, compute {chosen_compute}"
            f"{' (asked)' if compute_dtype else ''}; {source}")
    return config, note
