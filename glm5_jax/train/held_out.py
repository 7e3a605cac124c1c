"""The held-out loss of a batch: summed next-token cross-entropy and the number of scored tokens, with the
model's configured attention (a DSA model is evaluated with its top-k selection). `glm5 train`'s end-of-run
evaluation and `glm5 eval` share it, so their figures are the same computation."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from glm5_jax.config import ModelConfig
from glm5_jax.model.transformer import forward
from glm5_jax.train import losses


def batch_loss_fn(config: ModelConfig, vocab_chunk: int, mesh, out_sharding):
    """jitted (params, batch) -> [loss sum, scored tokens] (fp32, replicated by `out_sharding`)."""

    @functools.partial(jax.jit, out_shardings=out_sharding)
    def batch_loss(params, batch):
        out = forward(params, batch["tokens"], config=config, positions=batch["positions"],
                      segment_ids=batch["segment_ids"], return_logits=False, mtp_steps=0, mesh=mesh)
        return jnp.stack(losses.cross_entropy(out.hidden, params["lm_head"]["kernel"], batch["tokens"],
                                              batch["segment_ids"], batch["loss_mask"], vocab_chunk))

    return batch_loss
