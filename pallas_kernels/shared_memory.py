"""Shared memory of the GPU the Triton kernels are built for, and the largest block / pipeline depth that fits it.

Each Triton kernel states its shared-memory footprint as a formula of its block size and pipeline stages
(next to the kernel); the functions here pick the largest power-of-two block not above the requested one,
then the most stages, whose footprint fits the device's opt-in shared memory per block. The formulas count
the tiles Triton keeps in shared memory (dot operands held across the loop, gathered rows per stage);
SCRATCH_BYTES covers what Triton adds on top (barriers, small layout conversions). Checked against the
allocation of XLA's Triton compiler for H100 / H200 at GLM-5's shapes (tests/pallas_kernels/test_gpu_compile.py).
"""

from __future__ import annotations

import functools
import re
from typing import Callable

from pallas_kernels._common import MIN_BLOCK
from pallas_kernels.gpu_targets import gpu_target_config

# H100 and H200 have the same 227 KiB per block; a GPU with less needs its target passed here.
DEFAULT_GPU_TARGET = "h100"
SCRATCH_BYTES = 8 * 1024
# Triton's default software-pipelining depth on NVIDIA GPUs.
MAX_STAGES = 3


@functools.cache
def shared_memory_limit(target: str = DEFAULT_GPU_TARGET) -> int:
    """Opt-in shared memory per block of GPU `target`, bytes (its target config's shared_memory_per_block_optin)."""
    found = re.search(r"shared_memory_per_block_optin:\s*(\d+)", gpu_target_config(target))
    if found is None:
        raise ValueError(f"the target config of {target!r} has no shared_memory_per_block_optin")
    return int(found.group(1))


def fits(footprint: int, limit: int | None = None) -> bool:
    return footprint + SCRATCH_BYTES <= (shared_memory_limit() if limit is None else limit)


def fit_block_and_stages(block: int, footprint: Callable[[int, int], int], *, limit: int | None = None,
                         max_stages: int = MAX_STAGES) -> tuple[int, int]:
    """(block, stages): the largest power of two <= `block` (down to MIN_BLOCK), then the most stages up to
    max_stages, for which footprint(block, stages) bytes fit. When nothing fits, (MIN_BLOCK, 1): the compiler
    then reports how much the kernel asks for."""
    while block > MIN_BLOCK and not fits(footprint(block, 1), limit):
        block //= 2
    stages = 1
    while stages < max_stages and fits(footprint(block, stages + 1), limit):
        stages += 1
    return block, stages
