"""Run a per-token computation on each device's own slice of the batch.

GSPMD cannot partition `lax.top_k`, `argsort` or a sort-based dispatch along a sharded batch: it all-gathers
the operand and every device computes the whole global batch. Work that is independent per row (the indexer's
top-k, the router's expert choice, the dropless MoE dispatch) therefore runs under `jax.shard_map` with the
leading dim split over the mesh's batch axes, so each device sorts only its own tokens. Per-token work
(`token_local`) takes [B, S, ...] arrays split like the activations (batch axes on B, `context` on S) and
flattens each device's block inside: flattening outside would give GSPMD a [B * S] layout that a [B, S] one
split on both dims is not, and it would reshard the whole array to get there.
"""

from __future__ import annotations

import jax
from jax.sharding import PartitionSpec

from glm5_jax.config.mesh import BATCH_AXES, CONTEXT_AXIS, TOKEN_AXES


def active_mesh(mesh):
    """`mesh`, else the mesh set by `jax.set_mesh` (abstract), else None."""
    if mesh is not None:
        return mesh
    abstract = jax.sharding.get_abstract_mesh()
    return None if abstract.empty else abstract


def mesh_platform(mesh) -> str | None:
    """The platform the program is compiled for: the mesh's devices' (a TPU pod described by libtpu on a CPU
    host is "tpu"); None without a mesh (`glm5_jax.ops.platform.compiled_platform` then decides: the default
    device's platform or the default backend)."""
    mesh = active_mesh(mesh)
    devices = getattr(mesh, "devices", None)
    if devices is not None and getattr(devices, "size", 0):
        return devices.flat[0].platform
    return None


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


def batch_local(fn, mesh, batched: tuple, replicated: tuple = ()):
    """`fn(*batched, *replicated)` with every `batched` array's leading dim split over the batch axes (each
    device sees its own rows) and `replicated` arrays whole on every device. Outputs are batched the same way.
    Without a mesh, or when no batch axis divides the rows, it is just `fn(...)`."""
    rows = {x.shape[0] for x in jax.tree.leaves(batched)}
    if len(rows) != 1:
        raise ValueError(f"batch_local: the batched inputs disagree on their leading dim: {sorted(rows)}")
    axes = batch_split_axes(mesh, rows.pop())
    if not axes:
        return fn(*batched, *replicated)
    spec = PartitionSpec(axes)
    in_specs = tuple(jax.tree.map(lambda _: spec, x) for x in batched) + tuple(
        jax.tree.map(lambda _: PartitionSpec(), x) for x in replicated)
    return jax.shard_map(lambda *args: fn(*args), mesh=active_mesh(mesh), in_specs=in_specs, out_specs=spec,
                         check_vma=False)(*batched, *replicated)


def context_split(mesh) -> int:
    """How many chips share each sequence: the `context` axis size of `mesh` (or the mesh traced under)."""
    mesh = active_mesh(mesh)
    return 1 if mesh is None else dict(mesh.shape).get(CONTEXT_AXIS, 1)


def flattens_outside(mesh, lead_shape: tuple[int, ...]) -> bool:
    """Whether per-token work on [B, S] tokens flattens them to [T] before the split (over TOKEN_AXES, in
    contiguous blocks of T): whenever `context` does not split the sequence. Under a split sequence each
    device flattens its own [B, S] block instead."""
    return len(lead_shape) == 2 and context_split(mesh) == 1


def token_split_spec(mesh, lead_shape: tuple[int, ...]) -> PartitionSpec | None:
    """How tokens with leading dims `lead_shape` are split over the devices: [T] over the TOKEN_AXES that
    divide T; [B, S] over the batch axes that divide B and `context` when it divides S. None: not split."""
    if len(lead_shape) == 1:
        axes = batch_split_axes(mesh, lead_shape[0], TOKEN_AXES)
        return PartitionSpec(axes) if axes else None
    rows, seq = lead_shape
    axes = batch_split_axes(mesh, rows)
    context = batch_split_axes(mesh, seq, (CONTEXT_AXIS,))
    if not axes and not context:
        return None
    return PartitionSpec(axes or None, context[0] if context else None)


def spec_axes(spec: PartitionSpec) -> tuple[str, ...]:
    """The mesh axes a PartitionSpec splits over, in order."""
    return tuple(axis for entry in spec if entry is not None for axis in ((entry,) if isinstance(entry, str)
                                                                          else entry))


def token_local(fn, mesh, tokens: tuple, replicated: tuple = (), *, token_dims: int = 1):
    """`fn(*tokens, *replicated)` on each device's own tokens. Every `tokens` array has `token_dims` (1: [T];
    2: [B, S]) leading token dims, split as `token_split_spec` says; `fn` sees them flattened to [t, ...] and
    returns per-token arrays [t, ...], which come back with the inputs' leading dims. `replicated` arrays are
    whole on every device."""
    leads = {x.shape[:token_dims] for x in tokens}
    if len(leads) != 1:
        raise ValueError(f"token_local: the token inputs disagree on their leading dims: {sorted(leads)}")
    lead = leads.pop()
    if flattens_outside(mesh, lead):
        flat = tuple(x.reshape(-1, *x.shape[2:]) for x in tokens)
        out = token_local(fn, mesh, flat, replicated, token_dims=1)
        return jax.tree.map(lambda y: y.reshape(*lead, *y.shape[1:]), out)
    spec = token_split_spec(active_mesh(mesh), lead)

    def flat_fn(*args):
        local_lead = args[0].shape[:token_dims]
        flat = tuple(x.reshape(-1, *x.shape[token_dims:]) for x in args[:len(tokens)])
        out = fn(*flat, *args[len(tokens):])
        return jax.tree.map(lambda y: y.reshape(*local_lead, *y.shape[1:]), out)

    if spec is None:
        return flat_fn(*tokens, *replicated)
    in_specs = (spec,) * len(tokens) + tuple(jax.tree.map(lambda _: PartitionSpec(), x) for x in replicated)
    return jax.shard_map(flat_fn, mesh=active_mesh(mesh), in_specs=in_specs, out_specs=spec,
                         check_vma=False)(*tokens, *replicated)
