"""Sampling: greedy, temperature and top-p (nucleus), and the logprob recorded for each sampled token.

Recorded logprob. For every generated token we record log softmax(logits / temperature) at that token,
in fp32, over the whole vocabulary: the temperature-scaled distribution *before* top-p truncation. It is
exactly what the trainer recomputes (`train.token_logprobs.token_logprobs` at the rollout temperature; the
rollout engine calls the same function), so the on-policy importance ratio is 1. This is neither vLLM's
"raw_logprobs" (before temperature) nor its "processed_logprobs" (after temperature *and* top-k/top-p).
Greedy decoding (temperature 0) records the temperature-1 logprob, and its rollouts carry temperature 1.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from typing import NamedTuple

import jax
import jax.numpy as jnp

from glm5_jax.model.token_logprobs import token_logprobs


class GenerationError(ValueError):
    """An argument of a generation entry point is invalid; the message names it and what is valid."""


@dataclasses.dataclass(frozen=True)
class SamplingParams:
    """How tokens are chosen and when a row stops (the fields a vLLM `SamplingParams` user expects)."""

    temperature: float = 1.0       # 0 = greedy
    top_p: float = 1.0             # nucleus mass kept, in (0, 1]
    max_new_tokens: int = 64
    eos_ids: tuple[int, ...] = ()  # a row stops after emitting any of these (the id is kept in the output)

    def validate(self, vocab_size: int) -> "SamplingParams":
        if isinstance(self.temperature, bool) or not isinstance(self.temperature, (int, float)) \
                or not math.isfinite(self.temperature) or self.temperature < 0:
            raise GenerationError(f"temperature={self.temperature!r} is invalid: must be a finite number >= 0 "
                                  "(0 = greedy)")
        if isinstance(self.top_p, bool) or not isinstance(self.top_p, (int, float)) or not 0 < self.top_p <= 1:
            raise GenerationError(f"top_p={self.top_p!r} is invalid: must be in (0, 1]")
        if isinstance(self.max_new_tokens, bool) or not isinstance(self.max_new_tokens, int) \
                or self.max_new_tokens < 1:
            raise GenerationError(f"max_new_tokens={self.max_new_tokens!r} is invalid: must be an integer >= 1")
        if not isinstance(self.eos_ids, Sequence) or isinstance(self.eos_ids, str):
            raise GenerationError(f"eos_ids={self.eos_ids!r} is invalid: must be a tuple of token ids")
        for token in self.eos_ids:
            if isinstance(token, bool) or not isinstance(token, int) or not 0 <= token < vocab_size:
                raise GenerationError(f"eos_ids contains {token!r}: token ids must be integers in "
                                      f"[0, {vocab_size})")
        return self

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    @property
    def logprob_temperature(self) -> float:
        """The temperature recorded logprobs (and rollout records) use."""
        return 1.0 if self.greedy else float(self.temperature)


class SamplingValues(NamedTuple):
    """The traced sampling parameters: switching between greedy and sampled decoding, or changing the
    temperature, top_p or EOS ids, reuses the compiled steps. Only `nucleus` (top_p < 1, which adds a sort
    over the vocabulary) is static."""

    greedy: jax.Array       # bool scalar
    temperature: jax.Array  # f32 scalar, the logprob temperature (1 for greedy)
    top_p: jax.Array        # f32 scalar
    eos_ids: jax.Array      # [E] int32, -1 pads (E >= 1)


def split_sampling(sampling: SamplingParams) -> tuple[bool, SamplingValues]:
    """(nucleus, values): the static flag and the traced values of `sampling`."""
    nucleus = (not sampling.greedy) and sampling.top_p < 1
    values = SamplingValues(greedy=jnp.asarray(sampling.greedy),
                            temperature=jnp.float32(sampling.logprob_temperature),
                            top_p=jnp.float32(sampling.top_p),
                            eos_ids=jnp.asarray(tuple(sampling.eos_ids) or (-1,), jnp.int32))
    return nucleus, values


def processed_logits(logits: jax.Array, values: SamplingValues, nucleus: bool) -> jax.Array:
    """logits / temperature, with tokens outside the top-p nucleus at -inf (fp32, [..., V]).

    The nucleus is the smallest set of most likely tokens whose mass reaches top_p (the most likely token is
    always in it); tokens tied with the least likely member are kept too."""
    scaled = logits.astype(jnp.float32) / values.temperature
    if not nucleus:
        return scaled
    probs = jax.nn.softmax(scaled, axis=-1)
    descending = -jnp.sort(-probs, axis=-1)
    in_nucleus = (jnp.cumsum(descending, axis=-1) - descending) < values.top_p
    threshold = jnp.min(jnp.where(in_nucleus, descending, jnp.inf), axis=-1, keepdims=True)
    return jnp.where(probs >= threshold, scaled, -jnp.inf)


def sample_tokens(key: jax.Array, logits: jax.Array, values: SamplingValues, nucleus: bool) -> jax.Array:
    """int32 token ids [...] drawn from logits [..., V] (the argmax when greedy)."""
    sampled = jax.random.categorical(key, processed_logits(logits, values, nucleus), axis=-1)
    return jnp.where(values.greedy, jnp.argmax(logits, axis=-1), sampled).astype(jnp.int32)


def sampling_probs(logits: jax.Array, values: SamplingValues, nucleus: bool) -> jax.Array:
    """The distribution `sample_tokens` draws from, [..., V] fp32 (one-hot at the argmax when greedy)."""
    argmax = jax.nn.one_hot(jnp.argmax(logits, axis=-1), logits.shape[-1], dtype=jnp.float32)
    return jnp.where(values.greedy, argmax, jax.nn.softmax(processed_logits(logits, values, nucleus), axis=-1))


def recorded_logprobs(hidden: jax.Array, lm_head_kernel: jax.Array, tokens: jax.Array,
                      values: SamplingValues) -> jax.Array:
    """The logprob recorded for `tokens` [B, S] read from `hidden` [B, S, D]: the trainer's own function."""
    return token_logprobs(hidden, lm_head_kernel, tokens, temperature=values.temperature)[0]


def is_eos(tokens: jax.Array, values: SamplingValues) -> jax.Array:
    return (tokens[..., None] == values.eos_ids).any(-1)
