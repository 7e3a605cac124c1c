"""Learning-rate schedules: linear warm-up followed by cosine, linear or constant decay.

Step s (0-based, the optimizer's update count) gets, during warm-up, `peak * (s + 1) / warmup_steps`, so the
first update already moves the weights and step `warmup_steps - 1` reaches the peak. After warm-up the decay
runs from `peak` at step `warmup_steps` to `end` at step `total_steps` and stays at `end` afterwards.
"""

from __future__ import annotations

import math

import jax.numpy as jnp
import optax

from glm5_jax.config.optim import SCHEDULES


def warmup_then_decay(
    kind: str, *, peak: float, end: float, warmup_steps: int, total_steps: int
) -> optax.Schedule:
    """An optax schedule (step -> learning rate) with linear warm-up and the given decay `kind`."""
    if kind not in SCHEDULES:
        raise ValueError(f"schedule={kind!r} is invalid: must be one of {SCHEDULES}")
    decay_steps = max(1, total_steps - warmup_steps)

    def schedule(step):
        step = jnp.asarray(step, jnp.float32)
        warm = peak * jnp.minimum(1.0, (step + 1.0) / max(1, warmup_steps))
        progress = jnp.clip((step - warmup_steps) / decay_steps, 0.0, 1.0)
        if kind == "cosine":
            decayed = end + (peak - end) * 0.5 * (1.0 + jnp.cos(math.pi * progress))
        elif kind == "linear":
            decayed = peak + (end - peak) * progress
        else:
            decayed = jnp.full_like(progress, peak)
        return jnp.where(step < warmup_steps, warm, decayed)

    return schedule
