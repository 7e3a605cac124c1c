"""Expert parallelism (MoE backend `ep`): tokens travel to the devices that own their experts by all-to-all,
run there as grouped matmuls, and travel back to be combined; expert weights never move.

Inside `jax.shard_map` tokens are split over the token axes (`data`, `fsdp`, `expert`, then `context`: each
chip's share of each sequence) and the routed experts over `expert` and `context` (E / ep experts per device,
ep = expert x context when that divides E; their model dim over `fsdp` when it is above 1, their hidden width F
over `tensor`, the partial outputs then summed over `tensor`). The exchange runs among the `ep` devices that
share one copy of the experts. Every device:

1. sorts its t * A assignments (t local tokens, A experts per token) by expert: chunk j of that buffer holds the
   rows for expert-rank j's experts, in expert order, then token order;
2. learns every device's chunk sizes (an all-gather of ep counts), and from them where each chunk lands in its
   receiver's buffer of R rows: sources in rank order, each chunk after the previous one's;
3. sends its chunks (`jax.lax.ragged_all_to_all`, only the rows that fit travel) with each row's routing weight,
   runs its local experts on the received rows, each scaled by its weight before the down projection, and sends
   the results back the same way; the tokens sum what comes back. So no gradient needs the experts' outputs, and
   under remat the backward recomputes neither the down projection nor the exchange back.

With one expert per device, rows past the received ones are never read: on TPU the receive buffers (and the
backward's, for the cotangents going back to the experts) are not zero-filled first (`ops.buffers.fill_buffer`).

Capacity. A receiver holds R rows. `moe_capacity_factor` 0 (the default) is dropless: R is the most one device
can receive (every source sending it all it could), which only small meshes afford. With a factor cf > 0,
R = ceil(cf * t * A), cf times an even load: a device's rows overflow only when its experts draw more than cf
times their share of the whole expert group's tokens, which the aux-loss-free bias keeps rare. Rows past R are
dropped deterministically (the highest source ranks first, and within a source's chunk its last rows), contribute
nothing (the token keeps its other experts and the shared expert) and are counted in aux["dropped_assignments"]
(summed over all devices).

Rows in blocks (`ep_row_block`, G). On TPU an array's rows are stored in tiles of 8 x 128 words (16 rows of bf16),
so a collective that cuts a [rows, D] buffer at any row first copies it into a layout with one row per tile row
and back (libtpu's [rows, 2, D / 2] relayouts: 0.42 of the v6e-256 step's 3.64 TB of HBM traffic). With G > 1 the
dispatch moves [rows / G, G, D] blocks, whose rows-major slices are whole tiles: each chunk is padded to whole
blocks (at most G - 1 rows per chunk, holding a copy of some token's row: they are computed like any row, come
back to rows nothing reads and get no gradient), the offsets and sizes count blocks, and the receive buffer
grows by the expected padding, ep * (G - 1) / 2 rows, so the capacity for real rows stays what the factor says.
G 0 picks the tile's height on TPU and 1 elsewhere. On TPU the receive buffer is then rounded up to rows the
grouped matmuls take whole (`glm5_jax.ops.grouped_matmul.swiglu_rows`): the kernels would otherwise pad it to
their row tiles by a copy per matmul.

Transport (`ep_transport`): "ragged" is `jax.lax.ragged_all_to_all` (GPU/TPU; XLA:CPU lacks it); "padded" is the
same exchange built from `jax.lax.all_to_all` of chunks padded to the largest possible chunk (runs anywhere: the
CPU tests), and "auto" picks ragged unless the mesh is on CPU. Both use the same offsets, so both give the same
result.
"""

from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
from jax.sharding import Mesh, PartitionSpec

from glm5_jax.model.blocked_experts import experts_blocked
from glm5_jax.model.experts import grouped_swiglu
from glm5_jax.model.token_permutation import inverse_permutation, permute_rows, repeat_rows
from glm5_jax.distributed.batch_local import flattens_outside, spec_axes, token_split_spec
from glm5_jax.distributed.mesh import mesh_axis_size
from glm5_jax.distributed.logical_axes import expert_split_axes, logical_to_spec
from glm5_jax.ops.buffers import fill_buffer
from glm5_jax.ops.grouped_matmul import swiglu_rows
from glm5_jax.ops.platform import compiled_platform

