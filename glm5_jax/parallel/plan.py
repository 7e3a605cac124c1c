"""`glm5 plan CONFIG mesh.<axis>=N ... [batch= seq= remat= optimizer= device_memory_gib=]`: per-device memory and
per-step communication of a training configuration on a mesh, worked out on paper (no device, no weights).

Memory per device:
- parameters, gradients and optimizer state: every leaf's bytes divided by the shards the rule table gives it
  (the optimizer state is `jax.eval_shape` of the real optax optimizer, so AdamW's two moments and Muon's one
  momentum per matrix are exact);
- saved activations: what reverse-mode AD keeps from the forward for the backward, read off `jax.vjp`'s
  residuals while tracing the real model and loss with abstract per-device shapes (batch split over the
  batch axes, heads / MLP / vocabulary split over `tensor`), so the remat policy and the attention / MoE
  backends are accounted exactly as they are implemented; the expert-parallel dispatch buffers are traced at
  their per-device size;
- backward working set: what one layer's backward holds beyond the saved activations, in units of that
  layer's no-remat activations (1.6 without remat: cotangents and temporaries; 3.0 with remat: the recomputed
  forward too; both measured against XLA's buffer assignment), plus the logits' cotangent and, with FSDP,
  one layer's gathered weights and their unreduced gradients.
The plan assumes the ideal split of every activation (batch over the batch axes, heads and MLP widths over
`tensor`); GSPMD reaches it for data / FSDP / expert parallelism (tests/parallel checks the estimate against
`compile().memory_analysis()` within 15%), while tensor parallelism without activation constraints in the
model keeps some activations whole and needs more than planned.
Communication per device and step (bytes sent, ring algorithms): FSDP all-gathers (forward and backward) and
gradient reduce-scatters, data-parallel gradient all-reduces, expert all-to-alls (dispatch and return, forward,
backward and remat recompute), tensor-parallel all-reduces of each layer's attention / FFN / indexer outputs.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import jax
import jax.numpy as jnp
from jax.extend.core import Literal

from glm5_jax.config import REMAT_POLICIES, ConfigError, ModelConfig, TrainConfig
from glm5_jax.config.core import EXPERT_MATMUL_POLICIES
from glm5_jax.config.experiment import validate_context_split
from glm5_jax.config.mesh import BATCH_AXES, CONTEXT_AXIS, MeshConfig
from glm5_jax.config.optim import MOMENT_DTYPES, OptimConfig
from glm5_jax.model.expert_parallel import (EXPERT_AXIS, capacity_settings, dispatch_layout,
                                               dispatch_without_exchange)
from glm5_jax.distributed.logical_axes import expert_split_axes, logical_to_spec
from glm5_jax.parallel.sharding import abstract_params, param_specs, state_leaf_spec
from glm5_jax.model.context import LayerContext
from glm5_jax.model.layers import rope_angles
from glm5_jax.model.transformer import layer_modules
from glm5_jax.train.objective import LMObjective
from glm5_jax.train.optim import make_optimizer
from glm5_jax.tree_paths import path_names

GIB = 1024**3
OPTIMIZER_NAMES = ("adamw", "muon")
DEFAULT_DEVICE_MEMORY_GIB = 141.0  # H200
# Live memory of one layer's backward beyond what the forward saved, in units of that layer's no-remat
# activations: cotangents and temporaries (no remat), plus the recomputed forward (remat). Fitted to XLA's
# buffer assignment on twelve small configurations (one device and 8-device meshes, none / full / dots
# remat, with and without MTP), which the whole estimate then matched within 13%; the remat factor was
# lowered from 3.0 to 2.5 when the MTP depth steps started following the remat policy (re-checked on the two
# configurations of tests/parallel: ratios 1.085 and 1.047). Accelerator schedulers differ somewhat.
WORKING_SET_LAYERS_NO_REMAT = 1.6
WORKING_SET_LAYERS_REMAT = 2.5


class PlanError(ValueError):
    """A plan setting is invalid or the configuration cannot be laid out on the mesh."""


@dataclasses.dataclass(frozen=True)
class PlanSettings:
    """What to plan for. `batch` is the global microbatch in sequences (default: one per batch shard)."""

    batch: int | None = None
    seq: int = 4096
    remat: str | None = None  # default: the model config's remat_policy
    optimizer: str = "muon"
    mu_dtype: str | None = None  # the optimizer's first moment (`optim.mu_dtype`; null: the parameter's dtype)
    device_memory_gib: float = DEFAULT_DEVICE_MEMORY_GIB

    def validate(self) -> "PlanSettings":
        for name in ("batch", "seq"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value < 1):
                raise PlanError(f"{name}={value!r} is invalid: must be a positive integer")
        if self.remat is not None and self.remat not in REMAT_POLICIES:
            raise PlanError(f"remat={self.remat!r} is invalid: must be one of {tuple(REMAT_POLICIES)}")
        if self.optimizer not in OPTIMIZER_NAMES:
            raise PlanError(f"optimizer={self.optimizer!r} is invalid: must be one of {OPTIMIZER_NAMES}")
        if self.mu_dtype is not None and self.mu_dtype not in MOMENT_DTYPES:
            raise PlanError(f"mu_dtype={self.mu_dtype!r} is invalid: must be one of {MOMENT_DTYPES}")
        if isinstance(self.device_memory_gib, bool) or not isinstance(self.device_memory_gib, (int, float)) \
                or not self.device_memory_gib > 0:
            raise PlanError(f"device_memory_gib={self.device_memory_gib!r} is invalid: must be a number > 0")
        return self


# ---------------------------------------------------------------------------------------------
# Sizes of sharded trees
# ---------------------------------------------------------------------------------------------

def _nbytes(leaf) -> int:
    return math.prod(leaf.shape) * jnp.dtype(leaf.dtype).itemsize


def _shards(spec, sizes: dict[str, int]) -> int:
    axes = [a for entry in spec if entry is not None for a in ((entry,) if isinstance(entry, str) else entry)]
    return math.prod(sizes[a] for a in axes)


def _spec_axes(spec) -> set[str]:
    return {a for entry in spec if entry is not None for a in ((entry,) if isinstance(entry, str) else entry)}


def sharded_param_bytes(params, sizes: dict[str, int], config: ModelConfig) -> int:
    specs = param_specs(params, sizes, config=config)
    return sum(_nbytes(leaf) // _shards(spec, sizes)
               for leaf, spec in zip(jax.tree.leaves(params), jax.tree.leaves(specs, is_leaf=_is_spec)))


def _is_spec(x) -> bool:
    return isinstance(x, jax.sharding.PartitionSpec)


def optimizer_state_bytes(params, optimizer: str, sizes: dict[str, int], config: ModelConfig,
                          mu_dtype: str | None = None) -> int:
    tx = make_optimizer(OptimConfig(name=optimizer, mu_dtype=mu_dtype), params, config=config)
    state = jax.eval_shape(tx.init, params)
    total = 0
    for path, leaf in jax.tree_util.tree_flatten_with_path(state)[0]:
        spec = state_leaf_spec(path_names(path), tuple(leaf.shape), sizes, config=config)
        total += _nbytes(leaf) // _shards(spec, sizes)
    return total


# ---------------------------------------------------------------------------------------------
# Activations, traced at per-device shapes
# ---------------------------------------------------------------------------------------------

def _local(size: int, logical: str, sizes: dict[str, int]) -> int:
    """Per-device extent of a dim of `size` carrying `logical` (the rule table decides the split)."""
    spec = logical_to_spec((logical,), (size,), sizes)
    return size // _shards(spec, sizes)


def per_device_config(config: ModelConfig, sizes: dict[str, int], remat: str) -> ModelConfig:
    """The model as one device sees it under tensor parallelism (heads, MLP widths, vocabulary split)."""
    return dataclasses.replace(
        config,
        num_attention_heads=_local(config.num_attention_heads, "heads", sizes),
        index_n_heads=_local(config.index_n_heads, "index_heads", sizes),
        intermediate_size=_local(config.intermediate_size, "mlp", sizes),
        moe_intermediate_size=_local(config.moe_intermediate_size, "expert_mlp", sizes),
        vocab_size=_local(config.vocab_size, "vocab", sizes),
        remat_policy=remat,
    ).validate()


def _residual_bytes(fn, inputs: tuple, exclude: int) -> int:
    """Bytes reverse-mode AD keeps from `fn(*inputs)` for its backward. Not counted: the first `exclude`
    inputs themselves (parameters, loop-invariant context: stored anyway) and residuals that depend on no
    input (broadcast constants, which XLA folds into their users instead of storing)."""
    def residuals(*args):
        _, vjp_fn = jax.vjp(fn, *args)
        return jax.tree.leaves(vjp_fn)

    jaxpr = jax.make_jaxpr(residuals)(*inputs).jaxpr
    n_excluded = len(jax.tree.leaves(inputs[:exclude]))
    excluded = set(jaxpr.invars[:n_excluded])
    depends_on_input = set(jaxpr.invars)
    for eqn in jaxpr.eqns:
        if any(not isinstance(v, Literal) and v in depends_on_input for v in eqn.invars):
            depends_on_input.update(eqn.outvars)
    counted = {v for v in jaxpr.outvars
               if not isinstance(v, Literal) and v in depends_on_input and v not in excluded}
    return sum(_nbytes(v.aval) for v in counted)


def planning_loss(params, tokens: jax.Array, config: ModelConfig) -> jax.Array:
    """The training objective on whole rows of `tokens` (glm5_jax.train.objective, mode pretrain: next-token
    and MTP cross-entropy, balance loss), so what AD keeps for the backward is what the training step keeps."""
    batch_size, seq = tokens.shape
    objective = LMObjective(config, TrainConfig(mode="pretrain", batch_size=batch_size, seq_len=seq))
    whole = jnp.ones_like(tokens)
    batch = {"tokens": tokens, "positions": jnp.broadcast_to(jnp.arange(seq), tokens.shape),
             "segment_ids": whole, "loss_mask": whole}
    return objective(params, batch, objective.denominators(batch))[0]


def _layer_residual_bytes(config: ModelConfig, params, kind: str, batch: int, seq: int) -> int:
    """Saved activations of one decoder layer of `kind` ("dense_layers" | "moe_layers") without remat."""
    unstack = lambda tree: jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape[1:], a.dtype), tree)
    layer, indexer = unstack(params[kind]), unstack(params["indexers"])
    positions = jax.ShapeDtypeStruct((batch, seq), jnp.int32)
    x = jax.ShapeDtypeStruct((batch, seq, config.hidden_size), jnp.dtype(config.compute_dtype))

    def layer_fn(layer, indexer, positions, x):
        cos, sin = rope_angles(positions, config.qk_rope_head_dim, config.rope_theta)
        segment_ids = jnp.ones(positions.shape, jnp.int32)
        ctx = LayerContext(cos=cos, sin=sin, segment_ids=segment_ids, token_mask=segment_ids > 0)
        layer, indexer = layer_modules(config, kind, layer, indexer)
        return layer(x, ctx, indexer=indexer).hidden

    return _residual_bytes(layer_fn, (layer, indexer, positions, x), exclude=3)


def _dispatch_residual_bytes(config: ModelConfig, tokens: int, layout, policy: str) -> int:
    """Saved activations of the expert dispatch of one MoE layer for one device with `layout`."""
    d, f, local = config.hidden_size, config.moe_intermediate_size, layout.local_experts
    dtype = jnp.dtype(config.param_dtype)
    experts = {"gate_proj": jax.ShapeDtypeStruct((local, d, f), dtype),
               "up_proj": jax.ShapeDtypeStruct((local, d, f), dtype),
               "down_proj": jax.ShapeDtypeStruct((local, f, d), dtype)}
    x = jax.ShapeDtypeStruct((tokens, d), jnp.dtype(config.compute_dtype))
    ids = jax.ShapeDtypeStruct((tokens, layout.top_k), jnp.int32)
    weights = jax.ShapeDtypeStruct((tokens, layout.top_k), jnp.float32)
    fn = lambda e, x, i, w: dispatch_without_exchange(e, x, i, w, layout)[0]
    if policy != "none":
        fn = jax.checkpoint(fn, policy=REMAT_POLICIES[policy])
    return _residual_bytes(fn, (experts, x, ids, weights), exclude=1)


def activation_bytes(config: ModelConfig, sizes: dict[str, int], batch: int, seq: int) -> dict[str, int]:
    """{"saved": ..., "working_set": ...} bytes per device for one microbatch (config is per-device)."""
    params = abstract_params(config)
    tokens = jax.ShapeDtypeStruct((batch, seq), jnp.int32)
    saved = _residual_bytes(lambda p, t: planning_loss(p, t, config), (params, tokens), exclude=1)
    policy = config.remat_policy
    mtp_steps = config.mtp_num_steps if config.num_nextn_predict_layers else 0
    layer_none = {kind: _layer_residual_bytes(config, params, kind, batch, seq)
                  for kind in ("dense_layers", "moe_layers") if kind in params}
    if config.moe_backend == "ep" and "moe_layers" in params:
        # The traces ran the single-device dispatch; add what the expert-parallel buffers hold beyond it.
        factor, _ = capacity_settings(config)
        tokens_local, top_k, n_experts = batch * seq, config.num_experts_per_tok, config.n_routed_experts
        sharded = dispatch_layout(tokens_local, top_k, n_experts, _expert_shards(config, sizes), factor)
        single = dispatch_layout(tokens_local, top_k, n_experts, 1, factor)
        extra = {p: _dispatch_residual_bytes(config, tokens_local, sharded, p)
                 - _dispatch_residual_bytes(config, tokens_local, single, p) for p in {"none", policy}}
        layer_none["moe_layers"] += extra["none"]
        # The MTP depth steps follow the same remat policy as the layers (glm5_jax.model.mtp).
        saved += (config.num_moe_layers + mtp_steps) * extra[policy]
        if policy in EXPERT_MATMUL_POLICIES:
            # The kept gate/up projections of the received rows, which the trace cannot see: on CPU the experts
            # run blocked, with no named grouped matmul.
            kept = sharded.receive_rows * 2 * config.moe_intermediate_size * jnp.dtype(config.compute_dtype).itemsize
            saved += (config.num_moe_layers + mtp_steps) * kept
    layers = WORKING_SET_LAYERS_NO_REMAT if policy == "none" else WORKING_SET_LAYERS_REMAT
    logits_cotangent = batch * seq * config.vocab_size * 4 * (1 + mtp_steps)
    return {"saved": saved, "working_set": int(layers * max(layer_none.values())) + logits_cotangent}


def _expert_shards(config: ModelConfig, sizes: dict[str, int]) -> int:
    """How many devices share one copy of the routed experts (the expert-parallel exchange group)."""
    return math.prod(sizes[axis] for axis in expert_split_axes(config.n_routed_experts, sizes))


def _gather_sizes(names: tuple[str, ...], sizes: dict[str, int]) -> dict[str, int]:
    """The mesh axes a weight is all-gathered over before use (FSDP): `fsdp`, `expert` and `context`, except that
    a routed expert's split over `expert` and `context` is expert parallelism (its tokens travel to it; it is
    never gathered)."""
    axes = ("fsdp",) if "experts" in names else ("fsdp", EXPERT_AXIS, CONTEXT_AXIS)
    return {axis: sizes[axis] for axis in axes}


def _fsdp_gather_bytes(params, sizes: dict[str, int], config: ModelConfig) -> int:
    """One layer's weights gathered over their FSDP axes plus their gradients before the reduce-scatter."""
    specs = param_specs(params, sizes, config=config)
    largest = 0
    for kind in ("dense_layers", "moe_layers"):
        if kind not in params:
            continue
        leaves = jax.tree_util.tree_flatten_with_path(params[kind])[0]
        layer_specs = jax.tree.leaves(specs[kind], is_leaf=_is_spec)
        gathered = sum(_nbytes(leaf) // leaf.shape[0]
                       // _shards(spec, {**sizes, **dict.fromkeys(_gather_sizes(path_names(path), sizes), 1)})
                       for (path, leaf), spec in zip(leaves, layer_specs))
        whole = sum(_nbytes(leaf) // leaf.shape[0] // _shards(spec, sizes)
                    for (_, leaf), spec in zip(leaves, layer_specs))
        largest = max(largest, gathered if gathered > whole else 0)
    return 2 * largest


