"""Checks that need 8 devices, run by tests/parallel/test_multidevice.py in a subprocess: the fake-device flag
must be set before jax is imported, and the rest of the suite keeps one device.

Usage: python tests/parallel/_multidevice_checks.py GROUP...   (GROUP: ep | checkpoint | plan | train_step | scaling)
Every check prints "PASS <name>"; a failed assertion exits non-zero with the traceback.
"""

import sys

import _eight_devices  # noqa: F401  (the device count, before jax is imported)

import dataclasses  # noqa: E402
import functools  # noqa: E402
import math  # noqa: E402
import tempfile  # noqa: E402
from pathlib import Path  # noqa: E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
from flax import nnx  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import NamedSharding, PartitionSpec, SingleDeviceSharding  # noqa: E402

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

from glm5_jax.config import ModelConfig, load_model_config  # noqa: E402
from glm5_jax.model.layers import swiglu  # noqa: E402
from glm5_jax.model.experts import experts_reference  # noqa: E402
from glm5_jax.model.moe import MoE  # noqa: E402
from glm5_jax.config.mesh import BATCH_AXES, MeshConfig  # noqa: E402
from glm5_jax.distributed.mesh import make_mesh  # noqa: E402


def init_moe(config, key, dtype) -> dict:
    """The weights of one MoE block (`MoE` module) as a pure dict."""
    return nnx.to_pure_dict(nnx.state(MoE(config, nnx.Rngs(key), dtype)))


def moe_module(params: dict, config: ModelConfig) -> MoE:
    """The `MoE` module of `config` holding the pure-dict weights `params` (inside jit: traced ones)."""
    graph = nnx.split(nnx.eval_shape(lambda: MoE(config, nnx.Rngs(0), jnp.float32)))[0]
    return nnx.merge(graph, params)


def tiny(**overrides) -> ModelConfig:
    return dataclasses.replace(load_model_config(REPO / "configs" / "tiny.yaml"), **overrides).validate()


@functools.cache
def initial_params():
    """The tiny model's parameters on one device (host copy), the values `init_sharded` must reproduce."""
    from glm5_jax.model.transformer import init

    config = tiny()
    return jax.device_get(jax.jit(lambda key: init(config, key))(jax.random.key(0)))


def mesh_of(**sizes):
    cfg = MeshConfig(**sizes)
    return make_mesh(cfg, jax.devices()[:cfg.num_devices])


def token_shards(mesh) -> int:
    return math.prod(mesh.shape[a] for a in BATCH_AXES)


def close(a, b, name, rtol=1e-5, scaled_atol=2e-6):
    """allclose with the absolute tolerance relative to the largest magnitude of the expected values."""
    a, b = np.asarray(a), np.asarray(b)
    atol = scaled_atol * max(float(np.abs(b).max()), 1e-30)
    np.testing.assert_allclose(a, b, rtol=rtol, atol=atol, err_msg=name)


def trees_close(a, b, name, **tol):
    assert jax.tree.structure(a) == jax.tree.structure(b), name
    for (path, x), y in zip(jax.tree_util.tree_flatten_with_path(a)[0], jax.tree.leaves(b)):
        close(x, y, f"{name} {jax.tree_util.keystr(path)}", **tol)


# ---------------------------------------------------------------------------------------------
# Expert parallelism against the reference MoE
# ---------------------------------------------------------------------------------------------

@jax.jit
def moe_inputs(key):
    config = tiny()
    k_params, k_x, k_probe = jax.random.split(key, 3)
    params = init_moe(config, k_params, jnp.float32)
    # Larger expert weights than the init's 0.02 so the routed outputs dominate rounding noise.
    params["experts"] = jax.tree.map(lambda w: w * 10, params["experts"])
    x = jax.random.normal(k_x, (4, 16, config.hidden_size))
    return params, x, jax.random.normal(k_probe, x.shape)


