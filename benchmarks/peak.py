"""The machine's measured fp32 matmul peak, for MFU figures: best of several large square products."""

from __future__ import annotations

import time

import jax
import jax.numpy as jnp


def _best_seconds(run, repeats: int) -> float:
    run()  # warm-up (and compile)
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        run()
        best = min(best, time.perf_counter() - start)
    return best


def matmul_peak_flops(size: int, repeats: int, dtype=jnp.float32) -> float:
    """Best FLOP/s of a jitted [size, size] @ [size, size] jnp product (2 size^3 FLOPs)."""
    a = jax.random.normal(jax.random.key(0), (size, size), dtype)
    b = jax.random.normal(jax.random.key(1), (size, size), dtype)
    dot = jax.jit(jnp.dot)
    return 2 * size**3 / _best_seconds(lambda: jax.block_until_ready(dot(a, b)), repeats)


def torch_matmul_peak_flops(size: int, repeats: int) -> float:
    """The same for torch.mm in fp32 (the reference implementation's own matmul library)."""
    import torch

    a, b = torch.randn(size, size), torch.randn(size, size)
    return 2 * size**3 / _best_seconds(lambda: torch.mm(a, b), repeats)