# ---------------------------------------------------------------------------------------------
# Communication
# ---------------------------------------------------------------------------------------------

def _planned_transport(config: ModelConfig) -> str:
    """The expert all-to-all a plan assumes: "auto" means the ragged collective of accelerators."""
    transport = capacity_settings(config)[1]
    return "ragged" if transport == "auto" else transport


def communication_bytes(config: ModelConfig, local_config: ModelConfig, params, sizes: dict[str, int],
                        batch: int, seq: int) -> dict[str, int]:
    """Bytes each device sends per step (one microbatch, forward and backward) by kind of collective."""
    specs = param_specs(params, sizes, config=config)
    fsdp_gather = grad_reduce_scatter = grad_all_reduce = 0
    for (path, leaf), spec in zip(jax.tree_util.tree_flatten_with_path(params)[0],
                                  jax.tree.leaves(specs, is_leaf=_is_spec)):
        shard = _nbytes(leaf) // _shards(spec, sizes)
        used = _spec_axes(spec)
        group = math.prod(size for axis, size in _gather_sizes(path_names(path), sizes).items() if axis in used)
        fsdp_gather += 2 * (group - 1) * shard  # forward, then again for the backward
        grad_reduce_scatter += (group - 1) * shard
        # Every chip that holds the same shard computes a gradient for it: the batch axes and `context`.
        replicas = math.prod(sizes[a] for a in (*BATCH_AXES, CONTEXT_AXIS) if a not in used)
        grad_all_reduce += 2 * (replicas - 1) * shard // replicas
    recompute = 0 if config.remat_policy == "none" else 1
    mtp_steps = config.mtp_num_steps if config.num_nextn_predict_layers else 0
    layers = config.num_hidden_layers + mtp_steps
    moe_layers = config.num_moe_layers + mtp_steps
    passes = 2 + recompute  # forward, backward, remat recompute
    cp = sizes[CONTEXT_AXIS]
    tokens = batch * seq // cp  # this device's: its sequences' share over `context`
    act = jnp.dtype(config.compute_dtype).itemsize

    expert_all_to_all = 0
    ep = _expert_shards(config, sizes)
    if ep > 1 and config.num_moe_layers:
        factor, _ = capacity_settings(config)
        layout = dispatch_layout(tokens, config.num_experts_per_tok, config.n_routed_experts, ep, factor)
        padded = _planned_transport(config) == "padded"
        rows = ep * layout.largest_chunk if padded else tokens * config.num_experts_per_tok
        expert_all_to_all = moe_layers * passes * 2 * (ep - 1) * rows * config.hidden_size * act // ep

    tp = sizes["tensor"]
    tensor_all_reduce = 0
    if tp > 1:
        per_reduce = lambda n: 2 * (tp - 1) * n // tp
        hidden = tokens * config.hidden_size * act
        index_scores = tokens * seq * 4 if local_config.index_n_heads < config.index_n_heads else 0
        per_layer = 2 * per_reduce(hidden) + per_reduce(index_scores)
        tensor_all_reduce = layers * passes * per_layer + 2 * per_reduce(hidden)  # + embedding fwd/bwd
    # Context parallelism: every DSA layer all-gathers its compact keys (latent rows C + R, indexer key J) over
    # `context` in the forward and the remat recompute, and reduce-scatters their gradients in the backward.
    key_width = config.kv_lora_rank + config.qk_rope_head_dim + config.index_head_dim
    context_all_gather = layers * passes * (cp - 1) * tokens * key_width * act
    return {"fsdp_all_gather": fsdp_gather, "fsdp_reduce_scatter": grad_reduce_scatter,
            "data_all_reduce": grad_all_reduce, "expert_all_to_all": expert_all_to_all,
            "tensor_all_reduce": tensor_all_reduce, "context_all_gather": context_all_gather}


