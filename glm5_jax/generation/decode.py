"""Batched generation: one jitted prefill over the right-padded prompts, then a jitted decode step per token
that feeds each row's newest token at that row's own position (the cache is donated, so it is updated in
place). The host loop only checks the per-row done flags; every shape is static (cache length `max_len`,
`max_new_tokens` output slots).

What each generated token comes with: its id, the logprob recorded for the trainer (see
`generation.sampling`), optionally the raw logits that produced it, and, with `collect_routing`, the
expert choices of every MoE layer and the indexer top-k of every layer at every position fed to the model
(prompt and generated), laid out by absolute position for routing replay. The indexer record has
N = min(index_topk, max_len) slots per position, -1 marking empty ones; `forward(topk_indices=...)` replays
it when the training sequence length is also >= index_topk (or both are below it and equal).
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable, Sequence
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from glm5_jax.config import ModelConfig
from glm5_jax.generation.cache import CachedOutput, KVCache, model_cache, num_selected, run_cached
from glm5_jax.generation.inputs import check_context_split, check_model, padded_prompts, resolve_max_len
from glm5_jax.generation.sampling import (SamplingParams, SamplingValues, is_eos, recorded_logprobs, sample_tokens,
                                          split_sampling)
from glm5_jax.model.transformer import dtype_of, head_logits


class Emitted(NamedTuple):
    """Per-row output buffers [B, M] and progress."""

    tokens: jax.Array            # int32, 0 where nothing was emitted
    logprobs: jax.Array          # fp32, 0 where nothing was emitted
    count: jax.Array             # [B] tokens emitted so far
    done: jax.Array              # [B] bool: the row emitted an EOS id or max_new_tokens tokens
    stopped_on_eos: jax.Array    # [B] bool
    logits: jax.Array | None     # [B, M, V] fp32 logits that produced each token (return_logits)


class Routing(NamedTuple):
    """Routing by absolute position, [layers, B, T, k]."""

    topk: jax.Array              # [L, B, T, N] indexer top-k (-1 = empty slot)
    expert_ids: jax.Array | None  # [L_moe, B, T, A]; None without MoE layers


class DecodeState(NamedTuple):
    cache: KVCache
    length: jax.Array      # [B] tokens in the cache = position of next_token
    next_token: jax.Array  # [B] the newest emitted token, not yet fed
    key: jax.Array
    out: Emitted
    routing: Routing | None


def emit(out: Emitted, tokens: jax.Array, logprobs: jax.Array, offered: jax.Array, values: SamplingValues,
         logits: jax.Array | None) -> Emitted:
    """Append each row's first `offered[b]` of tokens [B, S], stopping after an EOS id or at the budget;
    rows already done take nothing."""
    b, s = tokens.shape
    budget = out.tokens.shape[1]
    index = jnp.arange(s)[None, :]
    offered_mask = (index < offered[:, None]) & ~out.done[:, None]
    eos = is_eos(tokens, values) & offered_mask
    first_eos = jnp.where(eos.any(-1), jnp.argmax(eos, axis=-1), s)
    take = offered_mask & (index <= first_eos[:, None]) & (out.count[:, None] + index < budget)
    columns = jnp.where(take, out.count[:, None] + index, budget)  # budget = out of range -> dropped
    rows = jnp.arange(b)[:, None]
    new_count = out.count + take.sum(-1)
    hit_eos = (eos & take).any(-1)
    return Emitted(
        tokens=out.tokens.at[rows, columns].set(tokens, mode="drop"),
        logprobs=out.logprobs.at[rows, columns].set(logprobs, mode="drop"),
        count=new_count,
        done=out.done | hit_eos | (new_count >= budget),
        stopped_on_eos=out.stopped_on_eos | hit_eos,
        logits=None if out.logits is None else out.logits.at[rows, columns].set(logits, mode="drop"),
    )


def record_routing(routing: Routing | None, result: CachedOutput, positions: jax.Array,
                   active: jax.Array) -> Routing | None:
    """Store the routing of the tokens just fed at their positions [B, S] (inactive rows: nothing)."""
    if routing is None:
        return None
    max_len = routing.topk.shape[2]
    slots = jnp.where(active[:, None], positions, max_len)
    rows = jnp.arange(positions.shape[0])[:, None]
    topk = routing.topk.at[:, rows, slots].set(result.topk, mode="drop")
    expert_ids = routing.expert_ids
    if expert_ids is not None:
        expert_ids = expert_ids.at[:, rows, slots].set(result.expert_ids, mode="drop")
    return Routing(topk, expert_ids)


def _empty_outputs(batch: int, max_new_tokens: int, max_len: int, config: ModelConfig, collect_routing: bool,
                   return_logits: bool) -> tuple[Emitted, Routing | None]:
    out = Emitted(
        tokens=jnp.zeros((batch, max_new_tokens), jnp.int32),
        logprobs=jnp.zeros((batch, max_new_tokens), jnp.float32),
        count=jnp.zeros((batch,), jnp.int32),
        done=jnp.zeros((batch,), bool),
        stopped_on_eos=jnp.zeros((batch,), bool),
        logits=jnp.zeros((batch, max_new_tokens, config.vocab_size), jnp.float32) if return_logits else None,
    )
    routing = None
    if collect_routing:
        routing = Routing(
            topk=jnp.full((config.num_hidden_layers, batch, max_len, num_selected(config, max_len)), -1, jnp.int32),
            expert_ids=(jnp.zeros((config.num_moe_layers, batch, max_len, config.num_experts_per_tok), jnp.int32)
                        if config.num_moe_layers else None),
        )
    return out, routing


@functools.partial(jax.jit, static_argnames=("config", "nucleus", "max_len", "max_new_tokens", "collect_routing",
                                             "return_logits", "mesh"))
def prefill(params: dict, prompts: jax.Array, prompt_lengths: jax.Array, key: jax.Array,
                  values: SamplingValues, *, config: ModelConfig, nucleus: bool, max_len: int,
                  max_new_tokens: int, collect_routing: bool, return_logits: bool,
                  mesh=None) -> tuple[DecodeState, jax.Array]:
    """Run the prompts [B, P] through the model into a fresh cache and emit each row's first token.

    Returns the state and the final normed hidden states of the prompt positions [B, P, D] (what MTP
    drafting starts from). With `mesh` the prompts, and under `context` the cache, are split over it."""
    b, p = prompts.shape
    positions = jnp.broadcast_to(jnp.arange(p, dtype=jnp.int32), (b, p))
    real = positions < prompt_lengths[:, None]
    cache = model_cache(config, b, max_len, dtype_of(config.compute_dtype), mesh)
    result = run_cached(params, cache, prompts, positions, real, config, collect_routing, mesh)
    last = jnp.take_along_axis(result.hidden, (prompt_lengths - 1)[:, None, None], axis=1)  # [B, 1, D]
    logits = head_logits(params["lm_head"]["kernel"], last)
    key, sample_key = jax.random.split(key)
    token = sample_tokens(sample_key, logits[:, 0], values, nucleus)
    logprob = recorded_logprobs(last, params["lm_head"]["kernel"], token[:, None], values)
    out, routing = _empty_outputs(b, max_new_tokens, max_len, config, collect_routing, return_logits)
    routing = record_routing(routing, result, jnp.where(real, positions, max_len), jnp.ones((b,), bool))
    out = emit(out, token[:, None], logprob, jnp.ones((b,), jnp.int32), values, logits)
    state = DecodeState(result.cache, prompt_lengths.astype(jnp.int32), token, key, out, routing)
    return state, result.hidden


@functools.partial(jax.jit, static_argnames=("config", "nucleus", "mesh"), donate_argnames=("state",))
def decode_step(params: dict, state: DecodeState, values: SamplingValues, *, config: ModelConfig,
                nucleus: bool, mesh=None) -> DecodeState:
    """Feed every unfinished row's newest token at its position, sample the next one (`mesh` as `prefill`'s)."""
    active = ~state.out.done
    positions = state.length[:, None]
    result = run_cached(params, state.cache, state.next_token[:, None], positions, active[:, None], config,
                        state.routing is not None, mesh)
    logits = head_logits(params["lm_head"]["kernel"], result.hidden)
    key, sample_key = jax.random.split(state.key)
    token = sample_tokens(sample_key, logits[:, 0], values, nucleus)
    logprob = recorded_logprobs(result.hidden, params["lm_head"]["kernel"], token[:, None], values)
    out = emit(state.out, token[:, None], logprob, jnp.ones_like(state.length), values, logits)
    return DecodeState(
        cache=result.cache,
        length=jnp.where(active, state.length + 1, state.length),
        next_token=jnp.where(active, token, state.next_token),
        key=key,
        out=out,
        routing=record_routing(state.routing, result, positions, active),
    )


@dataclasses.dataclass(frozen=True, eq=False)
class GenerationOutput:
    """Host (numpy) results of one batch. Row b's tokens are tokens[b, :lengths[b]]."""

    prompt_ids: np.ndarray        # [B, P] right-padded prompts
    prompt_lengths: np.ndarray    # [B]
    tokens: np.ndarray            # [B, M] generated ids (0 past lengths)
    logprobs: np.ndarray          # [B, M] recorded logprobs (0 past lengths)
    mask: np.ndarray              # [B, M] bool: generated by the model
    lengths: np.ndarray           # [B] number of generated tokens
    stopped_on_eos: np.ndarray    # [B] bool: the row ended with an EOS id (else it hit max_new_tokens)
    temperature: float            # the temperature the logprobs are at (1.0 for greedy)
    expert_choices: np.ndarray | None = None  # [B, L_moe, T, A] by absolute position (collect_routing)
    indexer_topk: np.ndarray | None = None    # [B, L, T, N] by absolute position (collect_routing)
    logits: np.ndarray | None = None          # [B, M, V] fp32 (return_logits)
    acceptance_length: float | None = None    # speculative decoding: mean tokens per verify forward


