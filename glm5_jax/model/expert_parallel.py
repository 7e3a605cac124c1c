"""Expert parallelism (MoE backend `ep`): tokens travel to the devices that own their experts by all-to-all,
run there as grouped matmuls (`jax.lax.ragged_dot`), and travel back to be combined.

Inside `jax.shard_map` tokens are split over the batch axes (`data`, `fsdp`, `expert`) and the routed experts
over `expert` (E / ep experts per device, gathered over `fsdp`, their hidden width F split over `tensor`; the
partial outputs are summed over `tensor` at the end). Every device works on fixed-size buffers:

  send buffer [ep * C, D]: chunk j holds the rows for the experts of expert-rank j, sorted by expert;
  C = E_local * per-expert capacity, at most t * A (t local tokens, A experts per token).

Capacity. `moe_capacity_factor` 0 (the default) is dropless: an expert keeps all its assignments, at most t
per source device, so C never overflows. With a factor cf > 0 each expert keeps, per source device, the first
ceil(cf * t * A / E) assignments in token order; later ones are dropped deterministically, contribute
nothing (the token keeps its other experts and the shared expert) and are counted in
aux["dropped_assignments"] (summed over all devices).

Transport (`ep_transport`): "padded" exchanges whole buffers with `jax.lax.all_to_all` and runs anywhere
(CPU tests); "ragged" sends only the filled rows with `jax.lax.ragged_all_to_all` into the same layout
(GPU/TPU; XLA:CPU lacks it); "auto" picks ragged unless the mesh is on CPU.
"""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp
from jax.sharding import Mesh, PartitionSpec

from glm5_jax.model.blocked_experts import experts_blocked
from glm5_jax.model.experts import grouped_swiglu
from glm5_jax.config.mesh import BATCH_AXES
from glm5_jax.distributed.mesh import mesh_axis_size
from glm5_jax.distributed.logical_axes import logical_to_spec

EP_TRANSPORTS = ("auto", "padded", "ragged")
EXPERT_AXIS = "expert"
TENSOR_AXIS = "tensor"


class ExpertParallelError(ValueError):
    """The MoE inputs, the capacity settings or the mesh cannot be used for expert parallelism."""


@dataclasses.dataclass(frozen=True)
class DispatchLayout:
    """Static sizes of one device's dispatch buffers."""

    local_tokens: int        # t
    top_k: int               # A
    n_experts: int           # E
    expert_shards: int       # ep
    expert_capacity: int     # assignments one expert keeps from one source device
    pair_capacity: int       # C: rows one device sends to one expert rank

    @property
    def local_experts(self) -> int:
        return self.n_experts // self.expert_shards


def capacity_settings(config) -> tuple[float, str]:
    """(moe_capacity_factor, ep_transport) of the model config, validated (configs built with
    `dataclasses.replace` skip ModelConfig.validate)."""
    factor, transport = config.moe_capacity_factor, config.ep_transport
    if isinstance(factor, bool) or not isinstance(factor, (int, float)) or not factor >= 0 or math.isinf(factor):
        raise ExpertParallelError(f"moe_capacity_factor={factor!r} is invalid: must be a finite number >= 0 "
                                  "(0 = dropless)")
    if transport not in EP_TRANSPORTS:
        raise ExpertParallelError(f"ep_transport={transport!r} is invalid: must be one of {EP_TRANSPORTS}")
    return float(factor), transport


