"""Plain cached generation against the full-sequence forward pass and the trainer's logprobs; sampling, EOS,
rollout records and bad input."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from generation_setup import (CONFIG, GREEDY, MAX_NEW, PROMPTS, SHARED_CONFIG, assert_on_policy, reference_forward,
                              run_greedy, trainer_logprobs)

from glm5_jax.config.mesh import AXIS_NAMES
from glm5_jax.generation import GenerationError, SamplingParams, generate, to_rollout_records
from glm5_jax.generation.sampling import processed_logits, split_sampling

# Each sequence and the cache split over 2 chips (the checks run before anything needs the devices).
CONTEXT_2 = jax.sharding.AbstractMesh((1, 1, 1, 2, 1), AXIS_NAMES)


def assert_matches_forward(params, config, output):
    """Every step's logits, the greedy tokens and the recorded routing equal the full forward's."""
    ref = reference_forward(params, config, output)
    logits, topk, experts = (np.asarray(ref.logits), np.asarray(ref.aux["topk"]), np.asarray(ref.aux["expert_ids"]))
    for row, prompt in enumerate(PROMPTS):
        p, r = len(prompt), int(output.lengths[row])
        assert r == MAX_NEW
        np.testing.assert_allclose(output.logits[row, :r], logits[row, p - 1: p - 1 + r], atol=2e-5, rtol=1e-5)
        np.testing.assert_array_equal(output.tokens[row, :r], logits[row, p - 1: p - 1 + r].argmax(-1))
        fed = p + r - 1
        for layer in range(config.num_hidden_layers):
            for t in range(fed):
                assert set(output.indexer_topk[row, layer, t]) == set(topk[layer, row, t]), (row, layer, t)
        np.testing.assert_array_equal(np.sort(output.expert_choices[row, :, :fed], -1),
                                      np.sort(experts[:, row, :fed], -1))
    # DSA prunes: position 8 of row 0 sees 9 keys and keeps index_topk of them.
    assert (output.indexer_topk[0, 0, 8] >= 0).sum() == config.index_topk < 9


@pytest.mark.slow
def test_cached_decoding_matches_forward_full_indexers(params, greedy_output):
    assert_matches_forward(params, CONFIG, greedy_output)


@pytest.mark.slow
def test_cached_decoding_matches_forward_index_share(shared_params):
    output = run_greedy(shared_params, SHARED_CONFIG)
    assert_matches_forward(shared_params, SHARED_CONFIG, output)
    # The "shared" layer 1 reuses layer 0's selection; the "full" layer 2 makes its own.
    np.testing.assert_array_equal(output.indexer_topk[:, 1], output.indexer_topk[:, 0])
    assert not np.array_equal(output.indexer_topk[:, 2], output.indexer_topk[:, 0])


@pytest.mark.slow
def test_sampled_logprobs_equal_trainer_logprobs(params, greedy_output):
    sampling = SamplingParams(temperature=0.7, top_p=0.9, max_new_tokens=MAX_NEW)
    output = run_greedy(params, CONFIG, sampling=sampling, rng=jax.random.key(3))
    assert output.temperature == 0.7
    assert not np.array_equal(output.tokens, greedy_output.tokens)
    _, batch = assert_on_policy(params, output)
    # The recorded numbers are at the sampling temperature, not at 1.
    logp_t1, _, _ = trainer_logprobs(params, to_rollout_records(
        output, rollout_ids=["r0", "r1"], group_ids="g", rewards=[1.0, 0.0], weight_versions=4), temperature=1.0)
    mask = batch["loss_mask"] > 0
    assert np.abs(logp_t1[mask] - batch["rollout_logprobs"][mask]).max() > 1e-2
    # Every sampled token lies inside the top-p nucleus of the logits that produced it ...
    nucleus, values = split_sampling(sampling)
    processed = processed_logits(jnp.asarray(output.logits), values, nucleus)
    chosen = np.take_along_axis(np.asarray(processed), output.tokens[..., None], -1)[..., 0]
    assert np.isfinite(chosen).all()
    # ... but its recorded logprob is under the temperature-scaled distribution before truncation.
    def logprob_of_tokens(logits):
        return np.take_along_axis(np.asarray(jax.nn.log_softmax(logits, -1)), output.tokens[..., None], -1)[..., 0]

    np.testing.assert_allclose(output.logprobs, logprob_of_tokens(jnp.asarray(output.logits) / 0.7), atol=1e-5)
    assert (logprob_of_tokens(processed) - output.logprobs > 1e-3).any()  # the nucleus did cut mass


@pytest.mark.slow
def test_greedy_logprobs_are_temperature_one_and_on_policy(params, greedy_output):
    assert greedy_output.temperature == 1.0
    assert_on_policy(params, greedy_output)


def test_nucleus_keeps_smallest_set_reaching_top_p():
    # Top-p cuts the temperature-scaled distribution: at T = 0.5 the probabilities below become
    # [0.0068, 0.6849, 0.0616, 0.2466].
    logits = jnp.log(jnp.array([[0.05, 0.5, 0.15, 0.3]]))
    for top_p, kept in ((0.6, [1]), (0.9, [1, 3]), (0.95, [1, 2, 3]), (1.0, [0, 1, 2, 3])):
        nucleus, values = split_sampling(SamplingParams(temperature=0.5, top_p=top_p))
        out = np.asarray(processed_logits(logits, values, nucleus))[0]
        np.testing.assert_array_equal(np.flatnonzero(np.isfinite(out)), kept)
        np.testing.assert_allclose(out[kept], np.asarray(logits)[0, kept] / 0.5, rtol=1e-6)


@pytest.mark.slow
def test_eos_stops_only_its_row(params, greedy_output):
    tokens = greedy_output.tokens
    # A token row 1 emits at step j for the first time and row 0 never emits.
    step = next(j for j in range(MAX_NEW) if tokens[1, j] not in tokens[0] and tokens[1, j] not in tokens[1, :j])
    eos = int(tokens[1, step])
    output = run_greedy(params, CONFIG, sampling=dataclasses.replace(GREEDY, eos_ids=(eos,)))
    assert output.lengths.tolist() == [MAX_NEW, step + 1]
    assert output.stopped_on_eos.tolist() == [False, True]
    np.testing.assert_array_equal(output.tokens[0], tokens[0])
    np.testing.assert_array_equal(output.tokens[1, : step + 1], tokens[1, : step + 1])
    assert output.mask[1].tolist() == [True] * (step + 1) + [False] * (MAX_NEW - step - 1)
    assert (output.tokens[1, step + 1:] == 0).all() and (output.logprobs[1, step + 1:] == 0).all()
    record = to_rollout_records(output, rollout_ids=["a", "b"], group_ids=["g0", "g1"],
                                rewards=np.array([0.0, 1.0]), weight_versions=[(1,), (1, 2)])[1]
    assert record.response_ids.tolist() == tokens[1, : step + 1].tolist() and record.response_ids[-1] == eos
    assert record.prompt_ids.tolist() == PROMPTS[1] and record.loss_mask.tolist() == [1] * (step + 1)
    assert record.indexer_topk.shape == (CONFIG.num_hidden_layers, len(PROMPTS[1]) + step, CONFIG.index_topk)
    assert (record.reward, record.group_id, record.weight_versions) == (1.0, "g1", (1, 2))
    with pytest.raises(GenerationError, match=r"rewards has 3 entries; expected one per generated row \(2\)"):
        to_rollout_records(output, rollout_ids=["a", "b"], group_ids="g", rewards=[0, 1, 2], weight_versions=0)


@pytest.mark.parametrize("kwargs, message", [
    (dict(prompts=[[1, 2], [3, 97]]), r"prompts\[1\]\[1\]=97 is outside the vocabulary"),
    (dict(prompts=[[1, 2], []]), r"prompts\[1\] has shape \(0,\)"),
    (dict(sampling=SamplingParams(temperature=-1.0)), r"temperature=-1.0 is invalid"),
    (dict(sampling=SamplingParams(top_p=0.0)), r"top_p=0.0 is invalid"),
    (dict(sampling=SamplingParams(eos_ids=(500,))), r"eos_ids contains 500"),
    (dict(sampling=SamplingParams(max_new_tokens=0)), r"max_new_tokens=0 is invalid"),
    (dict(max_len=5), r"max_len=5 is invalid: must be an integer >= longest prompt \(9\)"),
    (dict(max_len=17, mesh=CONTEXT_2), r"max_len=17 is invalid: mesh.context=2 splits the cache's slots into equal "
                                       r"shares, so it must be a multiple of 2"),
    (dict(config=dataclasses.replace(CONFIG, attention_backend="pallas"), mesh=CONTEXT_2),
     r"mesh.context=2 is invalid with attention_backend='pallas'"),
])
def test_bad_input_is_rejected_before_compiling(params, kwargs, message):
    kwargs = {"prompts": PROMPTS, "sampling": GREEDY, "config": CONFIG, **kwargs}
    with pytest.raises(GenerationError, match=message):
        generate(params, kwargs.pop("prompts"), **kwargs)



@pytest.mark.slow
def test_prefill_in_query_blocks_equals_one_block(params, greedy_output):
    """A prefill whose indexer top-k and sparse attention run in blocks of 3 of the 9 prompt positions (the
    prompts pad to 9) decodes exactly as the unblocked one: same tokens, logits and selections."""
    assert max(map(len, PROMPTS)) % 3 == 0  # the blocks really split the prefill
    blocked = run_greedy(params, dataclasses.replace(CONFIG, index_query_chunk=3))
    np.testing.assert_array_equal(blocked.tokens, greedy_output.tokens)
    np.testing.assert_allclose(blocked.logits, greedy_output.logits, atol=1e-5, rtol=1e-5)
    np.testing.assert_array_equal(np.sort(blocked.indexer_topk, -1), np.sort(greedy_output.indexer_topk, -1))
