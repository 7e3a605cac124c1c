"""TPU topologies by their Cloud names (`v5p-8`, `v6e-256`, ...), NVIDIA GPU clusters (`h100-64`,
`h200-128`: N GPUs, 8 per node) and the figures of each chip, for compiling ahead of time on a machine that
has neither.

`jax.experimental.topologies.get_topology_desc` describes a pod's or cluster's devices without opening any:
libtpu (the test extra's `jax[tpu]`) for TPU; for GPU the CUDA PJRT plugin (`jax-cuda12-plugin`, no CUDA
driver needed) with a device description from `pallas_kernels.gpu_targets`. `jax.jit(...).trace(...).lower()
.compile()` on a mesh of those devices runs XLA's TPU compiler and Mosaic, or XLA's GPU compiler and Triton,
for real. Names follow Cloud TPU: v4 / v5p count TensorCores (2 per chip, `megacore`), v5e / v6e count chips.
"""

from __future__ import annotations

import dataclasses
import math
import os
import re

from glm5_jax.quiet import native_stderr_silenced
from pallas_kernels.gpu_targets import gpu_target_config

GIB = 1024**3
GPUS_PER_NODE = 8


class TopologyError(ValueError):
    """A topology name is not known, or libtpu / the CUDA plugin is not installed."""


@dataclasses.dataclass(frozen=True)
class ChipSpec:
    """Public per-chip figures (Cloud TPU documentation, NVIDIA data sheets)."""

    generation: str
    hbm_bytes: int
    peak_bf16_flops: float  # per chip, dense
    hbm_bytes_per_s: float
    ici_bytes_per_s: float  # per chip, all links together, one direction (TPU ICI; GPU NVLink within a node)
    chip_config_name: str = "default"  # libtpu's chip config
    cores_per_chip: int = 1  # TensorCores counted by the Cloud name
    platform: str = "tpu"
    inter_node_bytes_per_s: float = 0.0  # GPU: per GPU, one direction, between nodes (0: one ICI domain)


CHIPS = {
    "v4": ChipSpec("v4", 32 * GIB, 275e12, 1.2e12, 2400e9 / 8, "megacore", 2),
    "v5p": ChipSpec("v5p", 95 * 10**9, 459e12, 2.765e12, 4800e9 / 8, "megacore", 2),
    "v5e": ChipSpec("v5e", 16 * GIB, 197e12, 8.19e11, 1600e9 / 8),
    "v6e": ChipSpec("v6e", 32 * GIB, 918e12, 1.64e12, 3584e9 / 8),
    # HBM as the driver reports it (XLA's device descriptions); NVLink 4: 900 GB/s both ways; 400 Gb/s
    # InfiniBand per GPU between nodes.
    "h100": ChipSpec("h100", 84_942_979_072, 989e12, 3.35e12, 450e9, platform="cuda", inter_node_bytes_per_s=50e9),
    "h200": ChipSpec("h200", 151_397_597_184, 989e12, 4.8e12, 450e9, platform="cuda", inter_node_bytes_per_s=50e9),
}

# Cloud name -> chip grid given to libtpu. 3D tori for v4 / v5p, 2D for v5e / v6e.
TOPOLOGY_GRIDS = {
    "v4-8": "2x2x1", "v4-16": "2x2x2", "v4-32": "2x2x4", "v4-64": "2x4x4", "v4-128": "4x4x4",
    "v4-256": "4x4x8", "v4-512": "4x8x8", "v4-1024": "8x8x8",
    "v5p-8": "2x2x1", "v5p-16": "2x2x2", "v5p-32": "2x2x4", "v5p-64": "2x4x4", "v5p-128": "4x4x4",
    "v5p-256": "4x4x8", "v5p-512": "4x8x8", "v5p-1024": "8x8x8", "v5p-2048": "8x8x16",
    "v5e-1": "1x1", "v5e-4": "2x2", "v5e-8": "2x4", "v5e-16": "4x4", "v5e-32": "4x8", "v5e-64": "8x8",
    "v5e-128": "8x16", "v5e-256": "16x16",
    "v6e-1": "1x1", "v6e-4": "2x2", "v6e-8": "2x4", "v6e-16": "4x4", "v6e-32": "4x8", "v6e-64": "8x8",
    "v6e-128": "8x16", "v6e-256": "16x16",
}


