"""Run a per-token computation on each device's own slice of the batch.

GSPMD cannot partition `lax.top_k`, `argsort` or a sort-based dispatch along a sharded batch: it all-gathers
the operand and every device computes the whole global batch. Work that is independent per row (the indexer's
top-k, the router's expert choice, the dropless MoE dispatch) therefore runs under `jax.shard_map` with the
leading dim split over the mesh's batch axes, so each device sorts only its own tokens. Flattened tokens
[B * S, ...] split over `TOKEN_AXES` (the batch axes, then `context`), like the [B, S] layout they come from.
"""

from __future__ import annotations

import jax
from jax.sharding import PartitionSpec

from glm5_jax.config.mesh import BATCH_AXES, TOKEN_AXES


def active_mesh(mesh):
    """`mesh`, else the mesh set by `jax.set_mesh` (abstract), else None."""
    if mesh is not None:
        return mesh
    abstract = jax.sharding.get_abstract_mesh()
    return None if abstract.empty else abstract


def mesh_platform(mesh) -> str:
    """The platform the program is compiled for: the mesh's devices' (a TPU pod described by libtpu on a CPU
    host is "tpu"), else the default backend."""
    mesh = active_mesh(mesh)
    devices = getattr(mesh, "devices", None)
    if devices is not None and getattr(devices, "size", 0):
        return devices.flat[0].platform
    return jax.default_backend()


def batch_split_axes(mesh, leading_dim: int, candidates: tuple[str, ...] = BATCH_AXES) -> tuple[str, ...]:
    """The `candidates` axes (outermost first) that split a leading dim of `leading_dim` rows; () when none do."""
    mesh = active_mesh(mesh)
    if mesh is None:
        return ()
    axes, split = [], 1
    for axis in candidates:
        size = dict(mesh.shape).get(axis, 1)
        if size > 1 and leading_dim % (split * size) == 0:
            axes.append(axis)
            split *= size
    return tuple(axes)


def batch_local(fn, mesh, batched: tuple, replicated: tuple = (), *, tokens: bool = False):
    """`fn(*batched, *replicated)` with every `batched` array's leading dim split over the batch axes (each
    device sees its own rows; with `tokens`, a leading dim of flattened tokens [B * S] split over TOKEN_AXES)
    and `replicated` arrays whole on every device. Outputs are batched the same way. Without a mesh, or when
    no axis divides the rows, it is just `fn(...)`."""
    rows = {x.shape[0] for x in jax.tree.leaves(batched)}
    if len(rows) != 1:
        raise ValueError(f"batch_local: the batched inputs disagree on their leading dim: {sorted(rows)}")
    axes = batch_split_axes(mesh, rows.pop(), TOKEN_AXES if tokens else BATCH_AXES)
    if not axes:
        return fn(*batched, *replicated)
    spec = PartitionSpec(axes)
    in_specs = tuple(jax.tree.map(lambda _: spec, x) for x in batched) + tuple(
        jax.tree.map(lambda _: PartitionSpec(), x) for x in replicated)
    return jax.shard_map(lambda *args: fn(*args), mesh=active_mesh(mesh), in_specs=in_specs, out_specs=spec,
                         check_vma=False)(*batched, *replicated)