def hand_kept(expert_ids: np.ndarray, shards: int, expert_shards: int, rows: int, n_experts: int,
              row_block: int = 1) -> np.ndarray:
    """Each expert rank fills its `rows` receive rows from the sources of its expert group in rank order, each
    source's rows for it in expert order, then token order, each source's chunk padded to whole blocks of
    `row_block` rows; the rest are dropped. Computed with loops, independently of the library's sort-based
    bookkeeping. Token shards are contiguous blocks; shard k is source k % expert_shards of group k //
    expert_shards."""
    n_tokens, top_k = expert_ids.shape
    per_shard, local = n_tokens // shards, n_experts // expert_shards
    kept = np.zeros(expert_ids.shape, bool)
    for group in range(shards // expert_shards):
        for rank in range(expert_shards):
            filled = 0
            for source in range(expert_shards):
                first = (group * expert_shards + source) * per_shard
                for expert in range(rank * local, (rank + 1) * local):
                    for token in range(first, first + per_shard):
                        for slot in range(top_k):
                            if expert_ids[token, slot] == expert:
                                kept[token, slot] = filled < rows
                                filled += 1
                filled = -(-filled // row_block) * row_block
    return kept


def value_and_grads(moe_fn, params, x, probe):
    """moe_fn(params, x) -> (out [B, S, D], extra); returns (out, extra, grads w.r.t. params and x) of the
    probe loss sum(out * probe)."""
    def loss(params, x):
        out, extra = moe_fn(params, x)
        return (out * probe).sum(), (out, extra)
    (_, (out, extra)), grads = jax.value_and_grad(loss, argnums=(0, 1), has_aux=True)(params, x)
    return out, extra, grads


@jax.jit
def hand_moe(params, x, probe, kept):
    """Reference MoE (every expert on every token) with the assignments where `kept` is False removed."""
    config = tiny()
    b, s, d = x.shape

    def moe_fn(params, x):
        flat = x.reshape(b * s, d)
        ids, weights, _ = moe_module(params, config).route(flat)
        routed = experts_reference(params["experts"], flat, ids, weights * kept)
        shared = params["shared_experts"]
        out = routed + swiglu(flat, shared["gate_proj"]["kernel"], shared["up_proj"]["kernel"],
                              shared["down_proj"]["kernel"])
        return out.reshape(b, s, d), None
    return value_and_grads(moe_fn, params, x, probe)


def ep_moe(config, mesh, params, x, probe):
    def moe_fn(params, x):
        out, aux = moe_module(params, config)(x, jnp.ones(x.shape[:2], bool), mesh=mesh)
        return out, aux["dropped_assignments"]
    return jax.jit(lambda p, x, r: value_and_grads(moe_fn, p, x, r))(params, x, probe)


def check_ep(mesh_sizes: dict, capacity_factor: float, inputs, want, transport: str = "padded", row_block: int = 1):
    """`ep` on a mesh against `want` = (output, grads): the reference backend when dropless, else the
    reference with the hand-computed drops removed (then the dropped count is checked too). `row_block` > 1:
    rows travel in blocks (the receive buffer then grows by the blocks' expected padding)."""
    config = tiny(moe_backend="ep", moe_capacity_factor=capacity_factor, ep_transport=transport,
                  ep_row_block=row_block)
    mesh = mesh_of(**mesh_sizes)
    out, dropped, grads = ep_moe(config, mesh, *inputs)
    name = f"ep {mesh_sizes} capacity_factor={capacity_factor} transport={transport}"
    name += f" row_block={row_block}" if row_block > 1 else ""
    want_dropped = 0
    if capacity_factor > 0:
        params, x, probe = inputs
        shards = token_shards(mesh)
        per_shard = x.shape[0] * x.shape[1] // shards
        top_k, n_experts = config.num_experts_per_tok, config.n_routed_experts
        expert_shards = mesh.shape["expert"]
        padding = expert_shards * (row_block - 1) / 2
        rows = math.ceil(math.ceil(capacity_factor * per_shard * top_k + padding) / row_block) * row_block
        ids = jax.jit(lambda p, x: moe_module(p, config).route(x.reshape(-1, x.shape[-1]))[0])(params, x)
        kept = hand_kept(np.asarray(ids), shards, expert_shards, rows, n_experts, row_block)
        want_dropped = int((~kept).sum())
        assert want_dropped > 0, f"{name}: the case must force drops"
        want_out, _, want_grads = hand_moe(params, x, probe, jnp.asarray(kept))
        want = (want_out, want_grads)
    close(out, want[0], name + " output")
    trees_close(grads, want[1], name + " grads", rtol=1e-4, scaled_atol=1e-5)
    assert int(dropped) == want_dropped, (name, int(dropped), want_dropped)
    print(f"PASS {name} (dropped {int(dropped)})")


def reference_backend(inputs):
    """The library's `reference` MoE backend on one device: output and grads."""
    config = tiny(moe_backend="reference")
    out, _, grads = jax.jit(lambda p, x, r: value_and_grads(
        lambda p, x: (moe_module(p, config)(x, jnp.ones(x.shape[:2], bool))[0], None), p, x, r))(*inputs)
    return out, grads


def check_dropped_tokens_get_shared_expert_only(mesh_sizes: dict, inputs):
    """Every token picks experts 0 and 1 (routing replay), both on expert rank 0. With one receive row per device
    only the first row of each expert group's first source fits: its first token keeps expert 0; every other
    assignment is dropped, and every other token's output must be exactly the shared expert's."""
    mesh = mesh_of(**mesh_sizes)
    shards, expert_shards = token_shards(mesh), mesh.shape["expert"]
    params, x, _ = inputs
    b, s, d = x.shape
    per_shard = b * s // shards
    config = tiny(moe_backend="ep", moe_capacity_factor=1 / (2 * per_shard))
    assert math.ceil(config.moe_capacity_factor * per_shard * 2) == 1
    choices = jnp.broadcast_to(jnp.arange(config.num_experts_per_tok, dtype=jnp.int32), (b, s, 2))
    out, aux = jax.jit(lambda p, x: moe_module(p, config)(x, jnp.ones((b, s), bool), choices, mesh=mesh))(
        params, x)
    shared = params["shared_experts"]
    flat, out_flat = x.reshape(b * s, d), np.asarray(out).reshape(b * s, d)
    shared_out = np.asarray(jax.jit(swiglu)(flat, shared["gate_proj"]["kernel"], shared["up_proj"]["kernel"],
                                            shared["down_proj"]["kernel"]))
    first = np.zeros(b * s, bool)
    first[::per_shard * expert_shards] = True
    close(out_flat[~first], shared_out[~first], "dropped tokens = shared expert", scaled_atol=1e-5)
    assert np.abs(out_flat[first] - shared_out[first]).max() > 1e-3, "kept tokens must get their experts"
    assert int(aux["dropped_assignments"]) == b * s * 2 - first.sum()
    print(f"PASS dropped tokens get only the shared expert on {mesh_sizes}")


EP_MESHES = [dict(expert=8), dict(data=2, expert=4), dict(data=2, expert=2, tensor=2)]


def emulated_ragged_all_to_all(largest_chunk):
    """jax.lax.ragged_all_to_all for XLA:CPU, which lacks it: the library's padded exchange, which follows the
    collective's documented semantics, so the ragged transport's calls are checked here."""
    from glm5_jax.model.expert_parallel import padded_ragged_all_to_all

    def ragged(operand, output, input_offsets, send_sizes, output_offsets, recv_sizes, *, axis_name,
               axis_index_groups=None):
        assert axis_index_groups is None
        return padded_ragged_all_to_all(operand, output, input_offsets, send_sizes, output_offsets, recv_sizes,
                                        axis_name=axis_name, largest_chunk=largest_chunk)
    return ragged


def group_ep():
    inputs = moe_inputs(jax.random.key(0))
    reference = reference_backend(inputs)
    for sizes in EP_MESHES:
        check_ep(sizes, 0.0, inputs, reference)
        check_ep(sizes, 0.6, inputs, None)
    # Rows in blocks (each chunk padded to whole blocks), as TPU meshes run them.
    check_ep(dict(expert=8), 0.0, inputs, reference, row_block=4)
    check_ep(dict(data=2, expert=4), 0.6, inputs, None, row_block=4)
    check_dropped_tokens_get_shared_expert_only(dict(data=2, expert=4), inputs)
    # The ragged transport, with XLA:CPU's missing collective emulated from its documented semantics.
    jax.lax.ragged_all_to_all = emulated_ragged_all_to_all(largest_chunk=4 * 16 * 2)  # every row of a shard
    check_ep(dict(expert=8), 0.6, inputs, None, transport="ragged")
    check_ep(dict(data=2, expert=2, tensor=2), 0.0, inputs, reference, transport="ragged")
    check_ep(dict(expert=8), 0.6, inputs, None, transport="ragged", row_block=16)


# ---------------------------------------------------------------------------------------------
# Sharded creation and checkpoints
# ---------------------------------------------------------------------------------------------

def group_checkpoint():
    from glm5_jax.checkpoint import Checkpointer
    from glm5_jax.parallel.sharding import (init_opt_state_sharded, init_sharded, opt_state_shardings,
                                            param_shardings, param_specs)
    from glm5_jax.train.optim import OptimConfig, make_optimizer

    config = tiny(moe_backend="ep")
    mesh_2x4 = mesh_of(fsdp=2, expert=4)
    params = init_sharded(config, jax.random.key(0), mesh_2x4)
    specs = param_specs(params, mesh_2x4, config=config)
    sharded_on = set()
    for (path, leaf), spec in zip(jax.tree_util.tree_flatten_with_path(params)[0],
                                  jax.tree.leaves(specs, is_leaf=lambda s: isinstance(s, PartitionSpec))):
        assert leaf.sharding.spec == spec, (jax.tree_util.keystr(path), leaf.sharding.spec, spec)
        shards = math.prod(mesh_2x4.shape[a] for e in spec if e for a in ((e,) if isinstance(e, str) else e))
        local = leaf.addressable_shards[0].data.shape
        assert math.prod(local) * shards == math.prod(leaf.shape), (jax.tree_util.keystr(path), local)
        sharded_on.update(a for e in spec if e for a in ((e,) if isinstance(e, str) else e))
    assert sharded_on == {"fsdp", "expert"}, sharded_on
    experts = params["moe_layers"]["moe"]["experts"]["gate_proj"]
    assert experts.sharding.spec == PartitionSpec(None, "expert", "fsdp", None), experts.sharding.spec
    trees_close(params, initial_params(), "init_sharded vs init", rtol=1e-6, scaled_atol=1e-6)
    print("PASS params are created sharded by the rule table, with the values of init")

    tx = make_optimizer(OptimConfig(name="muon"), params, config=config)
    opt_state = init_opt_state_sharded(tx, params, mesh_2x4, config=config)
    muon_state = lambda state: state[2].inner_states["muon"].inner_state[0][0].mu  # noqa: E731
    assert muon_state(opt_state)["moe_layers"]["moe"]["experts"]["gate_proj"].sharding == experts.sharding
    kv_b = params["moe_layers"]["attn"]["kv_b_proj"]["kernel"]
    assert muon_state(opt_state)["moe_layers"]["attn"]["kv_b_proj"]["kernel"].uk.sharding == kv_b.sharding
    print("PASS optimizer state is created sharded like its parameters (Muon Split halves included)")
    # Distinct non-zero values to save (the fresh moments are zeros); elementwise, so shardings are kept.
    opt_state = jax.jit(lambda state: jax.tree.map(lambda a: a + jnp.cos(jnp.arange(a.size, dtype=a.dtype)).reshape(
        a.shape) if jnp.issubdtype(a.dtype, jnp.floating) else a + 1, state))(opt_state)

    with tempfile.TemporaryDirectory() as directory:
        with Checkpointer(directory) as ckpt:
            ckpt.save(3, params=params, opt_state=opt_state, force=True)
            ckpt.wait_until_finished()
        for name, mesh in (("8x1", mesh_of(fsdp=8)), ("one device", None)):
            if mesh is None:
                device = SingleDeviceSharding(jax.devices()[0])
                target = lambda tree: jax.tree.map(  # noqa: E731
                    lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=device), tree)
                param_target, opt_target = target(params), target(opt_state)
            else:
                target = lambda tree, shardings: jax.tree.map(  # noqa: E731
                    lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s), tree, shardings)
                param_target = target(params, param_shardings(params, mesh, config=config))
                opt_target = target(opt_state, opt_state_shardings(opt_state, mesh, config=config))
            with Checkpointer(directory) as ckpt:
                restored = ckpt.restore(param_target, opt_target)
            for got, want, target_leaf in zip(jax.tree.leaves((restored.params, restored.opt_state)),
                                              jax.tree.leaves((params, opt_state)),
                                              jax.tree.leaves((param_target, opt_target))):
                np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
                assert got.sharding.is_equivalent_to(target_leaf.sharding, got.ndim), (name, got.sharding)
            print(f"PASS checkpoint saved on a 2x4 mesh restores on {name} with identical values")