def dispatch_layout(local_tokens: int, top_k: int, n_experts: int, expert_shards: int,
                    capacity_factor: float) -> DispatchLayout:
    if capacity_factor > 0:
        capacity = min(local_tokens, math.ceil(capacity_factor * local_tokens * top_k / n_experts))
    else:
        capacity = local_tokens  # an expert appears at most once among a token's choices
    pair = min(local_tokens * top_k, (n_experts // expert_shards) * capacity)
    return DispatchLayout(local_tokens, top_k, n_experts, expert_shards, capacity, pair)


def _token_axes(mesh: Mesh) -> tuple[str, ...]:
    return tuple(axis for axis in BATCH_AXES if axis in mesh.axis_names)


def _resolve_transport(transport: str, mesh: Mesh) -> str:
    if transport != "auto":
        return transport
    platforms = {device.platform for device in mesh.devices.flat}
    return "padded" if "cpu" in platforms else "ragged"


def _validate(experts: dict, x: jax.Array, expert_ids: jax.Array, weights: jax.Array, shards: int,
              expert_shards: int) -> None:
    if sorted(experts) != ["down_proj", "gate_proj", "up_proj"]:
        raise ExpertParallelError(f"experts must hold gate_proj, up_proj and down_proj, got keys {sorted(experts)}")
    if x.ndim != 2:
        raise ExpertParallelError(f"x must be [tokens, hidden], got shape {tuple(x.shape)}")
    n_tokens = x.shape[0]
    if expert_ids.ndim != 2 or expert_ids.shape[0] != n_tokens:
        raise ExpertParallelError(f"expert_ids must be [tokens={n_tokens}, experts per token], got shape "
                                  f"{tuple(expert_ids.shape)}")
    if tuple(weights.shape) != tuple(expert_ids.shape):
        raise ExpertParallelError(f"weights has shape {tuple(weights.shape)}, expected expert_ids' shape "
                                  f"{tuple(expert_ids.shape)}")
    n_experts = experts["gate_proj"].shape[0]
    if n_experts % expert_shards:
        raise ExpertParallelError(f"n_routed_experts={n_experts} is not divisible by mesh.expert={expert_shards}: "
                                  "every expert rank must own the same number of experts")
    if n_tokens % shards:
        raise ExpertParallelError(f"batch * seq = {n_tokens} tokens cannot be split over the token axes "
                                  f"(data * fsdp * expert = {shards} devices): make batch * seq divisible by it")


def _assignments(expert_ids: jax.Array, layout: DispatchLayout):
    """Per assignment (token-major order): kept?, its row in the send buffer; and the kept counts [ep, E_local]."""
    flat = expert_ids.reshape(-1)
    n = flat.shape[0]
    order = jnp.argsort(flat, stable=True)
    counts = jnp.bincount(flat, length=layout.n_experts).astype(jnp.int32)
    starts = jnp.cumsum(counts) - counts
    rank_sorted = jnp.arange(n, dtype=jnp.int32) - starts[flat[order]]
    rank = jnp.zeros((n,), jnp.int32).at[order].set(rank_sorted, unique_indices=True)  # rank within its expert
    keep = rank < layout.expert_capacity
    kept_counts = jnp.minimum(counts, layout.expert_capacity)
    kept_before = jnp.cumsum(kept_counts) - kept_counts  # kept assignments of lower-numbered experts
    dest = flat // layout.local_experts
    dest_start = kept_before.reshape(layout.expert_shards, layout.local_experts)[:, 0]
    slot = kept_before[flat] - dest_start[dest] + rank
    out_of_range = layout.expert_shards * layout.pair_capacity
    row = jnp.where(keep, dest * layout.pair_capacity + slot, out_of_range)
    return keep, row, kept_counts.reshape(layout.expert_shards, layout.local_experts)


def _receiver_expert_of_rows(recv_counts: jax.Array, layout: DispatchLayout) -> jax.Array:
    """Local expert of every received row ([ep * C]); E_local marks empty padding rows."""
    ends = jnp.cumsum(recv_counts, axis=1)  # [ep, E_local], chunks arrive sorted by expert
    position = jnp.arange(layout.pair_capacity, dtype=jnp.int32)
    expert = jax.vmap(lambda chunk_ends: jnp.searchsorted(chunk_ends, position, side="right"))(ends)  # [ep, C]
    return expert.reshape(-1).astype(jnp.int32)


def _run_local_experts(experts: dict, recv: jax.Array, recv_counts: jax.Array, layout: DispatchLayout,
                       blocked: bool) -> jax.Array:
    """Grouped SwiGLU of the received rows, returned in the receive-buffer layout (padding rows zero).
    `blocked` (CPU, whose `ragged_dot` multiplies every row by every local expert) runs the expert-blocked
    matmuls of `glm5_jax.model.blocked_experts` instead, padding rows given weight 0."""
    expert = _receiver_expert_of_rows(recv_counts, layout)
    filled = expert < layout.local_experts
    if blocked:
        ids = jnp.where(filled, expert, 0)[:, None]
        return experts_blocked(experts, recv, ids, filled[:, None].astype(jnp.float32))
    order = jnp.argsort(expert, stable=True)
    out_sorted = grouped_swiglu(experts, recv[order], recv_counts.sum(0).astype(jnp.int32))
    # Multiplying by a [rows, 1] mask keeps only that column for the backward (a `where` would keep [rows, D]).
    mask = filled[order][:, None].astype(out_sorted.dtype)
    return jnp.zeros_like(recv).at[order].set(out_sorted * mask, unique_indices=True)


def _dispatch_compute_combine(experts: dict, x: jax.Array, expert_ids: jax.Array, weights: jax.Array,
                              layout: DispatchLayout, exchange, blocked: bool) -> tuple[jax.Array, jax.Array]:
    """One device's share: (routed output [t, D], assignments dropped here)."""
    t, top_k = expert_ids.shape
    keep, row, send_counts = _assignments(expert_ids, layout)
    rows = layout.expert_shards * layout.pair_capacity
    token_of = jnp.arange(t * top_k) // top_k
    send = jnp.zeros((rows, x.shape[1]), x.dtype).at[row].add(x[token_of], mode="drop")
    recv, recv_counts, send_back = exchange(send, send_counts)
    back = send_back(_run_local_experts(experts, recv, recv_counts, layout, blocked))
    gathered = back[jnp.minimum(row, rows - 1)]
    scale = jnp.where(keep, weights.reshape(-1), 0.0).astype(x.dtype)[:, None]
    routed = (gathered * scale).reshape(t, top_k, -1).sum(1)
    dropped = (t * top_k - send_counts.sum()).astype(jnp.int32)
    return routed, dropped


def _local_exchange(send, send_counts):
    return send, send_counts, lambda out: out


def dispatch_without_exchange(experts: dict, x: jax.Array, expert_ids: jax.Array, weights: jax.Array,
                              layout: DispatchLayout, platform: str | None = None) -> tuple[jax.Array, jax.Array]:
    """One device's buffers and computation with the all-to-all replaced by the identity: the single-device
    path when `layout.expert_shards` is 1, and, for more shards, a shape-exact stand-in the planner traces."""
    blocked = (platform or jax.default_backend()) == "cpu"
    return _dispatch_compute_combine(experts, x, expert_ids, weights, layout, _local_exchange, blocked)


def _collective_exchange(layout: DispatchLayout, transport: str):
    """All-to-all over the expert axis: returns (recv buffer, recv counts [ep, E_local], the way back)."""
    c = layout.pair_capacity

    def exchange(send, send_counts):
        recv_counts = jax.lax.all_to_all(send_counts, EXPERT_AXIS, 0, 0, tiled=True)
        if transport == "padded":
            recv = jax.lax.all_to_all(send, EXPERT_AXIS, 0, 0, tiled=True)
            return recv, recv_counts, lambda out: jax.lax.all_to_all(out, EXPERT_AXIS, 0, 0, tiled=True)
        # Ragged: chunk j of my send buffer lands at rows [me * C, me * C + n) of rank j's buffer, the same
        # layout the padded exchange produces, but only the n filled rows travel.
        chunk_starts = jnp.arange(layout.expert_shards, dtype=jnp.int32) * c
        my_slot = jnp.full((layout.expert_shards,), jax.lax.axis_index(EXPERT_AXIS) * c, jnp.int32)
        sent, received = send_counts.sum(1).astype(jnp.int32), recv_counts.sum(1).astype(jnp.int32)
        recv = jax.lax.ragged_all_to_all(send, jnp.zeros_like(send), chunk_starts, sent, my_slot, received,
                                         axis_name=EXPERT_AXIS)

        def send_back(out):
            return jax.lax.ragged_all_to_all(out, jnp.zeros_like(out), chunk_starts, received, my_slot, sent,
                                             axis_name=EXPERT_AXIS)
        return recv, recv_counts, send_back

    return exchange


def experts_ep(experts: dict, x: jax.Array, expert_ids: jax.Array, weights: jax.Array, config,
               mesh: Mesh | None) -> tuple[jax.Array, dict]:
    """Routed-expert output [T, D] of x [T, D] for choices expert_ids [T, A] with fp32 weights [T, A].

    Returns (output, {"dropped_assignments": int32 global count}). With `mesh` None everything runs on one
    device (same capacity rule, no collectives)."""
    capacity_factor, transport = capacity_settings(config)
    n_experts = experts["gate_proj"].shape[0]
    if mesh is None:
        _validate(experts, x, expert_ids, weights, 1, 1)
        layout = dispatch_layout(x.shape[0], expert_ids.shape[1], n_experts, 1, capacity_factor)
        routed, dropped = dispatch_without_exchange(experts, x, expert_ids, weights, layout)
        return routed, {"dropped_assignments": dropped}

    if EXPERT_AXIS not in mesh.axis_names:
        raise ExpertParallelError(f"mesh axes {mesh.axis_names} lack {EXPERT_AXIS!r}: build the mesh with "
                                  "glm5_jax.distributed.mesh.make_mesh")
    token_axes = _token_axes(mesh)
    shards = math.prod(mesh_axis_size(mesh, axis) for axis in token_axes)
    expert_shards = mesh_axis_size(mesh, EXPERT_AXIS)
    _validate(experts, x, expert_ids, weights, shards, expert_shards)
    layout = dispatch_layout(x.shape[0] // shards, expert_ids.shape[1], n_experts, expert_shards, capacity_factor)
    exchange = _collective_exchange(layout, _resolve_transport(transport, mesh))
    blocked = {device.platform for device in mesh.devices.flat} == {"cpu"}
    # F split over `tensor` when it divides; the partial outputs are then summed over `tensor`.
    up_spec = logical_to_spec(("experts", None, "expert_mlp"), experts["gate_proj"].shape, mesh)
    down_spec = logical_to_spec(("experts", "expert_mlp", None), experts["down_proj"].shape, mesh)
    tensor_split = up_spec[2] is not None
    token_spec = PartitionSpec(token_axes)

    def local(experts_local, x_local, ids_local, weights_local):
        routed, dropped = _dispatch_compute_combine(experts_local, x_local, ids_local, weights_local, layout,
                                                    exchange, blocked)
        if tensor_split:
            routed = jax.lax.psum(routed, TENSOR_AXIS)
        return routed, jax.lax.psum(dropped, token_axes)

    expert_specs = {"gate_proj": up_spec, "up_proj": up_spec, "down_proj": down_spec}
    # check_vma off: the CPU blocked experts' loop carries start as unsharded zeros (jax would ask for pcasts);
    # the collectives here are explicit, and the multi-device tests check values and gradients.
    routed, dropped = jax.shard_map(
        local, mesh=mesh, in_specs=(expert_specs, token_spec, token_spec, token_spec),
        out_specs=(token_spec, PartitionSpec()), check_vma=False)(dict(experts), x, expert_ids, weights)
    return routed, {"dropped_assignments": dropped}
