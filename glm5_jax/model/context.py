"""What every layer shares for one batch of tokens: rotary angles, packed-segment ids and the real-token mask."""

from __future__ import annotations

from typing import NamedTuple

import jax

from glm5_jax.config import ModelConfig
from glm5_jax.model.layers import rope_angles


class LayerContext(NamedTuple):
    """Per-sequence inputs every layer shares."""

    cos: jax.Array           # [B, S, R/2] rotary angles of the queries (= keys in training)
    sin: jax.Array
    segment_ids: jax.Array   # [B, S] int32, 0 = padding
    token_mask: jax.Array    # [B, S] bool, real tokens


def layer_context(positions: jax.Array, segment_ids: jax.Array, config: ModelConfig) -> LayerContext:
    """What every layer shares for tokens at `positions` [B, S] with `segment_ids` [B, S] (0 = padding)."""
    cos, sin = rope_angles(positions, config.qk_rope_head_dim, config.rope_theta)
    return LayerContext(cos=cos, sin=sin, segment_ids=segment_ids, token_mask=segment_ids > 0)
