"""MTP speculative decoding: the shared MTP module drafts k tokens, the main model verifies them in one
forward over the cache, and the standard speculative-sampling rule accepts a prefix.

Invariant at the start of a step, per row: the main cache holds positions < n, the newest emitted token x
(position n) is not fed yet, and the MTP cache holds the depth-1 entries (t_{j+1}, h_0[j]) for j <= n - 1
(h_0 = the main model's final normed hidden state, as `model/mtp.py` documents), whose output at n - 1
gives the first draft's logits. One step:
1. draft: d_1 from those logits; for depth k >= 2 the MTP module is applied again to (d_{k-1}, its own
   previous raw output) at the next position, as vLLM and SGLang chain a single MTP layer (the entries of
   depth >= 2 are provisional and overwritten in step 4);
2. verify: the main model over [x, d_1 .. d_k] at positions n .. n + k (one forward, cache written);
3. accept: greedy keeps d_i while it equals the main model's argmax; sampling accepts d_i with probability
   min(1, p(d_i) / q(d_i)) and, at the first rejection, draws from norm(max(0, p - q)) (else from the last
   p). Both p and q are the processed (temperature + top-p) distributions, so the emitted tokens are
   distributed exactly as plain sampling from p; greedy output equals plain greedy decoding token for token.
   A row emits its a accepted drafts plus that corrected / bonus token;
4. roll back and extend: the row's length becomes n + a + 1, so the rejected drafts' cache rows are
   invisible and overwritten later; the MTP module runs once over the a + 1 new depth-1 entries.

Acceptance length (reported as `GenerationOutput.acceptance_length`): the mean, over verify forwards of
unfinished rows, of accepted drafts + 1, i.e. tokens produced per main-model forward (1 = no draft ever
accepted, k + 1 = all accepted), counted before EOS / max_new_tokens truncation.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from glm5_jax.config import ModelConfig
from glm5_jax.generation.cache import KVCache, mtp_cache, run_cached, run_mtp_cached
from glm5_jax.generation.decode import (DecodeState, GenerationOutput, emit, host_output, prefill, record_routing,
                                        report_tokens)
from glm5_jax.generation.inputs import check_context_split, check_model, padded_prompts, resolve_max_len
from glm5_jax.generation.sampling import (GenerationError, SamplingParams, SamplingValues, recorded_logprobs,
                                          sample_tokens, sampling_probs, split_sampling)
from glm5_jax.model.transformer import dtype_of, head_logits


class SpeculativeState(NamedTuple):
    decode: DecodeState
    mtp_cache: KVCache
    mtp_hidden: jax.Array   # [B, D] raw MTP output at position length - 1 (feeds depth 2)
    mtp_logits: jax.Array   # [B, V] its logits: the first draft's distribution
    accepted: jax.Array     # [B] sum over verify forwards of accepted drafts + 1
    verify_steps: jax.Array  # [B] verify forwards while the row was unfinished


def accept_drafts(key: jax.Array, drafts: jax.Array, draft_logits: jax.Array, target_logits: jax.Array,
                  values: SamplingValues, nucleus: bool) -> tuple[jax.Array, jax.Array]:
    """The speculative-sampling rule. drafts [B, K] drawn from draft_logits [B, K, V]; target_logits
    [B, K + 1, V] of the main model at the positions before each draft and after the last one.

    Returns (accepted drafts a [B], the token that follows them [B])."""
    k = drafts.shape[1]
    choice = jnp.argmax(target_logits, axis=-1).astype(jnp.int32)  # [B, K + 1]
    greedy_accepted = jnp.cumprod(drafts == choice[:, :k], axis=-1).sum(-1)
    greedy_next = jnp.take_along_axis(choice, greedy_accepted[:, None], axis=1)[:, 0]

    uniform_key, residual_key = jax.random.split(key)
    p = sampling_probs(target_logits, values, nucleus)  # [B, K + 1, V]
    q = sampling_probs(draft_logits, values, nucleus)   # [B, K, V]
    p_draft = jnp.take_along_axis(p[:, :k], drafts[..., None], axis=-1)[..., 0]
    q_draft = jnp.take_along_axis(q, drafts[..., None], axis=-1)[..., 0]
    # u < min(1, p/q) written without the division (q > 0 for a token drawn from q).
    accept = jax.random.uniform(uniform_key, drafts.shape) * q_draft < p_draft
    accepted = jnp.cumprod(accept, axis=-1).sum(-1)
    p_next = jnp.take_along_axis(p, accepted[:, None, None], axis=1)[:, 0]
    q_next = jnp.take_along_axis(q, jnp.minimum(accepted, k - 1)[:, None, None], axis=1)[:, 0]
    q_next = jnp.where((accepted < k)[:, None], q_next, 0.0)
    residual = jnp.maximum(p_next - q_next, 0.0)
    # A rejection implies p != q, so the residual has mass; the fallback only guards rounding.
    residual = jnp.where(residual.sum(-1, keepdims=True) > 0, residual, p_next)
    sampled_next = jax.random.categorical(residual_key, jnp.log(residual), axis=-1).astype(jnp.int32)
    return (jnp.where(values.greedy, greedy_accepted, accepted),
            jnp.where(values.greedy, greedy_next, sampled_next))


def mean_acceptance_length(accepted: np.ndarray, verify_steps: np.ndarray) -> float:
    """Tokens per verify forward over all rows: sum(accepted drafts + 1) / number of verify forwards."""
    steps = int(np.sum(verify_steps))
    return float(np.sum(accepted)) / steps if steps else 0.0


def _extend_mtp(params: dict, cache: KVCache, tokens: jax.Array, hidden: jax.Array, positions: jax.Array,
                count: jax.Array, active: jax.Array, config: ModelConfig,
                mesh) -> tuple[KVCache, jax.Array, jax.Array]:
    """Write the depth-1 entries (tokens[:, i], hidden[:, i]) at positions[:, i] for i < count; return the
    cache and the MTP output (raw hidden [B, D], logits [B, V]) of each row's last new entry."""
    real = (jnp.arange(tokens.shape[1])[None, :] < count[:, None]) & active[:, None]
    raw, normed, cache = run_mtp_cached(params, cache, tokens, hidden, positions, real, config, mesh)
    last = (count - 1)[:, None, None]
    raw_last = jnp.take_along_axis(raw, last, axis=1)[:, 0]
    logits = head_logits(params["lm_head"]["kernel"], jnp.take_along_axis(normed, last, axis=1))[:, 0]
    return cache, raw_last, logits