# ---------------------------------------------------------------------------------------------
# Planner against XLA's compiled memory analysis
# ---------------------------------------------------------------------------------------------

def xla_train_memory(config, mesh_cfg: MeshConfig, batch: int, seq: int) -> int:
    """Per-device bytes XLA assigns to forward + backward of a mean cross-entropy (arguments, outputs, temps)."""
    from glm5_jax.model.transformer import forward
    from glm5_jax.parallel.sharding import abstract_params, param_shardings

    def mean_ce(logits, targets):
        logp = jax.nn.log_softmax(logits.astype(jnp.float32))
        return -jnp.take_along_axis(logp, targets[..., None], axis=-1).mean()

    params = abstract_params(config)
    tokens = jax.ShapeDtypeStruct((batch, seq), jnp.int32)
    mesh = None if mesh_cfg.num_devices == 1 else make_mesh(mesh_cfg, jax.devices()[:mesh_cfg.num_devices])

    def loss(params, tokens):
        out = forward(params, tokens, config=config, mesh=mesh)
        total = mean_ce(out.logits, tokens)
        if out.mtp_logits is not None:
            total = total + mean_ce(out.mtp_logits, jnp.broadcast_to(tokens, out.mtp_logits.shape[:-1]))
        return total

    step = jax.value_and_grad(loss)
    if mesh is None:
        compiled = jax.jit(step).lower(params, tokens).compile()
    else:
        shardings = param_shardings(params, mesh, config=config)
        tokens_sharding = NamedSharding(mesh, PartitionSpec(BATCH_AXES))
        step = jax.jit(step, in_shardings=(shardings, tokens_sharding),
                       out_shardings=(NamedSharding(mesh, PartitionSpec()), shardings))
        compiled = step.lower(params, tokens).compile()
    stats = compiled.memory_analysis()
    return stats.argument_size_in_bytes + stats.output_size_in_bytes + stats.temp_size_in_bytes