# ---------------------------------------------------------------------------------------------
# The plan
# ---------------------------------------------------------------------------------------------

def _check_layout(config: ModelConfig, mesh: MeshConfig, batch: int, seq: int) -> None:
    for axis, size in mesh.axis_sizes().items():
        if size == -1:
            raise PlanError(f"mesh.{axis}=-1 is invalid for a plan: there are no devices to fill it from; give "
                            "every axis its size")
    if mesh.tensor > 1:
        for field in ("num_attention_heads", "intermediate_size", "moe_intermediate_size"):
            if getattr(config, field) % mesh.tensor:
                raise PlanError(f"mesh.tensor={mesh.tensor} is invalid: it must divide model.{field}="
                                f"{getattr(config, field)}, which it shards")
    shards = mesh.data * mesh.fsdp * mesh.expert
    if batch % shards:
        raise PlanError(f"batch={batch} is invalid: the microbatch is split over data * fsdp * expert = {shards} "
                        "devices, so it must be a multiple of that")
    if mesh.context > 1:
        try:
            validate_context_split(mesh.context, seq, config.index_query_chunk)
        except ConfigError as err:
            raise PlanError(str(err).replace("train.seq_len", "seq")) from None
    if mesh.expert > 1 and config.moe_backend != "ep":
        raise PlanError(f"model.moe_backend={config.moe_backend!r} cannot be planned with mesh.expert="
                        f"{mesh.expert}: it runs each device's tokens through every expert, so the experts split "
                        "over `expert` would be gathered whole on every device. Use model.moe_backend=ep")
    if config.n_routed_experts % mesh.expert:
        raise PlanError(f"mesh.expert={mesh.expert} is invalid: must divide n_routed_experts "
                        f"({config.n_routed_experts})")


