"""An HBM buffer nothing writes (TPU): the output of a Mosaic call whose kernel does nothing.

For a buffer a collective fills in place, such as the receive buffer of `jax.lax.ragged_all_to_all`, whose rows
past those received the caller never reads: `jnp.zeros` would write all of it first (the v6e-256 step's expert
dispatch: 42 GB of HBM traffic per chip and step for two [23040, 6144] bf16 buffers per layer). Its rows hold
whatever the memory held, NaN bit patterns included. It declares no work, so `glm5 compile` counts none.

The call takes a value it ignores (`after`): a call with no operands is loop-invariant, and XLA hoists it out of
the layers' loop, then copies the one buffer into each layer's collective (as much traffic as the zeros).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from pallas_kernels._common import tpu_interpret


def _nothing(after_ref, out_ref):
    del after_ref, out_ref


def uninitialized(shape: tuple[int, ...], dtype, after: jax.Array, interpret: bool = False) -> jax.Array:
    """A [shape] array of `dtype` in HBM with undefined contents, made once `after` (any array, e.g. a value of
    the current loop step) is (Mosaic: TPU; `interpret` runs it in TPU interpret mode, where uninitialised memory
    reads NaN)."""
    token = jnp.ravel(after)[:1].astype(jnp.int32)
    return pl.pallas_call(_nothing, out_shape=jax.ShapeDtypeStruct(tuple(shape), dtype),
                          in_specs=[pl.BlockSpec(memory_space=pltpu.SMEM)],
                          out_specs=pl.BlockSpec(memory_space=pl.ANY),
                          cost_estimate=pl.CostEstimate(flops=0, bytes_accessed=0, transcendentals=0),
                          interpret=tpu_interpret(interpret))(token)
