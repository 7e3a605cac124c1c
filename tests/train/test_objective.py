"""The objective is chosen once from train.mode, and its losses are weighted in one place: the value the step
differentiates and the loss it reports use the same weights."""

import jax.numpy as jnp
import numpy as np
import pytest

from glm5_jax.config import ModelConfig, TrainConfig
from glm5_jax.config.rl import RLConfig, RLStepConfig
from glm5_jax.train.objective import LM_BATCH_KEYS, LMObjective, make_objective
from glm5_jax.train.rl_step import RLObjective

MODEL = ModelConfig(vocab_size=64, hidden_size=32, intermediate_size=48, moe_intermediate_size=16,
                    num_hidden_layers=2, num_attention_heads=2, q_lora_rank=16, kv_lora_rank=16,
                    qk_nope_head_dim=8, qk_rope_head_dim=4, v_head_dim=8, n_routed_experts=4,
                    num_experts_per_tok=2, first_k_dense_replace=1, index_n_heads=2, index_head_dim=8,
                    index_topk=4, mtp_num_steps=2).validate()
TRAIN = dict(batch_size=4, seq_len=12, mtp_loss_weight=0.5, balance_loss_weight=0.25, indexer_kl_weight=2.0)
SUMS = {"lm": jnp.float32(6.0), "mtp": jnp.float32(8.0), "balance": jnp.float32(4.0),
        "indexer_kl": jnp.float32(3.0), "topk_mass": jnp.float32(1.5)}
DENS = {"lm": jnp.float32(2.0), "mtp": jnp.float32(4.0), "balance": jnp.float32(2.0),
        "indexer_kl": jnp.float32(3.0)}
COUNTS = {"main": jnp.array([[2, 4, 6, 0]])}


def _objective(mode):
    return make_objective(MODEL, TrainConfig(mode=mode, **TRAIN))


def test_the_mode_picks_the_objective_once():
    for mode in ("pretrain", "sft", "dsa_warmup", "dsa_sparse"):
        assert isinstance(_objective(mode), LMObjective) and _objective(mode).required_keys == LM_BATCH_KEYS
    rl = make_objective(MODEL, TrainConfig(mode="rl", **TRAIN),
                        RLStepConfig(objective=RLConfig(loss="tis")))
    assert isinstance(rl, RLObjective) and "rollout_logprobs" in rl.required_keys
    assert [_objective(mode).indexer_mode for mode in ("pretrain", "dsa_warmup", "dsa_sparse")] == \
        [None, "dense_warmup", "sparse"]


def test_rl_needs_its_config():
    with pytest.raises(ValueError, match="rl_config=None is invalid"):
        make_objective(MODEL, TrainConfig(mode="rl", **TRAIN))


def test_language_model_weights_and_the_reported_loss():
    objective = _objective("dsa_sparse")
    assert objective.loss_weights(SUMS) == {"lm": 1.0, "mtp": 0.5, "balance": 0.25, "indexer_kl": 2.0}
    metrics = objective.metrics(SUMS, DENS, COUNTS)
    # The balance loss is trained on but reported on its own, not in `loss`.
    np.testing.assert_allclose(metrics["loss"], 3.0 + 0.5 * 2.0 + 2.0 * 1.0)
    assert float(metrics["balance_loss"]) == 2.0 and "topk_attention_mass" not in metrics
    np.testing.assert_allclose(metrics["expert_load_max"], [6 / 3])
    assert objective.updates_router_bias


def test_the_dsa_warm_up_trains_only_the_indexer():
    objective = _objective("dsa_warmup")
    assert objective.loss_weights(SUMS) == {"indexer_kl": 2.0}
    metrics = objective.metrics(SUMS, DENS, COUNTS)
    assert float(metrics["loss"]) == 2.0 and float(metrics["lm_loss"]) == 3.0  # reported, not trained
    assert float(metrics["topk_attention_mass"]) == 0.5
    assert not objective.updates_router_bias


def test_pretraining_without_dsa_has_no_indexer_term():
    sums = {k: v for k, v in SUMS.items() if k not in ("indexer_kl", "topk_mass")}
    assert list(_objective("pretrain").loss_weights(sums)) == ["lm", "mtp", "balance"]