def plan(config: ModelConfig, mesh: MeshConfig, settings: PlanSettings) -> dict[str, Any]:
    """Per-device memory (bytes), per-step communication (bytes) and the verdict, as plain JSON data."""
    settings.validate()
    config.validate()
    batch = settings.batch or mesh.data * mesh.fsdp * mesh.expert
    remat = settings.remat or config.remat_policy
    config = dataclasses.replace(config, remat_policy=remat)
    _check_layout(config, mesh, batch, settings.seq)
    sizes = mesh.axis_sizes()
    params = abstract_params(config)
    local_batch = batch // (mesh.data * mesh.fsdp * mesh.expert)
    local_config = per_device_config(config, sizes, remat)
    param_bytes = sharded_param_bytes(params, sizes, config)
    # Traced on whole sequences, then divided by the context split: every per-token activation is split over
    # `context`; the gathered keys a DSA layer holds (C + R + J values per token of the whole sequence) are
    # small beside them.
    activations = {kind: size // mesh.context
                   for kind, size in activation_bytes(local_config, sizes, local_batch, settings.seq).items()}
    activations["working_set"] += _fsdp_gather_bytes(params, sizes, config)
    memory = {
        "params": param_bytes,
        "grads": param_bytes,
        "optimizer_state": optimizer_state_bytes(params, settings.optimizer, sizes, config, settings.mu_dtype),
        "activations_saved": activations["saved"],
        "activations_working_set": activations["working_set"],
    }
    memory["total"] = sum(memory.values())
    budget = int(settings.device_memory_gib * GIB)
    return {
        "mesh": sizes,
        "devices": mesh.num_devices,
        "batch": batch,
        "seq": settings.seq,
        "sequences_per_device": local_batch,
        "remat": remat,
        "optimizer": settings.optimizer,
        "mu_dtype": settings.mu_dtype,
        "param_dtype": config.param_dtype,
        "compute_dtype": config.compute_dtype,
        "moe_backend": config.moe_backend,
        "ep_transport": _planned_transport(config),
        "memory_bytes": memory,
        "communication_bytes": communication_bytes(config, local_config, params, sizes, local_batch, settings.seq),
        "device_memory_gib": settings.device_memory_gib,
        "fits": memory["total"] <= budget,
    }


