"""MTP speculative decoding: greedy output identical to plain greedy decoding, the acceptance rule and the
acceptance-length metric on constructed cases, and the sampled rule's output distribution."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from generation_setup import CONFIG, GREEDY, MAX_LEN, NUM_DRAFT, PROMPTS, assert_on_policy, run_greedy

from glm5_jax.generation import GenerationError, SamplingParams, mean_acceptance_length, speculative_generate
from glm5_jax.generation.sampling import split_sampling
from glm5_jax.generation.speculative import accept_drafts

# One compile per shape instead of one per eager op.
accept_drafts = jax.jit(accept_drafts, static_argnames="nucleus")


def run_speculative(params, sampling=GREEDY, **kwargs):
    return speculative_generate(params, PROMPTS, config=CONFIG, sampling=sampling, num_draft=NUM_DRAFT,
                                max_len=MAX_LEN, collect_routing=True, return_logits=True, **kwargs)


def assert_same_as_plain(plain, spec):
    np.testing.assert_array_equal(spec.lengths, plain.lengths)
    np.testing.assert_array_equal(spec.tokens, plain.tokens)
    np.testing.assert_allclose(spec.logprobs, plain.logprobs, atol=1e-5)
    np.testing.assert_allclose(spec.logits, plain.logits, atol=2e-5, rtol=1e-5)
    for row, prompt in enumerate(PROMPTS):
        fed = len(prompt) + int(plain.lengths[row]) - 1
        np.testing.assert_array_equal(np.sort(spec.indexer_topk[row, :, :fed], -1),
                                      np.sort(plain.indexer_topk[row, :, :fed], -1))
        np.testing.assert_array_equal(spec.expert_choices[row, :, :fed], plain.expert_choices[row, :, :fed])


@pytest.mark.slow
def test_greedy_speculative_equals_plain_greedy(params, greedy_output):
    spec = run_speculative(params)
    assert_same_as_plain(greedy_output, spec)
    assert 1.0 <= spec.acceptance_length <= NUM_DRAFT + 1


def self_drafting_params(params):
    """A main model whose only working layer is layer 1 (the first MoE layer; layers 0 and 2 add nothing to
    the residual stream), and an MTP module that is a copy of it fed a perturbed embedding (eh_proj =
    [I + noise ; 0]): drafts then often, but not always, agree with the main model, so verification both
    accepts and rejects."""
    params = jax.tree.map(lambda a: a, params)
    dense, moe = params["dense_layers"], params["moe_layers"]
    dense["attn"]["o_proj"]["kernel"] = jnp.zeros_like(dense["attn"]["o_proj"]["kernel"])
    dense["mlp"]["down_proj"]["kernel"] = jnp.zeros_like(dense["mlp"]["down_proj"]["kernel"])
    for holder, name in ((moe["attn"]["o_proj"], "kernel"), (moe["moe"]["experts"], "down_proj"),
                         (moe["moe"]["shared_experts"]["down_proj"], "kernel")):
        holder[name] = holder[name].at[1].set(0.0)
    embedding = params["embed"]["embedding"]
    params["embed"]["embedding"] = embedding * jax.lax.rsqrt(jnp.mean(embedding**2, -1, keepdims=True))
    layer = jax.tree.map(lambda a: a[0], moe)
    layer["indexer"] = jax.tree.map(lambda a: a[1], params["indexers"])
    d = CONFIG.hidden_size
    noise = 0.5 * np.random.default_rng(0).standard_normal((d, d)) / np.sqrt(d)
    params["mtp"] = dict(params["mtp"], layer=layer, shared_head_norm=params["final_norm"],
                         eh_proj={"kernel": jnp.asarray(np.concatenate([np.eye(d) + noise, np.zeros((d, d))]),
                                                        jnp.float32)})
    return params


@pytest.mark.slow
def test_greedy_speculative_equals_plain_when_drafts_are_partly_right(params):
    drafting = self_drafting_params(params)
    plain = run_greedy(drafting, CONFIG)
    spec = run_speculative(drafting)
    assert_same_as_plain(plain, spec)
    assert 1.0 < spec.acceptance_length < NUM_DRAFT + 1


@pytest.mark.slow
def test_every_draft_accepted_gives_acceptance_length_k_plus_one(params):
    # Zero final and MTP head norms: all logits are 0, argmax is token 0 for both the main model and the drafts.
    flat = dict(params, final_norm={"scale": jnp.zeros_like(params["final_norm"]["scale"])},
                mtp=dict(params["mtp"], shared_head_norm={"scale": jnp.zeros_like(params["final_norm"]["scale"])}))
    spec = run_speculative(flat)
    assert (spec.tokens == 0).all() and spec.mask.all()
    assert spec.acceptance_length == NUM_DRAFT + 1


def test_greedy_acceptance_rule_and_metric_on_a_constructed_case():
    drafts = jnp.array([[5, 6, 7], [5, 1, 7], [2, 6, 7]])
    target = jax.nn.one_hot(jnp.array([[5, 6, 7, 9]] * 3), 10) * 3.0  # argmax 5, 6, 7 then 9
    nucleus, values = split_sampling(GREEDY)
    accepted, following = accept_drafts(jax.random.key(0), drafts, jnp.zeros((3, 3, 10)), target, values,
                                        nucleus=nucleus)
    assert accepted.tolist() == [3, 1, 0]
    assert following.tolist() == [9, 6, 5]
    # One verify forward per row yields accepted + 1 tokens: (4 + 2 + 1) tokens / 3 forwards.
    assert mean_acceptance_length(np.asarray(accepted) + 1, np.ones(3)) == pytest.approx(7 / 3)
    assert mean_acceptance_length(np.array([0]), np.array([0])) == 0.0


def _processed(logits, temperature, top_p):
    probs = np.exp(logits / temperature - np.max(logits / temperature))
    probs /= probs.sum()
    order = np.argsort(-probs)
    before = np.cumsum(probs[order]) - probs[order]
    kept = np.zeros_like(probs, bool)
    kept[order[before < top_p]] = True
    return np.where(kept, probs, 0.0) / probs[kept].sum()


def test_speculative_sampling_reproduces_the_target_distribution():
    """Draft 2 tokens from q, verify against p: the first emitted token follows p_0, the second (when the
    first draft was accepted) p_1, whatever q is."""
    temperature, top_p, n = 0.8, 0.9, 100_000
    target = np.log(np.array([[0.1, 0.2, 0.3, 0.4], [0.5, 0.05, 0.05, 0.4], [0.25, 0.25, 0.25, 0.25]]))
    draft = np.log(np.array([[0.4, 0.3, 0.2, 0.1], [0.15, 0.1, 0.05, 0.7]]))
    p = np.stack([_processed(t, temperature, top_p) for t in target])
    q = np.stack([_processed(d, temperature, top_p) for d in draft])
    rng = np.random.default_rng(0)
    drafts = np.stack([rng.choice(4, n, p=q[0]), rng.choice(4, n, p=q[1])], axis=1)
    nucleus, values = split_sampling(SamplingParams(temperature=temperature, top_p=top_p))
    accepted, following = accept_drafts(jax.random.key(1), jnp.asarray(drafts),
                                        jnp.broadcast_to(jnp.asarray(draft, jnp.float32), (n, 2, 4)),
                                        jnp.broadcast_to(jnp.asarray(target, jnp.float32), (n, 3, 4)), values,
                                        nucleus=nucleus)
    accepted, following = np.asarray(accepted), np.asarray(following)
    first = np.where(accepted >= 1, drafts[:, 0], following)
    second = np.where(accepted >= 2, drafts[:, 1], following)[accepted >= 1]
    tolerance = 5 * np.sqrt(0.25 / len(second))
    np.testing.assert_allclose(np.bincount(first, minlength=4) / n, p[0], atol=tolerance)
    np.testing.assert_allclose(np.bincount(second, minlength=4) / len(second), p[1], atol=tolerance)
    # Acceptance happens at the analytic rate sum_x min(p_0(x), q_0(x)).
    np.testing.assert_allclose((accepted >= 1).mean(), np.minimum(p[0], q[0]).sum(), atol=tolerance)


@pytest.mark.slow
def test_sampled_speculative_logprobs_equal_trainer_logprobs(params, greedy_output):
    # top_p = 1 keeps the compiled greedy steps (only the nucleus flag is static); top-p is covered by the
    # plain sampling test and the rule test above.
    sampling = SamplingParams(temperature=0.9, max_new_tokens=GREEDY.max_new_tokens)
    spec = run_speculative(params, sampling, rng=jax.random.key(5))
    assert spec.mask.all() and spec.temperature == 0.9
    assert not np.array_equal(spec.tokens, greedy_output.tokens)
    assert_on_policy(params, spec)


def test_speculative_input_checks(params):
    with pytest.raises(GenerationError, match=r"num_draft=0 is invalid"):
        speculative_generate(params, PROMPTS, config=CONFIG, num_draft=0)
    with pytest.raises(GenerationError, match=r"params has no 'mtp' module"):
        speculative_generate({k: v for k, v in params.items() if k != "mtp"}, PROMPTS, config=CONFIG)
    with pytest.raises(GenerationError, match=r"max_len=16 is invalid: .* \+ num_draft \(2\) = 17"):
        speculative_generate(params, PROMPTS, config=CONFIG, sampling=GREEDY, num_draft=2, max_len=16)
