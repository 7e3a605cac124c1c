"""Which implementation an operation runs: the DSA kernels by config, the grouped matmul by platform."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import jax

from glm5_jax.config import ConfigError, ModelConfig
from pallas_kernels._common import default_platform, resolve_platform

KERNEL_ATTENTION_BACKEND = "pallas"


def uses_kernels(config: ModelConfig) -> bool:
    """Whether DSA's operations (sparse attention, indexer scores and top-k, KL targets) run the Pallas kernels."""
    return config.attention_backend == KERNEL_ATTENTION_BACKEND


def uses_tpu_kernels(config: ModelConfig) -> bool:
    """Whether the kernels are the Mosaic (TPU) ones: on a TPU, with `pallas_platform: tpu`, or in the TPU
    interpret mode the tests ask for. Operations with only a Mosaic kernel keep their jnp path otherwise."""
    return uses_kernels(config) and resolve_platform(config.pallas_options.get("platform")) == "tpu"


def _traced_mesh_device():
    """The device of the mesh being traced under (inside `shard_map`: the devices compiled for, such as a TPU pod
    described on a CPU host), or None outside one."""
    return getattr(jax.sharding.get_abstract_mesh(), "abstract_device", None)


def compiled_platform(platform: str | None = None) -> str:
    """`platform` if given; else that of the mesh being traced under (inside `shard_map` it names the devices
    compiled for, such as a TPU pod described on a CPU host); else that of `jax.default_device` when one is set
    (the host CPU of a GPU machine runs the CPU paths; seen on an H200, where the default backend's Triton
    kernel was lowered for the CPU); else the default backend."""
    if platform is not None:
        return platform
    device = _traced_mesh_device()
    return default_platform() if device is None else device.platform


def compiled_device_kind() -> str:
    """jax's name of the chip compiled for ("TPU v6 lite", "NVIDIA H200", ...): that of the mesh being traced
    under (a pod described on a CPU host included), else of `jax.default_device` when it is a device, else of
    the first device."""
    device = _traced_mesh_device()
    if device is not None:
        return device.device_kind
    return getattr(jax.config.jax_default_device, "device_kind", None) or jax.devices()[0].device_kind


def kernels_for_devices(config: ModelConfig, devices: Sequence[jax.Device]) -> ModelConfig:
    """`config` with its DSA kernels built for `devices`: with the Pallas backend, `pallas_platform: auto` becomes
    the devices' platform ("tpu" or "gpu"; a TPU pod or GPU cluster described on a CPU host would otherwise get
    the host's choice, Triton), and a platform naming the other kind of accelerator is refused by name before
    anything is traced. CPU devices keep the configured value (the kernels' interpret modes)."""
    chip_platform = {"tpu": "tpu", "gpu": "gpu", "cuda": "gpu"}.get(devices[0].platform)
    if not uses_kernels(config) or chip_platform is None or config.pallas_platform == chip_platform:
        return config
    if config.pallas_platform == "auto":
        return dataclasses.replace(config, pallas_platform=chip_platform)
    raise ConfigError(f"model.pallas_platform={config.pallas_platform!r} builds the DSA kernels for other chips "
                      f"than these {devices[0].device_kind} devices; use {chip_platform!r} (or 'auto')")
