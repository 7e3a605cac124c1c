"""TPU topologies by their Cloud names (`v5p-8`, `v6e-256`, ...) and the figures of each chip, for compiling
ahead of time on a machine that has no TPU.

`jax.experimental.topologies.get_topology_desc` (libtpu, installed by the test extra as `jax[tpu]`) describes
a pod's devices without opening any; `jax.jit(...).trace(...).lower().compile()` on a mesh of those devices
runs XLA's TPU compiler and Mosaic for real. Names follow Cloud TPU: v4 / v5p count TensorCores (2 per
chip, `megacore`), v5e / v6e count chips.
"""

from __future__ import annotations

import dataclasses
import math
import os
import re

GIB = 1024**3


class TopologyError(ValueError):
    """A topology name is not known, or libtpu is not installed."""


@dataclasses.dataclass(frozen=True)
class ChipSpec:
    """Public per-chip figures (Cloud TPU documentation)."""

    generation: str
    hbm_bytes: int
    peak_bf16_flops: float  # per chip, dense
    ici_bytes_per_s: float  # per chip, all links together, one direction
    chip_config_name: str
    cores_per_chip: int  # TensorCores counted by the Cloud name


CHIPS = {
    "v4": ChipSpec("v4", 32 * GIB, 275e12, 2400e9 / 8, "megacore", 2),
    "v5p": ChipSpec("v5p", 95 * 10**9, 459e12, 4800e9 / 8, "megacore", 2),
    "v5e": ChipSpec("v5e", 16 * GIB, 197e12, 1600e9 / 8, "default", 1),
    "v6e": ChipSpec("v6e", 32 * GIB, 918e12, 3584e9 / 8, "default", 1),
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
        """The pod's TPU devices, described by libtpu (no TPU needed)."""
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
            desc = topologies.get_topology_desc(
                platform="tpu", topology_name=f"{self.chip.generation}:{self.grid}",
                chip_config_name=self.chip.chip_config_name, chips_per_host_bounds=bounds, num_slices=1)
        except Exception as err:  # libtpu missing or it rejected the grid
            raise TopologyError(
                f"--topology {self.name}: libtpu could not describe {self.chip.generation}:{self.grid} ({err}); "
                "install the test extra (`pip install -e '.[test]'`, which brings jax[tpu])") from None
        return list(desc.devices)


def get_topology(name: str) -> Topology:
    """`v5p-512` -> its chips. Also accepts `v5p:4x8x8` (generation and grid)."""
    match = re.fullmatch(r"(v\w+):(\d+(?:x\d+)+)", name)
    if match:
        generation, grid = match.groups()
    elif name in TOPOLOGY_GRIDS:
        generation, grid = name.split("-")[0], TOPOLOGY_GRIDS[name]
    else:
        raise TopologyError(f"--topology {name!r} is invalid: known names are {sorted(TOPOLOGY_GRIDS)}, or "
                            "GEN:GRID such as v5p:4x4x4")
    if generation not in CHIPS:
        raise TopologyError(f"--topology {name!r} is invalid: chip generation {generation!r} is not one of "
                            f"{sorted(CHIPS)}")
    return Topology(name, CHIPS[generation], grid)