EP_TRANSPORTS = ("auto", "padded", "ragged")
EXPERT_AXIS = "expert"
TENSOR_AXIS = "tensor"


class ExpertParallelError(ValueError):
    """The MoE inputs, the capacity settings or the mesh cannot be used for expert parallelism."""


@dataclasses.dataclass(frozen=True)
class DispatchLayout:
    """Static sizes of one device's dispatch buffers."""

    local_tokens: int   # t
    top_k: int          # A
    n_experts: int      # E
    expert_shards: int  # ep
    receive_rows: int   # R: rows one device's experts receive (a multiple of row_block)
    row_block: int = 1  # G: rows move in blocks of G (module docstring)
    kernel_vmem: int | None = None  # bytes of scoped VMEM the one-expert kernels ask for (model.moe_kernel_vmem_mib)

    @property
    def expected_rows(self) -> int:
        """Rows one device's experts receive on average: the ep devices sharing the experts send each other
        ep * t * A rows in all, t * A per device, plus the blocks' expected padding (at most R). The grouped
        matmuls declare the work of these rows' tiles (`ops.grouped_matmul`): the rest of R is headroom one device
        uses only when another receives less."""
        return min(self.receive_rows, math.ceil(self.assignments + self.expert_shards * (self.row_block - 1) / 2))

    @property
    def receive_blocks(self) -> int:
        return self.receive_rows // self.row_block

    @property
    def send_blocks(self) -> int:
        """Blocks of one device's send buffer: its t * A rows with each of the ep chunks padded to whole blocks."""
        return min((self.assignments + self.expert_shards * (self.row_block - 1)) // self.row_block,
                   self.expert_shards * self.largest_chunk_blocks)

    @property
    def largest_chunk_blocks(self) -> int:
        return -(-self.largest_chunk // self.row_block)

    @property
    def local_experts(self) -> int:
        return self.n_experts // self.expert_shards

    @property
    def assignments(self) -> int:
        return self.local_tokens * self.top_k

    @property
    def largest_chunk(self) -> int:
        """The most rows one source can send one expert rank: all its assignments, at most t per expert."""
        return min(self.assignments, self.local_experts * self.local_tokens)


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
                    capacity_factor: float, row_block: int = 1) -> DispatchLayout:
    largest = min(local_tokens * top_k, (n_experts // expert_shards) * local_tokens)
    most = expert_shards * -(-largest // row_block) * row_block  # every source's largest chunk, padded
    if capacity_factor == 0:
        return DispatchLayout(local_tokens, top_k, n_experts, expert_shards, most, row_block)
    # Blocks pad each chunk by (G - 1) / 2 rows on average: added, so real rows keep the factor's capacity.
    rows = math.ceil(capacity_factor * local_tokens * top_k + expert_shards * (row_block - 1) / 2)
    return DispatchLayout(local_tokens, top_k, n_experts, expert_shards,
                          min(most, -(-rows // row_block) * row_block), row_block)


def row_block(setting: int, platform: str, dtype) -> int:
    """`ep_row_block` resolved: 0 -> the height of a TPU tile of `dtype` (8 rows of 32-bit words, packed: 16 rows
    of bf16), 1 on other platforms, whose layouts are not tiled."""
    if setting:
        return setting
    return 8 * max(1, 4 // jnp.dtype(dtype).itemsize) if platform == "tpu" else 1


def _resolve_transport(transport: str, mesh: Mesh) -> str:
    if transport != "auto":
        return transport
    platforms = {device.platform for device in mesh.devices.flat}
    return "padded" if "cpu" in platforms else "ragged"


def _validate(experts: dict, x: jax.Array, expert_ids: jax.Array, weights: jax.Array, shards: int,
              expert_shards: int) -> None:
    if sorted(experts) != ["down_proj", "gate_proj", "up_proj"]:
        raise ExpertParallelError(f"experts must hold gate_proj, up_proj and down_proj, got keys {sorted(experts)}")
    if x.ndim not in (2, 3):
        raise ExpertParallelError(f"x must be [tokens, hidden] or [batch, seq, hidden], got shape {tuple(x.shape)}")
    lead = tuple(x.shape[:-1])
    n_tokens = math.prod(lead)
    if expert_ids.ndim != x.ndim or tuple(expert_ids.shape[:-1]) != lead:
        raise ExpertParallelError(f"expert_ids must be [{', '.join(map(str, lead))}, experts per token], got shape "
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
                                  f"({shards} devices of data, fsdp, expert, context): make batch * seq "
                                  "divisible by it")


def receive_plan(sent: jax.Array, rows: int) -> tuple[jax.Array, jax.Array]:
    """sent [source, receiver]: rows each source has for each receiver -> (accepted, offsets), both [source,
    receiver]: how many of them fit in the receiver's `rows` (sources in rank order) and where they start."""
    before = jnp.cumsum(sent, axis=0) - sent
    return jnp.clip(rows - before, 0, sent), jnp.minimum(before, rows)


def _row_experts(recv_counts: jax.Array, accepted: jax.Array, layout: DispatchLayout) -> jax.Array:
    """Local expert of every received row ([R]); E_local marks empty rows. recv_counts [source, E_local] are the
    rows each source has for each of my experts (its chunk, in expert order), accepted [source] how many blocks of
    its chunk fit; the chunks lie source by source, each its accepted prefix in expert order, then the rows that
    pad it to whole blocks (empty)."""
    local, g = layout.local_experts, layout.row_block
    kept = jnp.clip(g * accepted[:, None] - (jnp.cumsum(recv_counts, axis=1) - recv_counts), 0, recv_counts)
    padding = g * accepted - kept.sum(1)
    segments = jnp.concatenate([kept, padding[:, None]], axis=1).reshape(-1)  # [source * (E_local + 1)]
    segment = jnp.searchsorted(jnp.cumsum(segments), jnp.arange(layout.receive_rows), side="right")
    return jnp.where(segment < segments.size, segment % (local + 1), local).astype(jnp.int32)


def _run_local_experts(experts: dict, recv: jax.Array, recv_weights: jax.Array, expert: jax.Array,
                       layout: DispatchLayout, platform: str) -> jax.Array:
    """Grouped SwiGLU of the received rows, each scaled by its routing weight (`recv_weights` fp32 [R]), returned
    in the receive-buffer layout (empty rows zero). On CPU, whose `ragged_dot` multiplies every row by every local
    expert, the expert-blocked matmuls of `glm5_jax.model.blocked_experts` run instead, empty rows given weight 0."""
    filled = expert < layout.local_experts
    if platform == "cpu":
        ids = jnp.where(filled, expert, 0)[:, None]
        return experts_blocked(experts, recv, ids, jnp.where(filled, recv_weights, 0.0)[:, None])
    if layout.local_experts == 1:
        # One expert per device (the pod recipes): the received rows are already in expert order, filled rows
        # first (`_row_experts`), so sorting would be the identity; skipping it saves a gather and a scatter of
        # the [R, D] buffer in the forward, its recompute and the backward. The rows up to the last filled one
        # form the expert's group: the blocks' padding among them is computed too, goes back to rows nothing
        # reads and gets zero gradient. The rows past it are never sent back, nor their input gradients (the
        # exchange moves only received rows), so the kernels may leave them undefined: no mask pass over
        # [R, D] in the forward, its recompute or the backward either.
        last = jnp.max(jnp.where(filled, jnp.arange(expert.shape[0], dtype=jnp.int32) + 1, 0))
        return grouped_swiglu(experts, recv, last[None].astype(jnp.int32), platform, zero_outside=False,
                              vmem_limit=layout.kernel_vmem, row_weights=recv_weights,
                              expected_rows=layout.expected_rows)
    group_sizes = jnp.bincount(expert, length=layout.local_experts).astype(jnp.int32)
    order = jnp.argsort(expert, stable=True)
    inverse = inverse_permutation(order)
    out_sorted = grouped_swiglu(experts, permute_rows(recv, order, inverse), group_sizes, platform,
                                row_weights=permute_rows(recv_weights, order, inverse),
                                expected_rows=layout.expected_rows)
    # Multiplying by a [rows, 1] mask keeps only that column for the backward (a `where` would keep [rows, D]).
    mask = filled[order][:, None].astype(out_sorted.dtype)
    return permute_rows(out_sorted * mask, inverse, order)


def padded_ragged_all_to_all(operand, output, input_offsets, send_sizes, output_offsets, recv_sizes, *,
                             axis_name: str, largest_chunk: int):
    """`jax.lax.ragged_all_to_all`'s semantics (chunk j of `operand`, [input_offsets[j], + send_sizes[j]), lands
    in peer j's `output` at output_offsets[j]) from `jax.lax.all_to_all` of chunks padded to `largest_chunk`
    rows: for XLA:CPU, which has no ragged collective."""
    position = jnp.arange(largest_chunk)
    rows = operand.shape[0]
    source = jnp.clip(input_offsets[:, None] + position[None, :], 0, rows - 1)  # [peers, chunk]
    row = (slice(None), slice(None)) + (None,) * (operand.ndim - 1)  # [peers, chunk] -> against a row's dims
    chunks = jnp.where((position[None, :] < send_sizes[:, None])[row], operand[source], 0)
    received = jax.lax.all_to_all(chunks, axis_name, 0, 0, tiled=True)  # [peers, chunk, ...], by source
    where = jax.lax.all_to_all(output_offsets, axis_name, 0, 0, tiled=True)  # my output offset in each source
    target = jnp.where(position[None, :] < recv_sizes[:, None], where[:, None] + position[None, :], output.shape[0])
    return output.at[target.reshape(-1)].set(received.reshape(-1, *operand.shape[1:]), mode="drop")


def _exchange(transport: str, layout: DispatchLayout, axes: tuple[str, ...]):
    """The collective that moves chunks over the expert axes (None: one device, nothing to move)."""
    if layout.expert_shards == 1:
        return None
    if transport == "ragged":
        return functools.partial(jax.lax.ragged_all_to_all, axis_name=axes)
    return functools.partial(padded_ragged_all_to_all, axis_name=axes, largest_chunk=layout.largest_chunk_blocks)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1))
def _exchange_back(exchange, buffer, out, send, back_offsets, dispatch_offsets):
    """`exchange(out, send, *back_offsets)`: the experts' rows back into the send buffer (a constant to the
    backward: its rows are dead once sent). The transpose is the dispatch's own exchange (`dispatch_offsets`)
    of the cotangent into `buffer(after)` (`fill_buffer`: on TPU not zero-filled, where only received rows are read),
    which is what jax's transpose of the collective computes, without its zero fill."""
    return exchange(out, send, *back_offsets)


def _exchange_back_fwd(exchange, buffer, out, send, back_offsets, dispatch_offsets):
    return exchange(out, send, *back_offsets), dispatch_offsets


def _exchange_back_bwd(exchange, buffer, dispatch_offsets, d_back):
    # Made after the offsets, not the sizes the dispatch's own buffer waits for: XLA merges two Mosaic calls with
    # the same operand into one buffer, then copies it for the second collective.
    return exchange(d_back, buffer(dispatch_offsets[2]), *dispatch_offsets), None, None, None


_exchange_back.defvjp(_exchange_back_fwd, _exchange_back_bwd)


def _dispatch_compute_combine(experts: dict, x: jax.Array, expert_ids: jax.Array, weights: jax.Array,
                              layout: DispatchLayout, exchange, platform: str,
                              axes: tuple[str, ...] = ()) -> tuple[jax.Array, jax.Array]:
    """One device's share: (routed output [t, D], assignments dropped here). `exchange` None: one device;
    else it moves chunks among the devices of `axes`, whose linear index is the expert rank."""
    t, top_k = expert_ids.shape
    ep, local, g = layout.expert_shards, layout.local_experts, layout.row_block
    flat = expert_ids.reshape(-1)
    order = jnp.argsort(flat, stable=True)  # sorted row -> assignment
    inverse = inverse_permutation(order)  # assignment -> sorted row
    counts = jnp.bincount(flat, length=layout.n_experts).astype(jnp.int32).reshape(ep, local)
    sent = counts.sum(1)  # [ep] my rows for each expert rank
    starts = jnp.cumsum(sent) - sent  # where each chunk starts among my sorted rows
    chunk = flat[order] // local  # each sorted row's expert rank
    rank = jnp.arange(layout.assignments) - starts[chunk]  # its place in its chunk
    blocks = -(-sent // g)  # [ep] each chunk padded to whole blocks
    block_starts = jnp.cumsum(blocks) - blocks
    fill, slot = order, inverse  # send-buffer row -> assignment, and back
    if g > 1:
        sorted_slot = g * block_starts[chunk] + rank
        slot = sorted_slot[inverse]
        fill = jnp.full((layout.send_blocks * g,), -1, jnp.int32).at[sorted_slot].set(order, unique_indices=True)
    send = repeat_rows(x, fill, slot)
    # Each row's routing weight travels with it and scales it at its expert (`grouped_swiglu`): the tokens then
    # only sum what comes back, so no gradient reads the experts' outputs and, under remat, the backward
    # recomputes neither the down projection nor the exchange back (rows no assignment fills weigh 0).
    send_weights = jnp.where(fill >= 0, permute_rows(weights.reshape(-1), fill, slot), 0.0)
    if exchange is None:
        accepted, _ = receive_plan(sent[None, :], layout.receive_rows)
        receive = lambda rows: jnp.zeros((layout.receive_rows, *rows.shape[1:]), rows.dtype).at[  # noqa: E731
            :layout.assignments].set(rows[:layout.receive_rows])
        out = _run_local_experts(experts, receive(send), receive(send_weights),
                                 _row_experts(counts, accepted[:, 0], layout), layout, platform)
        back = jnp.zeros_like(send).at[:layout.receive_rows].set(out[:layout.assignments])
        mine = accepted[0]
    else:
        # Blocks of G rows travel as [blocks, G, D]: its slices along blocks are whole TPU tiles (module docstring).
        as_blocks = (lambda rows: rows) if g == 1 else (lambda rows: rows.reshape(-1, g, *rows.shape[1:]))
        as_rows = (lambda rows: rows) if g == 1 else (lambda blocked: blocked.reshape(-1, *blocked.shape[2:]))
        me = jax.lax.axis_index(axes)
        everyone = jax.lax.all_gather(blocks, axes)  # [source, receiver]
        accepted, offsets = receive_plan(everyone, layout.receive_blocks)
        mine = accepted[me]
        # With one expert per device no row past the received ones is read (`_run_local_experts`): on TPU the
        # receive buffers are then not zero-filled first.
        buffer = fill_buffer if local == 1 else lambda shape, dtype, *_: jnp.zeros(shape, dtype)  # noqa: E731
        receive_buffer = lambda shape, dtype: lambda after: buffer(  # noqa: E731  shape: a block's
            (layout.receive_blocks, *shape), dtype, after, platform)
        dispatch_offsets = (block_starts, mine, offsets[me], accepted[:, me])
        receive = lambda rows: as_rows(exchange(  # noqa: E731
            as_blocks(rows), receive_buffer(as_blocks(rows).shape[1:], rows.dtype)(mine), *dispatch_offsets))
        recv_counts = jax.lax.all_to_all(counts, axes, 0, 0, tiled=True)  # [source, E_local]
        out = _run_local_experts(experts, receive(send), receive(send_weights),
                                 _row_experts(recv_counts, accepted[:, me], layout), layout, platform)
        source_starts = (jnp.cumsum(everyone, axis=1) - everyone)[:, me]  # my chunk's start at each source
        # The rows come back into the send buffer itself, dead once sent (XLA updates it in place instead of
        # filling a zero buffer): rows nothing returns (assignments dropped here, padding) keep a token's row,
        # which the kept mask zeroes below. A constant to the backward (its cotangent is never needed).
        blocked_out = as_blocks(out)
        back = as_rows(_exchange_back(exchange, receive_buffer(blocked_out.shape[1:], out.dtype), blocked_out,
                                      as_blocks(jax.lax.stop_gradient(send)),
                                      (offsets[:, me], accepted[:, me], source_starts, mine), dispatch_offsets))
    kept_rows = jnp.minimum(sent, g * mine)  # [ep] of each chunk, its rows that fit
    kept = (rank < kept_rows[chunk])[inverse]
    # Assignment order, already weighted. Rows no assignment fills get some assignment's (finite) gradient: they
    # weigh 0 at their expert, so it reaches nothing (no select pass over the buffer in the backward).
    combined = permute_rows(back, slot, fill, zero_unread=False)
    # A [rows, 1] factor (a `where` would keep a [rows, D] mask for the backward).
    routed = (combined * kept.astype(x.dtype)[:, None]).reshape(t, top_k, -1).sum(1)
    dropped = (layout.assignments - kept_rows.sum()).astype(jnp.int32)
    return routed, dropped


def mesh_layout(config, mesh: Mesh, up_shape: tuple[int, ...], local_tokens: int, top_k: int,
                dtype) -> DispatchLayout:
    """The dispatch buffers of each device on `mesh` for `local_tokens` tokens: rows in blocks of `ep_row_block`
    (resolved for the mesh's chips and `dtype`), and on TPU a receive buffer of the grouped matmuls' whole row
    tiles, whose rows they would otherwise pad it to by a copy per matmul. `up_shape`: gate_proj's [E, D, F]."""
    capacity_factor, _ = capacity_settings(config)
    expert_shards = math.prod(mesh_axis_size(mesh, axis) for axis in expert_split_axes(up_shape[0], mesh))
    platform = mesh.devices.flat[0].platform
    block = row_block(config.ep_row_block, platform, dtype) if expert_shards > 1 else 1
    layout = dispatch_layout(local_tokens, top_k, up_shape[0], expert_shards, capacity_factor, block)
    if platform != "tpu":
        return layout
    up_spec = logical_to_spec(("experts", None, "expert_mlp"), up_shape, mesh)
    d, f = (size // math.prod(mesh_axis_size(mesh, axis) for axis in spec_axes(PartitionSpec(entry)))
            for size, entry in zip(up_shape[1:], up_spec[1:]))
    one_expert_each = config.moe_kernel_vmem_mib and layout.local_experts == 1
    kernel_vmem = config.moe_kernel_vmem_mib * 2**20 if one_expert_each else None
    rows = swiglu_rows(layout.receive_rows, d, f, layout.local_experts, dtype, platform,
                       mesh.devices.flat[0].device_kind, kernel_vmem)
    return dataclasses.replace(layout, receive_rows=-(-rows // block) * block, kernel_vmem=kernel_vmem)


def dispatch_without_exchange(experts: dict, x: jax.Array, expert_ids: jax.Array, weights: jax.Array,
                              layout: DispatchLayout, platform: str | None = None) -> tuple[jax.Array, jax.Array]:
    """One device's buffers and computation with no collective: the single-device path, and the shape stand-in
    the planner traces (the buffers of `layout` are kept whatever its number of shards)."""
    single = dataclasses.replace(layout, n_experts=layout.local_experts, expert_shards=1, row_block=1)
    return _dispatch_compute_combine(experts, x, expert_ids % single.n_experts, weights, single, None,
                                     compiled_platform(platform))


def experts_ep(experts: dict, x: jax.Array, expert_ids: jax.Array, weights: jax.Array, config,
               mesh: Mesh | None) -> tuple[jax.Array, dict]:
    """Routed-expert output [..., D] of x [T, D] or [B, S, D] for choices expert_ids [..., A] with fp32 weights
    [..., A]. Tokens [B, S] are split like the activations (batch axes on B, `context` on S), [T] over the
    token axes; each device flattens its own block.

    Returns (output, {"dropped_assignments": int32 global count}). With `mesh` None everything runs on one
    device (same capacity rule, no collectives)."""
    capacity_factor, transport = capacity_settings(config)
    n_experts = experts["gate_proj"].shape[0]
    top_k = expert_ids.shape[-1]
    if mesh is not None and flattens_outside(mesh, tuple(x.shape[:-1])):
        routed, aux = experts_ep(experts, x.reshape(-1, x.shape[-1]), expert_ids.reshape(-1, top_k),
                                 weights.reshape(-1, top_k), config, mesh)
        return routed.reshape(x.shape), aux
    if mesh is None:
        _validate(experts, x, expert_ids, weights, 1, 1)
        layout = dispatch_layout(math.prod(x.shape[:-1]), top_k, n_experts, 1, capacity_factor)
        routed, dropped = dispatch_without_exchange(experts, x.reshape(-1, x.shape[-1]),
                                                    expert_ids.reshape(-1, top_k), weights.reshape(-1, top_k), layout)
        return routed.reshape(x.shape), {"dropped_assignments": dropped}

    if EXPERT_AXIS not in mesh.axis_names:
        raise ExpertParallelError(f"mesh axes {mesh.axis_names} lack {EXPERT_AXIS!r}: build the mesh with "
                                  "glm5_jax.distributed.mesh.make_mesh")
    token_spec = token_split_spec(mesh, tuple(x.shape[:-1])) or PartitionSpec()
    token_axes = spec_axes(token_spec)
    shards = math.prod(mesh_axis_size(mesh, axis) for axis in token_axes)
    _validate(experts, x, expert_ids, weights, shards, mesh_axis_size(mesh, EXPERT_AXIS))
    expert_axes = expert_split_axes(n_experts, mesh)
    platform = mesh.devices.flat[0].platform
    layout = mesh_layout(config, mesh, experts["gate_proj"].shape, math.prod(x.shape[:-1]) // shards, top_k, x.dtype)
    # F split over `tensor` when it divides; the partial outputs are then summed over `tensor`.
    up_spec = logical_to_spec(("experts", None, "expert_mlp"), experts["gate_proj"].shape, mesh)
    down_spec = logical_to_spec(("experts", "expert_mlp", None), experts["down_proj"].shape, mesh)
    tensor_split = up_spec[2] is not None
    exchange = _exchange(_resolve_transport(transport, mesh), layout, expert_axes)

    def local(experts_local, x_local, ids_local, weights_local):
        flat = (x_local.reshape(-1, x_local.shape[-1]), ids_local.reshape(-1, top_k),
                weights_local.reshape(-1, top_k))
        if exchange is None:
            routed, dropped = dispatch_without_exchange(experts_local, *flat, layout, platform)
        else:
            routed, dropped = _dispatch_compute_combine(experts_local, *flat, layout, exchange, platform,
                                                        expert_axes)
        if tensor_split:
            routed = jax.lax.psum(routed, TENSOR_AXIS)
        return routed.reshape(x_local.shape), jax.lax.psum(dropped, token_axes) if token_axes else dropped

    expert_specs = {"gate_proj": up_spec, "up_proj": up_spec, "down_proj": down_spec}
    # check_vma off: the CPU blocked experts' loop carries start as unsharded zeros (jax would ask for pcasts);
    # the collectives here are explicit, and the multi-device tests check values and gradients.
    routed, dropped = jax.shard_map(
        local, mesh=mesh, in_specs=(expert_specs, token_spec, token_spec, token_spec),
        out_specs=(token_spec, PartitionSpec()), check_vma=False)(dict(experts), x, expert_ids, weights)
    return routed, {"dropped_assignments": dropped}
