"""Input checks for `forward`, run on shapes and dtypes (always) and on values (when they are concrete),
before anything is traced into a computation."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from glm5_jax.config import ModelConfig


class InputError(ValueError):
    """An argument of a public model entry point has the wrong shape, dtype or values."""


def _is_concrete(x) -> bool:
    return not isinstance(x, jax.core.Tracer)


def _check_int_rank2(name: str, x, shape=None) -> None:
    if not hasattr(x, "shape") or not hasattr(x, "dtype"):
        raise InputError(f"{name} must be an array, got {type(x).__name__}")
    if x.ndim != 2:
        raise InputError(f"{name} must have rank 2 [batch, seq], got shape {tuple(x.shape)}")
    if not jnp.issubdtype(x.dtype, jnp.integer):
        raise InputError(f"{name} must be an integer array, got dtype {x.dtype}")
    if shape is not None and tuple(x.shape) != tuple(shape):
        raise InputError(f"{name} has shape {tuple(x.shape)}, but tokens have shape {tuple(shape)}")


def validate_params(params, config: ModelConfig) -> None:
    """A model state (pure dict or `nnx.State`) holds the model's weights, shaped for `config`."""
    layers = [k for k in ("dense_layers", "moe_layers") if k in params]
    if "embed" not in params or not layers:
        raise InputError(f"params is missing model weights: top-level keys {sorted(params)}")
    emb = params["embed"]["embedding"]
    if tuple(emb.shape) != (config.vocab_size, config.hidden_size):
        raise InputError(f"params embed.embedding has shape {tuple(emb.shape)}, but the config needs "
                         f"{(config.vocab_size, config.hidden_size)}: the params belong to another model shape")


def validate_forward_inputs(tokens, positions, segment_ids, config: ModelConfig, expert_choices=None,
                            topk_indices=None) -> None:
    _check_int_rank2("tokens", tokens)
    if tokens.shape[1] == 0 or tokens.shape[0] == 0:
        raise InputError(f"tokens must be non-empty, got shape {tuple(tokens.shape)}")
    if _is_concrete(tokens):
        values = np.asarray(tokens)
        bad = (values < 0) | (values >= config.vocab_size)
        if bad.any():
            where = tuple(int(i) for i in np.argwhere(bad)[0])
            raise InputError(f"tokens[{where}]={int(values[where])} is outside the vocabulary "
                             f"[0, {config.vocab_size})")
    if positions is not None:
        _check_int_rank2("positions", positions, tokens.shape)
        if _is_concrete(positions) and (np.asarray(positions) < 0).any():
            raise InputError("positions must be >= 0")
    if segment_ids is not None:
        _check_int_rank2("segment_ids", segment_ids, tokens.shape)
        if _is_concrete(segment_ids):
            seg = np.asarray(segment_ids)
            if (seg < 0).any():
                raise InputError("segment_ids must be >= 0 (0 marks padding)")
            # Packed documents are contiguous: a segment id never reappears after another one started.
            for row, ids in enumerate(seg):
                change = np.flatnonzero(np.diff(ids)) + 1
                starts = ids[np.concatenate([[0], change])]
                real = starts[starts > 0]
                if len(np.unique(real)) != len(real):
                    raise InputError(f"segment_ids row {row} is not contiguous: segment ids {real.tolist()} "
                                     "repeat after another segment (each packed document must be one run)")
    b, s = tokens.shape
    if expert_choices is not None:
        expected = (config.num_moe_layers, b, s, config.num_experts_per_tok)
        if tuple(expert_choices.shape) != expected:
            raise InputError(f"expert_choices has shape {tuple(expert_choices.shape)}, expected {expected} "
                             "[moe layers, batch, seq, experts per token]")
    if topk_indices is not None:
        expected = (config.num_hidden_layers, b, s, min(config.index_topk, s))
        if tuple(topk_indices.shape) != expected:
            raise InputError(f"topk_indices has shape {tuple(topk_indices.shape)}, expected {expected} "
                             "[layers, batch, seq, min(index_topk, seq)]")
