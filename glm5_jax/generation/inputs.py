"""Checks and layout of what callers hand to generation, done in plain Python before anything compiles.

Prompts are token-id lists of any lengths; they are right-padded into one [B, P] array (P = the longest)
and every row keeps its own length, so position t of a row is cache slot t (see `generation.cache`).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from glm5_jax.config import ModelConfig
from glm5_jax.distributed.batch_local import context_split
from glm5_jax.generation.sampling import GenerationError, SamplingParams

PAD_ID = 0


def padded_prompts(prompts: Sequence[Sequence[int]], vocab_size: int) -> tuple[np.ndarray, np.ndarray]:
    """Right-padded int32 prompts [B, P] (PAD_ID after each row's end) and the lengths [B]."""
    if isinstance(prompts, np.ndarray) and prompts.ndim == 2:
        prompts = list(prompts)
    if isinstance(prompts, (str, bytes)) or not isinstance(prompts, Sequence) or len(prompts) == 0:
        raise GenerationError(f"prompts={prompts!r:.80} is invalid: expected a non-empty list of token-id lists")
    rows = []
    for row, prompt in enumerate(prompts):
        ids = np.asarray(prompt)
        if ids.ndim != 1 or ids.size == 0:
            raise GenerationError(f"prompts[{row}] has shape {ids.shape}: each prompt must be a non-empty list of "
                                  "token ids")
        if ids.dtype.kind not in "iu":
            raise GenerationError(f"prompts[{row}] has dtype {ids.dtype}: token ids must be integers")
        bad = (ids < 0) | (ids >= vocab_size)
        if bad.any():
            at = int(np.argmax(bad))
            raise GenerationError(f"prompts[{row}][{at}]={int(ids[at])} is outside the vocabulary [0, {vocab_size})")
        rows.append(ids.astype(np.int32))
    lengths = np.array([len(r) for r in rows], np.int32)
    padded = np.full((len(rows), int(lengths.max())), PAD_ID, np.int32)
    for row, ids in enumerate(rows):
        padded[row, : len(ids)] = ids
    return padded, lengths


def resolve_max_len(max_len: int | None, lengths: np.ndarray, sampling: SamplingParams, lookahead: int,
                    config: ModelConfig, context: int = 1) -> int:
    """Cache length: the given `max_len`, or just enough for the longest prompt, the new tokens and
    `lookahead` slots that speculative verification writes past the last emitted token (rounded up to a
    multiple of `context`, the chips the cache's slots are split over)."""
    needed = int(lengths.max()) + sampling.max_new_tokens + lookahead
    if max_len is None:
        max_len = needed + -needed % context
    if isinstance(max_len, bool) or not isinstance(max_len, int) or max_len < needed:
        raise GenerationError(f"max_len={max_len!r} is invalid: must be an integer >= longest prompt "
                              f"({int(lengths.max())}) + max_new_tokens ({sampling.max_new_tokens})"
                              + (f" + num_draft ({lookahead})" if lookahead else "") + f" = {needed}")
    if max_len % context:
        raise GenerationError(f"max_len={max_len} is invalid: mesh.context={context} splits the cache's slots into "
                              f"equal shares, so it must be a multiple of {context}")
    if max_len > config.max_position_embeddings:
        raise GenerationError(f"max_len={max_len} is invalid: must be <= max_position_embeddings "
                              f"({config.max_position_embeddings})")
    return max_len


def check_context_split(mesh, config: ModelConfig) -> int:
    """The chips each sequence and the cache are split over (`mesh.context`), once what they need is checked."""
    split = context_split(mesh)
    if split > 1 and config.attention_backend == "pallas":
        raise GenerationError(f"mesh.context={split} is invalid with attention_backend='pallas': decoding over a "
                              "split cache runs the jnp path; use attention_backend sparse, dense or auto, or "
                              "mesh.context=1")
    return split


def check_model(params: dict, config: ModelConfig, *, needs_mtp: bool) -> None:
    config.validate()
    if config.moe_backend == "ep":
        raise GenerationError("config.moe_backend='ep' is not supported by generation (it needs a device mesh): "
                              "use 'ragged' or 'reference'")
    embedding = params.get("embed", {}).get("embedding") if isinstance(params, dict) else None
    if embedding is None:
        raise GenerationError("params has no embed.embedding: pass the model's parameter pytree")
    if tuple(embedding.shape) != (config.vocab_size, config.hidden_size):
        raise GenerationError(f"params embed.embedding has shape {tuple(embedding.shape)}, but the config needs "
                              f"{(config.vocab_size, config.hidden_size)}: the params belong to another model")
    if needs_mtp and "mtp" not in params:
        raise GenerationError("params has no 'mtp' module: speculative decoding drafts with it (the config needs "
                              "num_nextn_predict_layers=1 and params built or converted with the MTP layer)")
