"""Export -> Hugging Face -> import round trips, bit-exact, the MTP layer (model.layers.<L>) included."""

import dataclasses

import jax
import numpy as np
import pytest

from glm5_jax.config import ModelConfig
from glm5_jax.convert.hf import (ConversionError, from_hf_state_dict, load_hf_checkpoint, save_hf_checkpoint,
                                 to_hf_state_dict)
from glm5_jax.parallel.sharding import abstract_params

CONFIG = ModelConfig(vocab_size=64, hidden_size=32, intermediate_size=48, moe_intermediate_size=16,
                     num_hidden_layers=3, num_attention_heads=2, q_lora_rank=16, kv_lora_rank=16,
                     qk_nope_head_dim=8, qk_rope_head_dim=4, v_head_dim=8, n_routed_experts=4,
                     num_experts_per_tok=2, n_group=2, topk_group=1, first_k_dense_replace=1, index_n_heads=2,
                     index_head_dim=8, index_topk=4, indexer_types=("full", "shared", "full"),
                     compute_dtype="float32").validate()


@pytest.fixture(scope="module")
def params():
    # Random values in every leaf (norms and biases too) so every tensor is distinguishable.
    rng = np.random.RandomState(1)
    return jax.tree.map(lambda a: (0.05 * rng.randn(*a.shape)).astype(np.float32), abstract_params(CONFIG))


def _assert_identical(a, b):
    assert jax.tree.structure(a) == jax.tree.structure(b)
    for (path, x), y in zip(jax.tree_util.tree_flatten_with_path(a)[0], jax.tree.leaves(b)):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y), err_msg=jax.tree_util.keystr(path))


def test_safetensors_round_trip_is_bit_exact_with_mtp(params, tmp_path):
    save_hf_checkpoint(params, CONFIG, tmp_path)
    loaded, config = load_hf_checkpoint(tmp_path)
    assert config.indexer_types == CONFIG.indexer_types
    assert "mtp" in loaded
    _assert_identical(params, loaded)


def test_export_load_into_transformers_and_back_is_bit_exact(params, tmp_path):
    from transformers import GlmMoeDsaForCausalLM

    save_hf_checkpoint(params, CONFIG, tmp_path)
    model = GlmMoeDsaForCausalLM.from_pretrained(tmp_path)
    state = model.state_dict()
    assert "model.layers.1.self_attn.indexer.wk.weight" not in state  # shared layer: no indexer in HF either
    assert not any(k.startswith(f"model.layers.{CONFIG.num_hidden_layers}.") for k in state)  # HF drops MTP
    # HF's in-memory layout fuses experts; the MTP layer comes from the checkpoint file itself.
    exported = to_hf_state_dict(params, CONFIG)
    mtp = {k: v for k, v in exported.items() if k.startswith(f"model.layers.{CONFIG.num_hidden_layers}.")}
    back = from_hf_state_dict({**state, **mtp}, CONFIG, require_mtp=True)
    _assert_identical(params, back)


def test_fused_and_per_expert_layouts_agree(params):
    fused = from_hf_state_dict(to_hf_state_dict(params, CONFIG, fused_experts=True), CONFIG)
    _assert_identical(params, fused)


def test_checkpoint_of_another_shape_is_refused(params):
    state = to_hf_state_dict(params, CONFIG)
    other = dataclasses.replace(CONFIG, kv_lora_rank=8)
    with pytest.raises(ConversionError, match=r"kv_a_(proj_with_mqa|layernorm)\.weight.*another model shape"):
        from_hf_state_dict(state, other)
    state.pop("model.layers.2.mlp.gate.weight")
    with pytest.raises(ConversionError, match="model.layers.2.mlp.gate.weight.*missing"):
        from_hf_state_dict(state, CONFIG)