@functools.partial(jax.jit, static_argnames=("config", "mesh"))
def mtp_prefill(params: dict, state: DecodeState, hidden: jax.Array, prompts: jax.Array, prompt_lengths: jax.Array,
                *, config: ModelConfig, mesh=None) -> SpeculativeState:
    """After the main prefill (state, prompt hidden states [B, P, D]): fill the MTP cache with the prompt's
    depth-1 entries (t_{j+1}, h_0[j]), the first emitted token standing in for t_P at the last position."""
    b, p = prompts.shape
    max_len = state.cache.latent.shape[2]
    shifted = jnp.concatenate([prompts[:, 1:], jnp.zeros((b, 1), prompts.dtype)], axis=1)
    shifted = shifted.at[jnp.arange(b), prompt_lengths - 1].set(state.next_token)
    positions = jnp.broadcast_to(jnp.arange(p, dtype=jnp.int32), (b, p))
    cache = mtp_cache(config, b, max_len, dtype_of(config.compute_dtype), mesh)
    cache, mtp_hidden, mtp_logits = _extend_mtp(params, cache, shifted, hidden, positions, prompt_lengths,
                                                jnp.ones((b,), bool), config, mesh)
    zeros = jnp.zeros((b,), jnp.int32)
    return SpeculativeState(state, cache, mtp_hidden, mtp_logits, zeros, zeros)


