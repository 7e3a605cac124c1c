"""The cost a Triton kernel declares, carried on its compiled custom call.

Mosaic (TPU) kernels keep `pl.CostEstimate` in their backend config, but jax's Triton lowering drops it, so a
GPU kernel's cost travels as frontend attributes of its custom call instead (`set_xla_metadata`), where
`glm5_jax.parallel.hlo_stats` reads it: moving a matmul into a kernel never makes its work vanish from a
compiled program's count. A TPU kernel's caller that knows its work better than the kernel's own estimate does
(megablox counts every row of a buffer its grid only partly visits) declares it the same way; the counter reads
the caller's cost first.
"""

from __future__ import annotations

from jax.experimental.xla_metadata import set_xla_metadata

KERNEL_COST_ATTRIBUTES = ("pallas_flops", "pallas_bytes_accessed", "pallas_transcendentals")


def declared_cost(flops: int, bytes_accessed: int, transcendentals: int = 0):
    """Context manager: `pallas_call`s traced inside carry this cost on their custom calls."""
    return set_xla_metadata(**dict(zip(KERNEL_COST_ATTRIBUTES, (int(flops), int(bytes_accessed),
                                                                int(transcendentals)))))
