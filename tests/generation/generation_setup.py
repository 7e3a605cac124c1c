"""The tiny model, prompts and compiled functions the generation tests share (compiles are the cost on CPU,
so every test reuses the same shapes and flags where it can)."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
from param_fill import random_params  # noqa: F401  (used by the generation tests)

from glm5_jax.config import ModelConfig
from glm5_jax.data.rollouts import make_batch, validate_record
from glm5_jax.generation import SamplingParams, generate, to_rollout_records
from glm5_jax.model.transformer import forward
from glm5_jax.train.rl import RLConfig
from glm5_jax.model.token_logprobs import token_logprobs

# Every feature on: a dense layer then MoE layers, group-limited routing, DSA pruning (index_topk 4 is
# shorter than every prompt), MTP.
CONFIG = ModelConfig(vocab_size=97, hidden_size=32, intermediate_size=48, moe_intermediate_size=16,
                     num_hidden_layers=3, num_attention_heads=2, q_lora_rank=16, kv_lora_rank=16,
                     qk_nope_head_dim=8, qk_rope_head_dim=4, v_head_dim=8, n_routed_experts=8,
                     num_experts_per_tok=2, n_group=2, topk_group=1, first_k_dense_replace=1, index_n_heads=4,
                     index_head_dim=8, index_topk=4, mtp_num_steps=3, compute_dtype="float32",
                     attention_backend="sparse", moe_backend="ragged").validate()
# IndexShare: the first MoE layer reuses the dense layer's top-k.
SHARED_CONFIG = dataclasses.replace(CONFIG, indexer_types=("full", "shared", "full")).validate()

MAX_NEW = 6
NUM_DRAFT = 2
PROMPTS = [list(np.random.default_rng(0).integers(0, CONFIG.vocab_size, 9)),
           list(np.random.default_rng(1).integers(0, CONFIG.vocab_size, 6))]
# One cache length for plain and speculative runs, so each compiles once.
MAX_LEN = max(map(len, PROMPTS)) + MAX_NEW + NUM_DRAFT
# Padded length of prompt + response: the shape every reference forward uses.
SEQ_LEN = max(map(len, PROMPTS)) + MAX_NEW
GREEDY = SamplingParams(temperature=0.0, max_new_tokens=MAX_NEW)



jit_forward = jax.jit(forward, static_argnames=("config", "collect_routing", "mtp_steps", "return_logits"))


def run_greedy(params, config, **kwargs):
    """Plain greedy generation with the flags every test shares (one compile per config)."""
    return generate(params, PROMPTS, config=config, sampling=kwargs.pop("sampling", GREEDY), max_len=MAX_LEN,
                    collect_routing=True, return_logits=True, **kwargs)


def full_sequences(output):
    """The prompt + generated tokens of each row, right-padded to SEQ_LEN, with segment ids (0 = padding)."""
    tokens = np.zeros((len(PROMPTS), SEQ_LEN), np.int32)
    segments = np.zeros_like(tokens)
    for row, prompt in enumerate(PROMPTS):
        seq = np.concatenate([prompt, output.tokens[row, : output.lengths[row]]])
        tokens[row, : len(seq)] = seq
        segments[row, : len(seq)] = 1
    return jnp.asarray(tokens), jnp.asarray(segments)


def reference_forward(params, config, output):
    tokens, segments = full_sequences(output)
    return jit_forward(params, tokens, config=config, segment_ids=segments, collect_routing=True, mtp_steps=0)


def trainer_logprobs(params, records, temperature=None):
    batch = make_batch(records, seq_len=SEQ_LEN, config=RLConfig(eps_low=0.2, eps_high=0.2))
    ref = jit_forward(params, jnp.asarray(batch["tokens"]), config=CONFIG,
                      segment_ids=jnp.asarray(batch["segment_ids"]), collect_routing=True, mtp_steps=0)
    temperature = batch["temperature"] if temperature is None else temperature
    logp, _ = token_logprobs(ref.hidden, params["lm_head"]["kernel"], jnp.asarray(batch["targets"]),
                             temperature=jnp.asarray(temperature))
    return np.asarray(logp), batch, ref


def assert_on_policy(params, output):
    """Records built from the output give the trainer's logprobs exactly: the importance ratio is 1."""
    records = to_rollout_records(output, rollout_ids=["r0", "r1"], group_ids="g", rewards=[1.0, 0.0],
                                 weight_versions=4)
    for record in records:
        validate_record(record, vocab_size=CONFIG.vocab_size)
    logp, batch, ref = trainer_logprobs(params, records)
    mask = batch["loss_mask"] > 0
    assert mask.sum() == output.lengths.sum()
    np.testing.assert_allclose(logp[mask], batch["rollout_logprobs"][mask], atol=1e-5)
    np.testing.assert_allclose(np.exp(logp[mask] - batch["rollout_logprobs"][mask]), 1.0, atol=1e-5)
    # The routing in the records is what the trainer's own forward chooses at each position.
    for row, record in enumerate(records):
        fed = record.num_tokens - 1
        np.testing.assert_array_equal(np.sort(batch["expert_choices"][row, :, :fed], -1),
                                      np.sort(np.asarray(ref.aux["expert_ids"])[:, row, :fed], -1))
    return logp, batch