@functools.partial(jax.jit, static_argnames=("config", "nucleus", "num_draft", "mesh"), donate_argnames=("state",))
def speculative_step(params: dict, state: SpeculativeState, values: SamplingValues, *, config: ModelConfig,
                     nucleus: bool, num_draft: int, mesh=None) -> SpeculativeState:
    """Draft `num_draft` tokens with the MTP module, verify them in one main-model forward, accept a prefix
    (`mesh` as `prefill`'s)."""
    decode = state.decode
    active = ~decode.out.done
    n = decode.length
    key, draft_key, accept_key = jax.random.split(decode.key, 3)
    draft_keys = jax.random.split(draft_key, num_draft)

    drafts, draft_logits = [], []
    cache, hidden, logits = state.mtp_cache, state.mtp_hidden, state.mtp_logits
    for depth in range(num_draft):
        token = sample_tokens(draft_keys[depth], logits, values, nucleus)
        drafts.append(token)
        draft_logits.append(logits)
        if depth + 1 < num_draft:
            raw, normed, cache = run_mtp_cached(params, cache, token[:, None], hidden[:, None], (n + depth)[:, None],
                                                active[:, None], config, mesh)
            hidden, logits = raw[:, 0], head_logits(params["lm_head"]["kernel"], normed)[:, 0]
    drafts = jnp.stack(drafts, axis=1)  # [B, K]

    fed = jnp.concatenate([decode.next_token[:, None], drafts], axis=1)  # [B, K + 1]
    positions = n[:, None] + jnp.arange(num_draft + 1, dtype=jnp.int32)[None, :]
    verify = run_cached(params, decode.cache, fed, positions, jnp.broadcast_to(active[:, None], fed.shape), config,
                        decode.routing is not None, mesh)
    target_logits = head_logits(params["lm_head"]["kernel"], verify.hidden)
    accepted, next_token = accept_drafts(accept_key, drafts, jnp.stack(draft_logits, axis=1), target_logits,
                                         values, nucleus)
    index = jnp.arange(num_draft + 1)[None, :]
    emitted = jnp.where(index < accepted[:, None], jnp.pad(drafts, ((0, 0), (0, 1))), next_token[:, None])
    logprobs = recorded_logprobs(verify.hidden, params["lm_head"]["kernel"], emitted, values)
    out = emit(decode.out, emitted, logprobs, accepted + 1, values, target_logits)

    cache, mtp_hidden, mtp_logits = _extend_mtp(params, cache, emitted, verify.hidden, positions, accepted + 1,
                                                active, config, mesh)
    keep = active[:, None]
    return SpeculativeState(
        decode=DecodeState(
            cache=verify.cache,
            length=jnp.where(active, n + accepted + 1, n),
            next_token=jnp.where(active, next_token, decode.next_token),
            key=key,
            out=out,
            routing=record_routing(decode.routing, verify, positions, active),
        ),
        mtp_cache=cache,
        mtp_hidden=jnp.where(keep, mtp_hidden, state.mtp_hidden),
        mtp_logits=jnp.where(keep, mtp_logits, state.mtp_logits),
        accepted=state.accepted + jnp.where(active, accepted + 1, 0),
        verify_steps=state.verify_steps + active.astype(jnp.int32),
    )


def speculative_generate(params: dict, prompts: Sequence[Sequence[int]], *, config: ModelConfig,
                         sampling: SamplingParams = SamplingParams(), num_draft: int | None = None,
                         rng: jax.Array | None = None, max_len: int | None = None, collect_routing: bool = False,
                         return_logits: bool = False,
                         on_tokens: Callable[[np.ndarray, np.ndarray], None] | None = None,
                         mesh=None) -> GenerationOutput:
    """`generate` with MTP drafting of `num_draft` tokens per main-model forward (default: the depth the
    shared MTP module was trained with, `config.mtp_num_steps`); same outputs (tokens, logprobs, routing)
    plus `acceptance_length` (`on_tokens` as in `generate`). `max_len` must leave `num_draft` slots of lookahead (default: longest prompt +
    max_new_tokens + num_draft). `mesh` as in `generate`: under `context` the MTP cache is split too."""
    check_model(params, config, needs_mtp=True)
    split = check_context_split(mesh, config)
    num_draft = config.mtp_num_steps if num_draft is None else num_draft
    if isinstance(num_draft, bool) or not isinstance(num_draft, int) or num_draft < 1:
        raise GenerationError(f"num_draft={num_draft!r} is invalid: must be an integer >= 1")
    sampling = sampling.validate(config.vocab_size)
    padded, lengths = padded_prompts(prompts, config.vocab_size)
    max_len = resolve_max_len(max_len, lengths, sampling, num_draft, config, split)
    nucleus, values = split_sampling(sampling)
    rng = jax.random.key(0) if rng is None else rng
    fed = np.pad(padded, ((0, 0), (0, -padded.shape[1] % split)))  # the prompt splits evenly over `context`
    prompts_array, lengths_array = jnp.asarray(fed), jnp.asarray(lengths)
    decode, hidden = prefill(params, prompts_array, lengths_array, rng, values, config=config, nucleus=nucleus,
                             max_len=max_len, max_new_tokens=sampling.max_new_tokens,
                             collect_routing=collect_routing, return_logits=return_logits, mesh=mesh)
    state = mtp_prefill(params, decode, hidden, prompts_array, lengths_array, config=config, mesh=mesh)
    report_tokens(on_tokens, state.decode.out)
    for _ in range(sampling.max_new_tokens - 1):
        if bool(state.decode.out.done.all()):
            break
        state = speculative_step(params, state, values, config=config, nucleus=nucleus, num_draft=num_draft,
                                 mesh=mesh)
        report_tokens(on_tokens, state.decode.out)
    acceptance = mean_acceptance_length(np.asarray(state.accepted), np.asarray(state.verify_steps))
    return host_output(padded, lengths, state.decode.out, state.decode.routing, sampling, acceptance)
