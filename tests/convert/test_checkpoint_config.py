"""config.json's dtype sets the parameter and compute dtypes; mlp_layer_types is read and must agree with
first_k_dense_replace."""

import json
import sys
from pathlib import Path

import jax
import numpy as np
import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from hf_checkpoints import SMALL, tie_free_bf16_model  # noqa: E402

from glm5_jax.convert.checkpoint_config import model_config_from_checkpoint  # noqa: E402
from glm5_jax.convert.hf import ConversionError, hf_config_dict, load_hf_checkpoint  # noqa: E402
from glm5_jax.model.transformer import FORWARD_STATIC_ARGNAMES, forward  # noqa: E402

HF = hf_config_dict(SMALL)  # num_hidden_layers=3, first_k_dense_replace=1


@pytest.mark.slow
def test_float32_checkpoint_computes_in_float32_and_matches_hf(tmp_path):
    model, tokens, hf_logits = tie_free_bf16_model(dtype=torch.float32)
    model.save_pretrained(tmp_path)
    assert json.loads((tmp_path / "config.json").read_text())["dtype"] == "float32"
    params, config = load_hf_checkpoint(tmp_path)
    assert (config.param_dtype, config.compute_dtype) == ("float32", "float32")
    jitted = jax.jit(forward, static_argnames=FORWARD_STATIC_ARGNAMES)
    logits = np.asarray(jitted(jax.tree.map(jax.numpy.asarray, params), tokens, config=config).logits)
    np.testing.assert_allclose(logits, hf_logits, atol=1e-4, rtol=0)


@pytest.mark.parametrize("declared, params, compute", [("bfloat16", "bfloat16", "bfloat16"),
                                                       ("float32", "float32", "float32"),
                                                       ("torch.float32", "float32", "float32"),
                                                       (None, "float32", "bfloat16")])
def test_declared_dtype_chooses_parameter_and_compute_dtypes(declared, params, compute):
    hf = {k: v for k, v in HF.items() if k != "dtype"}
    if declared is not None:
        hf["torch_dtype" if declared.startswith("torch.") else "dtype"] = declared
    config, note = model_config_from_checkpoint(hf)
    assert (config.param_dtype, config.compute_dtype) == (params, compute)
    assert f"parameters {params}, compute {compute}" in note
    asked, note = model_config_from_checkpoint(hf, compute_dtype="float32")
    assert asked.compute_dtype == "float32" and "compute float32 (asked)" in note
    with pytest.raises(ConversionError, match="compute_dtype='fp8' is invalid"):
        model_config_from_checkpoint(hf, compute_dtype="fp8")


def test_unsupported_checkpoint_dtype_is_refused():
    with pytest.raises(ConversionError, match="dtype='int8' is not supported"):
        model_config_from_checkpoint(dict(HF, dtype="int8"))


def test_mlp_layer_types_are_read():
    config, _ = model_config_from_checkpoint(dict(
        {k: v for k, v in HF.items() if k != "first_k_dense_replace"}, mlp_layer_types=["dense", "dense", "sparse"]))
    assert config.first_k_dense_replace == 2 and config.num_dense_layers == 2
    agreeing, _ = model_config_from_checkpoint(dict(HF, mlp_layer_types=["dense", "sparse", "sparse"]))
    assert agreeing.first_k_dense_replace == 1


@pytest.mark.parametrize("types, message", [
    (["dense", "dense", "sparse"], "has 2 dense layers first but first_k_dense_replace=1: the two disagree"),
    (["sparse", "dense", "sparse"], "has a dense layer after a sparse one"),
    (["dense", "moe", "sparse"], "contains 'moe'; valid types are"),
    (["dense", "sparse"], "has 2 entries; num_hidden_layers=3 needs one per layer"),
])
def test_contradictory_mlp_layer_types_are_refused(types, message):
    with pytest.raises(ConversionError, match=message):
        model_config_from_checkpoint(dict(HF, mlp_layer_types=types))


def test_checkpoint_whose_layer_types_contradict_is_refused_on_load(hf_checkpoint, tmp_path):
    path, *_ = hf_checkpoint
    for item in path.iterdir():
        (tmp_path / item.name).symlink_to(item)
    hf = json.loads((path / "config.json").read_text())
    assert hf["mlp_layer_types"] == ["dense", "sparse", "sparse"]  # transformers writes the list
    (tmp_path / "config.json").unlink()
    (tmp_path / "config.json").write_text(json.dumps(dict(hf, mlp_layer_types=["dense", "dense", "sparse"])))
    with pytest.raises(ConversionError, match="mlp_layer_types has 2 dense layers first but first_k_dense_replace=1"):
        load_hf_checkpoint(tmp_path)
