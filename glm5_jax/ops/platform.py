"""Which implementation an operation runs: the DSA kernels by config, the grouped matmul by platform."""

from __future__ import annotations

import jax

from glm5_jax.config import ModelConfig

KERNEL_ATTENTION_BACKEND = "pallas"


def uses_kernels(config: ModelConfig) -> bool:
    """Whether DSA's operations (sparse attention, indexer scores and top-k, KL targets) run the Pallas kernels."""
    return config.attention_backend == KERNEL_ATTENTION_BACKEND


def compiled_platform(platform: str | None = None) -> str:
    """`platform` if given; else that of the mesh being traced under (inside `shard_map` it names the devices
    compiled for, such as a TPU pod described on a CPU host), else the default backend."""
    if platform is not None:
        return platform
    device = getattr(jax.sharding.get_abstract_mesh(), "abstract_device", None)
    return device.platform if device is not None else jax.default_backend()