def report_tokens(on_tokens: Callable[[np.ndarray, np.ndarray], None] | None, out: Emitted) -> None:
    if on_tokens is not None:
        on_tokens(np.asarray(out.tokens), np.asarray(out.count))


def host_output(prompts: np.ndarray, lengths: np.ndarray, out: Emitted, routing: Routing | None,
                sampling: SamplingParams, acceptance_length: float | None = None) -> GenerationOutput:
    count = np.asarray(out.count)
    return GenerationOutput(
        prompt_ids=prompts,
        prompt_lengths=lengths,
        tokens=np.asarray(out.tokens),
        logprobs=np.asarray(out.logprobs),
        mask=np.arange(out.tokens.shape[1])[None, :] < count[:, None],
        lengths=count,
        stopped_on_eos=np.asarray(out.stopped_on_eos),
        temperature=sampling.logprob_temperature,
        expert_choices=(None if routing is None or routing.expert_ids is None
                        else np.asarray(routing.expert_ids).transpose(1, 0, 2, 3)),
        indexer_topk=None if routing is None else np.asarray(routing.topk).transpose(1, 0, 2, 3),
        logits=None if out.logits is None else np.asarray(out.logits),
        acceptance_length=acceptance_length,
    )


def generate(params: dict, prompts: Sequence[Sequence[int]], *, config: ModelConfig,
             sampling: SamplingParams = SamplingParams(), rng: jax.Array | None = None, max_len: int | None = None,
             collect_routing: bool = False, return_logits: bool = False,
             on_tokens: Callable[[np.ndarray, np.ndarray], None] | None = None, mesh=None) -> GenerationOutput:
    """Generate up to `sampling.max_new_tokens` tokens after each prompt (lists of token ids).

    `rng` is the sampling key (default `jax.random.key(0)`). `max_len` fixes the cache length (default:
    longest prompt + max_new_tokens); keep it fixed across calls to reuse the compiled steps.
    `collect_routing` records expert choices and indexer top-k for routing replay; `return_logits` keeps the
    [B, M, V] logits of every step (tests, debugging). `on_tokens(tokens [B, M], counts [B])` is called
    with the host copies of the output so far after every step (streaming; it costs one transfer per step).
    `mesh`: the device mesh the parameters are on; with `context` > 1 each prompt is split over it (padded
    to a multiple of it) and so is the cache (`max_len` must then be a multiple of it; by default it is)."""
    check_model(params, config, needs_mtp=False)
    split = check_context_split(mesh, config)
    sampling = sampling.validate(config.vocab_size)
    padded, lengths = padded_prompts(prompts, config.vocab_size)
    max_len = resolve_max_len(max_len, lengths, sampling, 0, config, split)
    nucleus, values = split_sampling(sampling)
    rng = jax.random.key(0) if rng is None else rng
    fed = np.pad(padded, ((0, 0), (0, -padded.shape[1] % split)))  # the prompt splits evenly over `context`
    state = prefill(params, jnp.asarray(fed), jnp.asarray(lengths), rng, values, config=config, nucleus=nucleus,
                    max_len=max_len, max_new_tokens=sampling.max_new_tokens, collect_routing=collect_routing,
                    return_logits=return_logits, mesh=mesh)[0]
    report_tokens(on_tokens, state.out)
    # Every step emits a token for each unfinished row, so at most max_new_tokens - 1 steps follow prefill.
    for _ in range(sampling.max_new_tokens - 1):
        if bool(state.out.done.all()):
            break
        state = decode_step(params, state, values, config=config, nucleus=nucleus, mesh=mesh)
        report_tokens(on_tokens, state.out)
    return host_output(padded, lengths, state.out, state.routing, sampling)
