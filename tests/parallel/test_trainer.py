"""One trainer for `glm5 train`, `glm5 compile` and the async RL driver: the abstract state is the concrete
state's shapes and shardings, and mode rl gets its optimizer (frozen indexer) and objective from the config."""

import jax
import pytest

from glm5_jax.config.experiment import experiment_from_dict
from glm5_jax.parallel.trainer import build_trainer
from glm5_jax.train.objective import LM_BATCH_KEYS, LMObjective
from glm5_jax.train.rl_step import RLObjective

MODEL = dict(vocab_size=64, hidden_size=32, intermediate_size=48, moe_intermediate_size=16, num_hidden_layers=2,
             num_attention_heads=2, q_lora_rank=16, kv_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=4,
             v_head_dim=8, n_routed_experts=4, num_experts_per_tok=2, first_k_dense_replace=1, index_n_heads=2,
             index_head_dim=8, index_topk=4, mtp_num_steps=1, compute_dtype="float32")


def _experiment(**sections):
    return experiment_from_dict({"model": MODEL, "optim": {"name": "adamw"},
                                 "train": {"batch_size": 2, "seq_len": 16}, **sections})


@pytest.mark.slow
def test_the_abstract_state_is_the_concrete_states_layout():
    trainer = build_trainer(_experiment())
    assert isinstance(trainer.objective, LMObjective) and trainer.step.required_keys == LM_BATCH_KEYS
    concrete = trainer.init_state(trainer.init_params(jax.random.key(0)))
    abstract = trainer.abstract_state()
    assert jax.tree.structure(concrete) == jax.tree.structure(abstract)
    for (path, real), shape in zip(jax.tree_util.tree_flatten_with_path(concrete)[0], jax.tree.leaves(abstract)):
        assert (real.shape, real.dtype) == (shape.shape, shape.dtype), jax.tree_util.keystr(path)
        assert real.sharding.is_equivalent_to(shape.sharding, real.ndim), jax.tree_util.keystr(path)
    assert set(trainer.abstract_batch()) == set(LM_BATCH_KEYS)


def test_rl_freezes_the_indexer_and_takes_the_rl_objective():
    rl = {"loss": "double_sided_is", "eps_low": 0.2, "eps_high": 0.28}
    trainer = build_trainer(_experiment(train={"batch_size": 2, "seq_len": 16, "mode": "rl"}, rl=rl))
    assert trainer.optim_config.trainable == "non_indexer"
    assert isinstance(trainer.objective, RLObjective) and trainer.objective.config == trainer.experiment.rl
    thawed = build_trainer(_experiment(train={"batch_size": 2, "seq_len": 16, "mode": "rl"},
                                       rl={**rl, "train_indexer": True}))
    assert thawed.optim_config.trainable == "all"
