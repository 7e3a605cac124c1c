"""Device meshes with the five named axes `data`, `fsdp`, `expert`, `context`, `tensor` (any of size 1).

Axis roles: `data` replicates parameters and splits the batch; `fsdp` splits the batch and shards every
parameter on one large dim (gathered per layer when used); `expert` splits the batch outside the MoE and the
routed experts inside it; `context` splits each sequence (DSA's compact keys are all-gathered over it,
`glm5_jax.distributed.context_local`); `tensor` splits heads, MLP hidden and vocabulary. `tensor` is the
innermost axis so that its frequent all-reduces stay on the fastest links, `context` next to it (its
per-layer key all-gathers are the next most frequent).

Axis types are `AxisType.Auto`: the model code stays sharding-agnostic, GSPMD propagates the parameter
shardings and the `constrain` hints, and `jax.shard_map` (expert parallelism) runs inside `jax.jit` the same
way on jax 0.10 and 0.11. `Explicit` axes would make every einsum of the model state its output sharding.
"""

from __future__ import annotations

from typing import Sequence

import jax
from jax.experimental import mesh_utils
from jax.sharding import AxisType, Mesh

from glm5_jax.config.mesh import AXIS_NAMES, MeshConfig, MeshConfigError


def make_mesh(cfg: MeshConfig, devices: Sequence[jax.Device] | None = None) -> Mesh:
    """A `jax.make_mesh` mesh over `devices` (default: all) with the axes `AXIS_NAMES`, all `Auto`."""
    if not isinstance(cfg, MeshConfig):
        raise MeshConfigError(f"cfg must be a MeshConfig, got {type(cfg).__name__}")
    devices = list(jax.devices() if devices is None else devices)
    cfg.validate_devices(len(devices))
    axis_types = (AxisType.Auto,) * len(AXIS_NAMES)
    try:
        return jax.make_mesh(cfg.shape, AXIS_NAMES, axis_types=axis_types, devices=devices)
    except NotImplementedError:
        # A TPU torus whose physical axes no product of mesh axes matches (v5p-1024, 8x8x8, as data 2 x expert
        # 256): split a physical axis between two mesh axes instead of refusing.
        grid = mesh_utils.create_device_mesh(cfg.shape, devices, allow_split_physical_axes=True)
        return Mesh(grid, AXIS_NAMES, axis_types=axis_types)


def mesh_axis_size(mesh: Mesh | None, name: str) -> int:
    """Size of axis `name` in `mesh`; 1 when there is no mesh or the mesh lacks that axis."""
    if mesh is None or name not in mesh.axis_names:
        return 1
    return mesh.shape[name]
