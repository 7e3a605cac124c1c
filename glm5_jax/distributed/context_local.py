"""Per-query work over a sequence split by the `context` mesh axis (context parallelism).

Outside, activations are global [B, S, ...] arrays that GSPMD splits over the batch axes and `context` (the
"seq" logical axis). DSA's per-query work (the indexer's scores and top-k, the sparse or masked attention, the
KL targets) needs every key a query may see, so it runs under `jax.shard_map`: each chip takes its own batch
rows and its S / context queries, and all-gathers the key-side inputs over `context` (tiled: [B, S, ...] in
global token order). Its queries then score every key by global position; the autodiff transpose of the
all-gather is a reduce-scatter, so key gradients come back summed to the chips that own those tokens.

`fn` receives `q_offset`, the global index of the chip's first query (the masks' causal offset). Without a
context split it is the Python int 0 and the keys are the queries' own tokens: a single-device run is the
context = 1 case of the same code, and on a mesh GSPMD partitions it as before (heads over `tensor` too), or
`batch_local` runs it when it sorts along rows (top-k), which GSPMD cannot partition. Inside the context
split every input is whole over the axes other than the batch axes and `context` (heads are not split over
`tensor` there yet).

Under a split the layers run in the load-balanced order (`context_order.py`): a chip's queries are two chunks,
one early and one late, so `fn` runs once per chunk with that chunk's offset; the gathered keys are put back in
the natural order first, so key indices (top-k selections) are global positions whatever the layout.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec

from glm5_jax.config.mesh import CONTEXT_AXIS
from glm5_jax.distributed.batch_local import active_mesh, batch_local, batch_split_axes, context_split
from glm5_jax.distributed.context_order import balanced_chunks, gathered_to_natural


def require_whole_sequences(mesh, what: str) -> None:
    """Refuse, naming `mesh.context`, an operation that has no context-parallel form yet."""
    split = context_split(mesh)
    if split > 1:
        raise ValueError(f"mesh.context={split} is invalid for {what}: it runs on whole sequences only; use "
                         "model.attention_backend sparse, dense or auto, or mesh.context=1")


def context_local(fn, mesh, queries: tuple, keys: tuple, *, local_rows: bool = False):
    """`fn(q_offset, *queries, *keys)` on each chip's batch rows and share of the queries (one call per chunk of
    the balanced order), with the `keys` arrays all-gathered over `context` in the natural order. Every input is
    [B, S, ...] (S = the global sequence, balanced under a split); every output must be per query, [B, S, ...],
    and comes back split like the queries. `local_rows`: fn must see only its
    device's rows (it sorts along rows, as top-k does, or is a Mosaic kernel GSPMD cannot partition), so
    without a context split it still runs on each device's own rows (`batch_local`)."""
    split = context_split(mesh)
    if split == 1:
        if local_rows:
            return batch_local(lambda *args: fn(0, *args), mesh, queries + keys)
        return fn(0, *queries, *keys)
    shapes = {x.shape[:2] for x in queries + keys}
    if len(shapes) != 1:
        raise ValueError(f"context_local: the inputs disagree on their [batch, seq] dims: {sorted(shapes)}")
    rows, seq = shapes.pop()
    if seq % (2 * split):
        raise ValueError(f"mesh.context={split} needs the sequence length {seq} in 2 x {split} equal chunks")
    chunk_len = seq // (2 * split)
    n_queries = len(queries)

    def per_chip(*args):
        gathered = tuple(gathered_to_natural(jax.lax.all_gather(k, CONTEXT_AXIS, axis=1, tiled=True), split)
                         for k in args[n_queries:])
        outputs = []
        for part, chunk in enumerate(balanced_chunks(jax.lax.axis_index(CONTEXT_AXIS), split)):
            own = tuple(q[:, part * chunk_len:(part + 1) * chunk_len] for q in args[:n_queries])
            outputs.append(fn(chunk * chunk_len, *own, *gathered))
        return jax.tree.map(lambda early, late: jnp.concatenate([early, late], axis=1), *outputs)

    spec = PartitionSpec(batch_split_axes(mesh, rows) or None, CONTEXT_AXIS)
    # check_vma off, as in `batch_local`: the one collective is explicit and every input is split the same way.
    return jax.shard_map(per_chip, mesh=active_mesh(mesh), in_specs=(spec,) * (n_queries + len(keys)),
                         out_specs=spec, check_vma=False)(*queries, *keys)