def group_plan():
    from glm5_jax.parallel.plan import PlanSettings, plan

    cases = [
        ("one device, no remat, ragged MoE, MTP", tiny(), MeshConfig(), 4, 64, "none"),
        ("data=2 fsdp=2 expert=2, full remat, ep MoE, MTP", tiny(moe_backend="ep"),
         MeshConfig(data=2, fsdp=2, expert=2), 16, 64, "full"),
    ]
    for name, config, mesh_cfg, batch, seq, remat in cases:
        report = plan(config, mesh_cfg, PlanSettings(batch=batch, seq=seq, remat=remat))
        memory = report["memory_bytes"]
        estimate = sum(memory[k] for k in ("params", "grads", "activations_saved", "activations_working_set"))
        actual = xla_train_memory(dataclasses.replace(config, remat_policy=remat), mesh_cfg, batch, seq)
        ratio = estimate / actual
        assert abs(ratio - 1) <= 0.15, f"{name}: planner {estimate} vs XLA {actual} bytes (ratio {ratio:.3f})"
        print(f"PASS planner within 15% of XLA: {name} (planner {estimate}, XLA {actual}, ratio {ratio:.3f})")


# ---------------------------------------------------------------------------------------------
# One training step on a 2x2x2 mesh equals the single-device step
# ---------------------------------------------------------------------------------------------