@dataclasses.dataclass(frozen=True)
class Topology:
    name: str
    chip: ChipSpec
    grid: str

    @property
    def num_chips(self) -> int:
        return math.prod(int(n) for n in self.grid.split("x"))

    def devices(self):
        """The pod's TPU devices described by libtpu, or the cluster's GPUs by the CUDA plugin (none needed)."""
        if self.chip.platform == "cuda":
            return self._gpu_devices()
        try:
            from jax.experimental import topologies
        except ImportError as err:  # pragma: no cover - very old jax
            raise TopologyError(f"jax.experimental.topologies is unavailable: {err}") from None
        # Only describing a pod (no chip is opened), so several processes may load libtpu at once; without this
        # libtpu's lockfile lets one process in at a time.
        os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")
        dims = [int(n) for n in self.grid.split("x")]
        bounds = (min(dims[0], 2), min(dims[1], 2), 1)
        try:
            # libtpu logs that it finds no TPU host here ("Failed to find host bounds", "unexpected worker
            # hostname"): true and beside the point when only describing a pod; its errors still raise.
            with native_stderr_silenced():
                desc = topologies.get_topology_desc(
                    platform="tpu", topology_name=f"{self.chip.generation}:{self.grid}",
                    chip_config_name=self.chip.chip_config_name, chips_per_host_bounds=bounds, num_slices=1)
        except Exception as err:  # libtpu missing or it rejected the grid
            raise TopologyError(
                f"--topology {self.name}: libtpu could not describe {self.chip.generation}:{self.grid} ({err}); "
                "install the test extra (`pip install -e '.[test]'`, which brings jax[tpu])") from None
        return list(desc.devices)

    def _gpu_devices(self):
        from jax.experimental import topologies

        try:
            desc = topologies.get_topology_desc(platform="cuda", target_config=gpu_target_config(self.chip.generation),
                                                topology=self.grid)
        except Exception as err:  # the CUDA plugin missing, or it rejected the description
            raise TopologyError(
                f"--topology {self.name}: the CUDA plugin could not describe {self.grid} {self.chip.generation} "
                f"GPUs ({err}); install the test extra (`pip install -e '.[test]'`, which brings "
                "jax-cuda12-plugin and jax-cuda12-pjrt)") from None
        return list(desc.devices)


def _gpu_grid(name: str, gpus: int) -> str:
    """`1x{nodes}x{gpus per node}`, as the CUDA plugin's topology string wants it."""
    if 1 <= gpus <= GPUS_PER_NODE:
        return f"1x1x{gpus}"
    if gpus < 1 or gpus % GPUS_PER_NODE:
        raise TopologyError(f"--topology {name!r} is invalid: the GPU count must be 1 to "
                            f"{GPUS_PER_NODE} or a multiple of {GPUS_PER_NODE} (GPUs per node), e.g. h200-64")
    return f"1x{gpus // GPUS_PER_NODE}x{GPUS_PER_NODE}"


def get_topology(name: str) -> Topology:
    """`v5p-512` -> its chips; `h200-64` -> 8 nodes of 8 GPUs. Also accepts `v5p:4x8x8` (generation and grid)."""
    gpu = re.fullmatch(r"(h100|h200)-(\d+)", name)
    if gpu:
        return Topology(name, CHIPS[gpu.group(1)], _gpu_grid(name, int(gpu.group(2))))
    match = re.fullmatch(r"(v\w+):(\d+(?:x\d+)+)", name)
    if match:
        generation, grid = match.groups()
    elif name in TOPOLOGY_GRIDS:
        generation, grid = name.split("-")[0], TOPOLOGY_GRIDS[name]
    else:
        raise TopologyError(f"--topology {name!r} is invalid: known names are {sorted(TOPOLOGY_GRIDS)}, "
                            "GEN:GRID such as v5p:4x4x4, or h100-N / h200-N (N GPUs: 1 to 8, or a multiple of 8)")
    if generation not in CHIPS or CHIPS[generation].platform != "tpu":
        raise TopologyError(f"--topology {name!r} is invalid: chip generation {generation!r} is not one of "
                            f"{sorted(k for k, c in CHIPS.items() if c.platform == 'tpu')}")
    return Topology(name, CHIPS[generation], grid)
