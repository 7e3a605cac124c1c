"""The `mesh:` section: sizes of the five named device-mesh axes (`glm5_jax.distributed.mesh` builds the mesh)."""

from __future__ import annotations

import dataclasses
import math
from typing import Any

from glm5_jax.config.core import parse_overrides

AXIS_NAMES = ("data", "fsdp", "expert", "context", "tensor")
# Axes that split the batch of sequences, outermost first.
BATCH_AXES = ("data", "fsdp", "expert")
# The axis that splits each sequence (context parallelism): the "seq" logical axis of activations.
CONTEXT_AXIS = "context"
# Axes that split the flattened tokens [B * S] (batch rows outermost, then each row's sequence split), so a
# token's place under them is its place in the [B, S] layout split over BATCH_AXES and CONTEXT_AXIS.
TOKEN_AXES = BATCH_AXES + (CONTEXT_AXIS,)


class MeshConfigError(ValueError):
    """A mesh size is not a positive integer or the mesh does not match the devices."""


@dataclasses.dataclass(frozen=True)
class MeshConfig:
    """Sizes of the five mesh axes; their product must equal the number of devices used. One axis may be -1:
    it takes the devices the others leave (`resolve`). `context` splits each sequence (not the batch)."""

    data: int = 1
    fsdp: int = 1
    expert: int = 1
    context: int = 1
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
                "mesh.data, mesh.fsdp, mesh.expert, mesh.context and mesh.tensor must equal the device count")
        return self

    @classmethod
    def from_mapping(cls, values: dict[str, Any]) -> "MeshConfig":
        unknown = sorted(set(values) - set(AXIS_NAMES))
        if unknown:
            raise MeshConfigError(f"mesh.{unknown[0]}={values[unknown[0]]!r} is invalid: unknown mesh axis; "
                                  f"the axes are {list(AXIS_NAMES)}")
        return cls(**values)


MESH_USAGE = "mesh.<axis>=<size>, e.g. mesh.fsdp=8"


def mesh_values(items: list[str], usage: str = MESH_USAGE) -> dict[str, Any]:
    """The axis sizes of `mesh.<axis>=N` command-line items (any other item is refused naming `usage`)."""
    return parse_overrides(items, sections=("mesh",), usage=usage).get("mesh", {})
