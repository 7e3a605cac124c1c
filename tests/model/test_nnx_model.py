"""The model as Flax NNX modules: the module, its split state and the pure `forward` compute the same thing;
every weight carries its logical axes; the router correction bias is a `RouterBias`, not a trained Param."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from glm5_jax.config import ModelConfig
from glm5_jax.model import attention, decoder, indexer, moe, mtp
from glm5_jax.model.transformer import GLM5, forward, init, merge
from glm5_jax.model.variables import RouterBias, logical_axes

TINY = ModelConfig(vocab_size=97, hidden_size=32, intermediate_size=48, moe_intermediate_size=16,
                   num_hidden_layers=3, num_attention_heads=2, q_lora_rank=16, kv_lora_rank=16,
                   qk_nope_head_dim=8, qk_rope_head_dim=4, v_head_dim=8, n_routed_experts=8,
                   num_experts_per_tok=2, n_group=2, topk_group=1, first_k_dense_replace=1, index_n_heads=4,
                   index_head_dim=8, index_topk=4, mtp_num_steps=2, compute_dtype="float32").validate()


@pytest.fixture(scope="module")
def model():
    """The module built eagerly (op by op: seconds of CPU), once for the file, from the key `init` is compared
    with below."""
    return GLM5(TINY, nnx.Rngs(params=jax.random.key(3)))


@pytest.fixture(scope="module")
def abstract_model():
    return nnx.eval_shape(lambda: GLM5(TINY, nnx.Rngs(0)))  # the same graph and metadata, no values


def test_every_layer_is_an_nnx_module(abstract_model):
    model = abstract_model
    kinds = {type(node) for _, node in nnx.iter_graph(model) if isinstance(node, nnx.Module)}
    for cls in (GLM5, decoder.DecoderLayer, attention.MLA, indexer.Indexer, moe.MoE, moe.RoutedExperts, mtp.MTP):
        assert cls in kinds, cls.__name__


@pytest.mark.slow
def test_module_split_state_and_pure_forward_agree(model):
    tokens = jax.random.randint(jax.random.key(1), (2, 12), 0, TINY.vocab_size)
    direct = model(tokens)
    graphdef, state = nnx.split(model)
    pure = nnx.to_pure_dict(state)
    jitted = jax.jit(forward, static_argnames="config")
    for params in (state, pure):
        out = jitted(params, tokens, config=TINY)
        np.testing.assert_allclose(out.logits, direct.logits, rtol=1e-5, atol=1e-5)
        np.testing.assert_allclose(out.mtp_logits, direct.mtp_logits, rtol=1e-5, atol=1e-5)
    again = nnx.merge(graphdef, state)(tokens)
    np.testing.assert_array_equal(again.logits, direct.logits)


@pytest.mark.slow
def test_init_is_the_pure_dict_of_the_module_state(model):
    params = init(TINY, jax.random.key(3))
    state = nnx.state(model)  # calling the module (the test above) changes none of it
    assert jax.tree.structure(params) == jax.tree.structure(nnx.to_pure_dict(state))
    for got, want in zip(jax.tree.leaves(params), jax.tree.leaves(nnx.to_pure_dict(state))):
        np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-9)  # compiled vs eager: rounding only
    assert merge(params, TINY).config == TINY


def test_every_weight_carries_logical_axes_of_its_rank(abstract_model):
    model = abstract_model
    flat = nnx.to_flat_state(nnx.state(model))
    assert flat
    for path, variable in flat:
        axes = logical_axes(variable)
        assert len(axes) == variable.get_raw_value().ndim, (path, axes)
        assert (axes[0] == "layers") == (path[0] in ("dense_layers", "moe_layers", "indexers")), (path, axes)


def test_router_bias_is_its_own_variable_type(abstract_model):
    model = abstract_model
    biases = nnx.to_flat_state(nnx.state(model, RouterBias))
    assert sorted(path for path, _ in biases) == [("moe_layers", "moe", "e_score_correction_bias"),
                                                  ("mtp", "layer", "moe", "e_score_correction_bias")]
    trained = {path for path, _ in nnx.to_flat_state(nnx.state(model, nnx.Param))}
    assert not trained & {path for path, _ in biases}
    assert model.moe_layers.moe.e_score_correction_bias.get_raw_value().dtype == jnp.float32


@pytest.mark.slow
def test_params_without_mtp_merge_into_a_model_without_it():
    params = {k: v for k, v in init(TINY, jax.random.key(0)).items() if k != "mtp"}
    out = forward(params, jnp.ones((1, 6), jnp.int32), config=TINY)
    assert out.mtp_logits is None and out.logits.shape == (1, 6, TINY.vocab_size)