def group_train_step():
    """Plain SGD (update = -lr * grad) keeps the comparison as tight as the gradients themselves (Adam's first
    step is lr * sign(g), which fp32 reduction order flips wherever g is ~0). The rate is large so that the
    update, not the fp32 spacing of the weights, dominates new - old.

    One single-device step is the reference of both mesh steps (a 2x2x2 mesh jitted as `glm5 train` jits it,
    with pinned shardings, and wide expert parallelism jitted without them): each compile of a training step
    costs tens of seconds of CPU. The config is tiny.yaml's with the shared expert twice as wide as a routed
    one (F = 24, no other weight's dim), so the wide EP check tells the routed experts' weights apart in the
    HLO by shape."""
    import optax

    from glm5_jax.config import TrainConfig
    from glm5_jax.model.transformer import init
    from glm5_jax.train.step import init_train_state, make_train_step

    train = TrainConfig(batch_size=8, seq_len=32).validate()
    distinct = dict(moe_intermediate_size=24, n_shared_experts=2)
    single_config = tiny(moe_backend="ragged", **distinct)
    params = jax.device_get(jax.jit(lambda key: init(single_config, key))(jax.random.key(0)))
    tx = optax.sgd(1e3)
    tokens = jax.random.randint(jax.random.key(1), (8, 32), 0, single_config.vocab_size, jnp.int32)
    batch = {"tokens": tokens, "segment_ids": jnp.ones_like(tokens),
             "positions": jnp.broadcast_to(jnp.arange(32, dtype=jnp.int32), tokens.shape),
             "loss_mask": jnp.ones_like(tokens)}
    single_state, single_metrics = make_train_step(single_config, train, tx)(
        init_train_state(jax.tree.map(jnp.asarray, params), tx), batch)
    single = (float(single_metrics["loss"]), [np.asarray(leaf) for leaf in jax.tree.leaves(single_state.params)])
    assert max(np.abs(new - old).max() for new, old in zip(single[1], jax.tree.leaves(params))) > 1e-2, \
        "the step must move the parameters"
    check_pinned_mesh_steps(tiny(moe_backend="ep", **distinct), train, tx, params, batch, single)
    check_wide_expert_parallel_step(tiny(moe_backend="ep", **distinct), train, tx, params, batch, single)