def _human(n: int) -> str:
    for unit, size in (("GiB", GIB), ("MiB", 1024**2), ("KiB", 1024)):
        if n >= size:
            return f"{n / size:10.2f} {unit}"
    return f"{n:10d} B  "


def format_report(report: dict[str, Any], config_path: str) -> str:
    mesh = " ".join(f"{k}={v}" for k, v in report["mesh"].items())
    mem, comm = report["memory_bytes"], report["communication_bytes"]
    rows = lambda title, items: [title] + [f"  {label:34s}{_human(value)}" for label, value in items]
    lines = [
        f"plan for {config_path} on mesh {mesh} ({report['devices']} devices)",
        f"microbatch {report['batch']} x {report['seq']} tokens ({report['sequences_per_device']} sequences per "
        f"device), remat={report['remat']}, optimizer={report['optimizer']}"
        + (f" (momentum {report['mu_dtype']})" if report["mu_dtype"] else "") + f", params {report['param_dtype']}, "
        f"compute {report['compute_dtype']}, moe_backend={report['moe_backend']}"
        + (f" (ep_transport={report['ep_transport']})" if report["moe_backend"] == "ep" else ""),
        "",
        *rows("per-device memory", [
            ("parameters", mem["params"]), ("gradients", mem["grads"]), ("optimizer state", mem["optimizer_state"]),
            ("activations saved for backward", mem["activations_saved"]),
            ("backward working set", mem["activations_working_set"]), ("total", mem["total"])]),
        "",
        *rows("per-step communication per device (sent)", [
            ("FSDP all-gather (weights)", comm["fsdp_all_gather"]),
            ("FSDP reduce-scatter (grads)", comm["fsdp_reduce_scatter"]),
            ("data all-reduce (grads)", comm["data_all_reduce"]),
            ("expert all-to-all", comm["expert_all_to_all"]),
            ("tensor all-reduce", comm["tensor_all_reduce"]),
            ("context all-gather (DSA keys)", comm["context_all_gather"])]),
        "",
    ]
    limit = report["device_memory_gib"]
    if report["fits"]:
        lines.append(f"verdict: fits in {limit:g} GiB ({mem['total'] / GIB / limit:.0%} used)")
    else:
        lines.append(f"verdict: does not fit in {limit:g} GiB (needs {mem['total'] / GIB:.1f} GiB)")
    return "\n".join(lines)

