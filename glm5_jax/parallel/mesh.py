"""Device meshes with the four named axes `data`, `fsdp`, `expert`, `tensor` (any of size 1).

Axis roles: `data` replicates parameters and splits the batch; `fsdp` splits the batch and shards every
parameter on one large dim (gathered per layer when used); `expert` splits the batch outside the MoE and the
routed experts inside it; `tensor` splits heads, MLP hidden and vocabulary. `tensor` is the innermost axis so
that its frequent all-reduces stay on the fastest links.

Axis types are `AxisType.Auto`: the model code stays sharding-agnostic, GSPMD propagates the parameter
shardings and the `constrain` hints, and `jax.shard_map` (expert parallelism) runs inside `jax.jit` the same
way on jax 0.10 and 0.11. `Explicit` axes would make every einsum of the model state its output sharding.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Sequence

import jax
from jax.sharding import AxisType, Mesh

AXIS_NAMES = ("data", "fsdp", "expert", "tensor")
# Axes that split the batch of tokens (every axis but `tensor`), outermost first.
BATCH_AXES = ("data", "fsdp", "expert")


class MeshConfigError(ValueError):
    """A mesh size is not a positive integer or the mesh does not match the devices."""


@dataclasses.dataclass(frozen=True)
class MeshConfig:
    """Sizes of the four mesh axes; their product must equal the number of devices used. One axis may be -1:
    it takes the devices the others leave (`resolve`)."""

    data: int = 1
    fsdp: int = 1
    expert: int = 1
    tensor: int = 1

    def __post_init__(self):
        for name in AXIS_NAMES:
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or (value < 1 and value != -1):
                raise MeshConfigError(f"mesh.{name}={value!r} is invalid: must be an integer >= 1, or -1 for "
                                      "the devices the other axes leave")
        rest = [name for name in AXIS_NAMES if getattr(self, name) == -1]
        if len(rest) > 1:
            raise MeshConfigError(f"mesh.{rest[1]}=-1 is invalid: only one axis may be -1 (mesh.{rest[0]} is)")

    def resolve(self, device_count: int) -> "MeshConfig":
        """This mesh with a -1 axis replaced by the devices left over; checks the product."""
        fixed = math.prod(size for size in self.shape if size != -1)
        rest = [name for name in AXIS_NAMES if getattr(self, name) == -1]
        if rest:
            if device_count % fixed:
                raise MeshConfigError(f"mesh.{rest[0]}=-1 is invalid: the other axes use {fixed} devices, which "
                                      f"does not divide the {device_count} available")
            return dataclasses.replace(self, **{rest[0]: device_count // fixed}).validate_devices(device_count)
        return self.validate_devices(device_count)

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(getattr(self, name) for name in AXIS_NAMES)

    @property
    def num_devices(self) -> int:
        return math.prod(self.shape)

    def axis_sizes(self) -> dict[str, int]:
        return dict(zip(AXIS_NAMES, self.shape))

    def validate_devices(self, device_count: int) -> "MeshConfig":
        if self.num_devices != device_count:
            sizes = " x ".join(f"{name}={size}" for name, size in self.axis_sizes().items())
            raise MeshConfigError(
                f"mesh {sizes} has {self.num_devices} devices but {device_count} are available: the product of "
                "mesh.data, mesh.fsdp, mesh.expert and mesh.tensor must equal the device count")
        return self

    @classmethod
    def from_mapping(cls, values: dict[str, Any]) -> "MeshConfig":
        unknown = sorted(set(values) - set(AXIS_NAMES))
        if unknown:
            raise MeshConfigError(f"mesh.{unknown[0]}={values[unknown[0]]!r} is invalid: unknown mesh axis; "
                                  f"the axes are {list(AXIS_NAMES)}")
        return cls(**values)


def make_mesh(cfg: MeshConfig, devices: Sequence[jax.Device] | None = None) -> Mesh:
    """A `jax.make_mesh` mesh over `devices` (default: all) with the axes `AXIS_NAMES`, all `Auto`."""
    if not isinstance(cfg, MeshConfig):
        raise MeshConfigError(f"cfg must be a MeshConfig, got {type(cfg).__name__}")
    devices = list(jax.devices() if devices is None else devices)
    cfg.validate_devices(len(devices))
    return jax.make_mesh(cfg.shape, AXIS_NAMES, axis_types=(AxisType.Auto,) * len(AXIS_NAMES), devices=devices)


def mesh_axis_size(mesh: Mesh | None, name: str) -> int:
    """Size of axis `name` in `mesh`; 1 when there is no mesh or the mesh lacks that axis."""
    if mesh is None or name not in mesh.axis_names:
        return 1
    return mesh.shape[name]