def check_step_equals_single(name: str, loss, new_params, params, single) -> None:
    """One step's loss and every parameter's update (new - old) against the single-device step's."""
    single_loss, single_params = single
    close(loss, single_loss, f"{name} loss")
    for (path, old), new, want in zip(jax.tree_util.tree_flatten_with_path(params)[0], jax.tree.leaves(new_params),
                                      single_params):
        close(np.asarray(new) - old, want - old, f"{name} parameter update {jax.tree_util.keystr(path)}",
              rtol=1e-4, scaled_atol=1e-4)


def check_pinned_mesh_steps(mesh_config, train, tx, params, batch, single):
    """On a 2x2x2 mesh, jitted with explicit in/out shardings as `glm5 train` jits it: the first step equals
    the single-device step, and the state keeps its layout, so three steps compile one executable."""
    from glm5_jax.parallel.sharding import (init_opt_state_sharded, opt_state_shardings, param_shardings,
                                            shard_params)
    from glm5_jax.train.step import TrainState, make_train_step

    mesh = mesh_of(data=2, fsdp=2, expert=2)
    replicated = NamedSharding(mesh, PartitionSpec())
    batch_sharding = NamedSharding(mesh, PartitionSpec(BATCH_AXES))
    sharded = shard_params(params, mesh, config=mesh_config)
    state = TrainState(step=jax.device_put(jnp.zeros((), jnp.int32), replicated), params=sharded,
                       opt_state=init_opt_state_sharded(tx, sharded, mesh, config=mesh_config))
    shardings = TrainState(step=replicated, params=param_shardings(sharded, mesh, config=mesh_config),
                           opt_state=opt_state_shardings(state.opt_state, mesh, config=mesh_config))
    pinned = make_train_step(mesh_config, train, tx, mesh=mesh, state_shardings=shardings,
                             batch_sharding=batch_sharding)
    mesh_batch = jax.tree.map(lambda a: jax.device_put(a, batch_sharding), batch)
    state, metrics = pinned(state, mesh_batch)
    check_step_equals_single("2x2x2 mesh", metrics["loss"], state.params, params, single)
    print(f"PASS one training step on a 2x2x2 mesh equals the single-device step (loss {single[0]:.6f})")
    for _ in range(2):
        state, _ = pinned(state, mesh_batch)
    assert pinned.jitted._cache_size() == 1, pinned.jitted._cache_size()
    print("PASS three pinned-sharding steps compile one executable")


def check_wide_expert_parallel_step(wide_config, train, tx, params, batch, single):
    """Wide expert parallelism (`expert` 8, `fsdp` 1): every device keeps its routed expert whole, the other
    weights are split over all 8 devices, tokens travel by all-to-all; one training step equals one device's
    in loss and in every parameter's update, and the compiled step gathers no routed-expert weight."""
    from glm5_jax.parallel.hlo_stats import result_shapes
    from glm5_jax.parallel.sharding import init_opt_state_sharded, param_specs, shard_params
    from glm5_jax.train.step import TrainState, make_train_step

    mesh = mesh_of(expert=8)
    experts_spec = param_specs(params, mesh, config=wide_config)["moe_layers"]["moe"]["experts"]
    assert experts_spec["gate_proj"] == PartitionSpec(None, "expert", None, None), experts_spec
    sharded = shard_params(params, mesh, config=wide_config)
    state = TrainState(step=jnp.zeros((), jnp.int32), params=sharded,
                       opt_state=init_opt_state_sharded(tx, sharded, mesh, config=wide_config))
    batch_sharding = NamedSharding(mesh, PartitionSpec(BATCH_AXES))
    mesh_batch = jax.tree.map(lambda a: jax.device_put(a, batch_sharding), batch)
    step = make_train_step(wide_config, train, tx, mesh=mesh)
    hlo = step.jitted.trace(state, mesh_batch).lower().compile().as_text()
    mesh_state, mesh_metrics = step(state, mesh_batch)

    check_step_equals_single("wide EP", mesh_metrics["loss"], mesh_state.params, params, single)
    d, f = wide_config.hidden_size, wide_config.moe_intermediate_size
    gathered = [shape for shape in result_shapes(hlo, "all-gather") if shape[-2:] in ((d, f), (f, d))]
    assert not gathered, f"routed-expert weights all-gathered in the wide EP step: {gathered}"
    assert "all-to-all" in hlo, "tokens must travel to the experts by all-to-all"
    print(f"PASS wide expert parallelism (expert=8): one training step equals the single-device step, no expert "
          f"weight gathered (loss {single[0]:.6f})")


# ---------------------------------------------------------------------------------------------
# The training step `glm5 train` runs: per-device work shrinks with the mesh, memory as planned
# ---------------------------------------------------------------------------------------------

# One dense and one MoE layer, one MTP step: every kind of layer the shares are about, in less compile time.
SCALING_DEPTHS = ["model.num_hidden_layers=2", "model.mtp_num_steps=1"]


def compiled_step(overrides: list[str], devices: int):
    """Per-device matmul FLOPs (every loop trip counted, as `hlo_stats` does: XLA's cost analysis counts a
    loop body once, hiding the experts' blocked loop) and XLA's memory of the exact step `glm5 train` builds
    (MTP on, AdamW)."""
    from glm5_jax.config.experiment import load_experiment
    from glm5_jax.parallel.aot import abstract_train_step
    from glm5_jax.parallel.hlo_stats import hlo_stats
    from glm5_jax.parallel.plan import PlanSettings, plan

    cfg = load_experiment(REPO / "configs" / "tiny.yaml", ["train.batch_size=16", "train.seq_len=128",
                                                           "optim.name=adamw", *SCALING_DEPTHS, *overrides])
    cfg = dataclasses.replace(cfg, mesh=cfg.mesh.resolve(devices))
    jitted, state, batch, _ = abstract_train_step(cfg, jax.devices()[:devices])
    compiled = jitted.trace(state, batch).lower().compile()
    stats = hlo_stats(compiled.as_text(), devices)
    memory = compiled.memory_analysis()
    total = (memory.argument_size_in_bytes + memory.output_size_in_bytes + memory.temp_size_in_bytes
             - memory.alias_size_in_bytes)
    planned = plan(cfg.model, cfg.mesh, PlanSettings(batch=16, seq=128, optimizer="adamw"))
    return stats.matmul_flops, total, planned["memory_bytes"]["total"]


def group_scaling():
    assert tiny().mtp_num_steps > 0
    single_flops, _, _ = compiled_step([], 1)
    cases = {"data=8": ["mesh.data=8"], "fsdp=8": ["mesh.fsdp=8"],
             "fsdp=2 x expert=4": ["mesh.fsdp=2", "mesh.expert=4", "model.moe_backend=ep"]}
    for name, overrides in cases.items():
        flops, memory, planned = compiled_step(overrides, 8)
        share = flops / single_flops
        assert share <= 1.25 / 8, f"{name}: per-device FLOPs are {share:.3f} of one device's (limit {1.25 / 8})"
        ratio = planned / memory
        assert abs(ratio - 1) <= 0.15, f"{name}: plan {planned} vs compiled {memory} bytes (ratio {ratio:.3f})"
        print(f"PASS {name}: per-device FLOPs {share:.3f} of one device (matmul, every loop trip), plan/compiled "
              f"memory {ratio:.3f}")


GROUPS = {"ep": group_ep, "checkpoint": group_checkpoint, "plan": group_plan, "train_step": group_train_step,
          "scaling": group_scaling}

if __name__ == "__main__":
    assert len(jax.devices()) == 8, jax.devices()
    for group in sys.argv[1:]:
        GROUPS[group]()
