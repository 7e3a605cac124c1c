"""Checkpoint round trips, keep-K, resume, crash safety, shape checks and the non-finite guard."""

import shutil

import jax
import jax.numpy as jnp
import numpy as np
from orbax.checkpoint.path import atomicity
import pytest

from glm5_jax.checkpoint import Checkpointer, CheckpointError, NonFiniteStateError
from glm5_jax.config import ModelConfig
from glm5_jax.train.optim import OptimConfig, make_optimizer
from glm5_jax.tree_paths import path_string

V, D, C, H, NOPE, P, L, E = 8, 4, 6, 2, 2, 3, 2, 3
# The model whose weights `make_params` holds part of (the optimizer reads each weight's metadata off it).
CONFIG = ModelConfig(vocab_size=V, hidden_size=D, intermediate_size=4, moe_intermediate_size=4,
                     num_hidden_layers=2 * L, first_k_dense_replace=L, num_attention_heads=H, q_lora_rank=4,
                     kv_lora_rank=C, qk_nope_head_dim=NOPE, qk_rope_head_dim=2, v_head_dim=P, n_routed_experts=E,
                     num_experts_per_tok=1, n_group=1, topk_group=1, index_n_heads=1, index_head_dim=4, index_topk=2)


def make_params(seed):
    rng = np.random.default_rng(seed)
    normal = lambda *shape: jnp.asarray(rng.normal(size=shape), jnp.float32)
    return {
        "embed": {"embedding": normal(V, D)},
        "dense_layers": {"input_norm": {"scale": normal(L, D)},
                         "attn": {"kv_b_proj": {"kernel": normal(L, C, H, NOPE + P)},
                                  "o_proj": {"kernel": normal(L, D, H, P)}}},
        "moe_layers": {"moe": {"e_score_correction_bias": normal(L, E)}},
    }


OPTIMIZER = make_optimizer(OptimConfig(name="muon"), make_params(0), config=CONFIG)
UPDATE = jax.jit(OPTIMIZER.update)


def make_state(seed):
    """Params plus a real Muon optimizer state (NamedTuples, masked leaves, int counters)."""
    params = make_params(seed)
    _, opt_state = UPDATE(make_params(seed + 100), OPTIMIZER.init(params), params)
    return params, opt_state


def assert_trees_equal(a, b):
    assert jax.tree.structure(a) == jax.tree.structure(b)
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


def save_steps(ckpt, steps):
    saved = {}
    for step in steps:
        params, opt_state = make_state(step)
        if ckpt.save(step, params=params, opt_state=opt_state, data_state={"next_index": step * 10},
                     config={"model": {"hidden_size": D}, "step": step}):
            saved[step] = params, opt_state
    return saved


def test_round_trip_keeps_newest_k_and_resumes_latest(tmp_path):
    with Checkpointer(tmp_path, save_interval_steps=2, max_to_keep=2) as ckpt:
        saved = save_steps(ckpt, range(9))
        assert sorted(saved) == [0, 2, 4, 6, 8]
        assert ckpt.all_steps() == [6, 8]
    target_params, target_state = make_state(99)
    with Checkpointer(tmp_path, save_interval_steps=2, max_to_keep=2) as resumed:
        assert resumed.latest_step() == 8
        restored = resumed.restore(target_params, target_state)
        assert restored.step == 8
        assert_trees_equal(restored.params, saved[8][0])
        assert_trees_equal(restored.opt_state, saved[8][1])
        assert restored.data_state == {"next_index": 80}
        assert restored.config == {"model": {"hidden_size": D}, "step": 8}
        older = resumed.restore(target_params, step=6)
        assert older.opt_state is None
        assert_trees_equal(older.params, saved[6][0])
        with pytest.raises(CheckpointError, match="step=4 is not in"):
            resumed.restore(target_params, step=4)


def test_restore_into_abstract_targets_with_shardings(tmp_path):
    params, opt_state = make_state(3)
    with Checkpointer(tmp_path) as ckpt:
        ckpt.save(5, params=params, opt_state=opt_state, force=True)
        sharding = jax.sharding.SingleDeviceSharding(jax.devices()[0])
        abstract = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sharding), params)
        restored = ckpt.restore(abstract)
    assert_trees_equal(restored.params, params)
    assert all(x.sharding == sharding for x in jax.tree.leaves(restored.params))
    assert restored.data_state is None and restored.config is None


def test_o_proj_saved_heads_first_is_restored_output_first(tmp_path):
    """Checkpoints before 2026-12-05 hold o_proj (and its Muon momentum) as [L, H, P, D]; the model keeps
    [L, D, H, P]: restored by moving the axes, value for value, into the target's sharding."""
    params, opt_state = make_state(4)
    heads_first = lambda x: jnp.moveaxis(x, -3, -1)  # noqa: E731  ([L, D, H, P] -> [L, H, P, D])
    is_o_proj = lambda path: path_string(path).endswith("o_proj/kernel")  # noqa: E731
    old = lambda tree: jax.tree_util.tree_map_with_path(  # noqa: E731
        lambda path, x: heads_first(x) if is_o_proj(path) else x, tree)
    assert old(params)["dense_layers"]["attn"]["o_proj"]["kernel"].shape == (L, H, P, D)
    with Checkpointer(tmp_path) as ckpt:
        ckpt.save(1, params=old(params), opt_state=old(opt_state), force=True)
        sharding = jax.sharding.SingleDeviceSharding(jax.devices()[0])
        abstract = lambda tree: jax.tree.map(  # noqa: E731
            lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sharding), tree)
        restored = ckpt.restore(abstract(params), abstract(opt_state))
    assert_trees_equal(restored.params, params)
    assert_trees_equal(restored.opt_state, opt_state)
    assert restored.params["dense_layers"]["attn"]["o_proj"]["kernel"].sharding == sharding


def test_exception_mid_save_leaves_previous_checkpoint_restorable(tmp_path, monkeypatch):
    with Checkpointer(tmp_path, save_interval_steps=1) as ckpt:
        saved = save_steps(ckpt, [1])

        # Every item is written into the temporary folder, then the final commit (rename) fails.
        async def crash_before_commit(self):
            raise OSError("simulated crash before the atomic rename")

        monkeypatch.setattr(atomicity.AtomicRenameTemporaryPath, "finalize", crash_before_commit)
        params, opt_state = make_state(2)
        with pytest.raises(OSError, match="simulated crash"):
            ckpt.save(2, params=params, opt_state=opt_state, data_state={"next_index": 20})
            ckpt.wait_until_finished()
        monkeypatch.undo()
        assert list(tmp_path.glob("2*")), "the interrupted save should leave its temporary folder"
    with Checkpointer(tmp_path, save_interval_steps=1) as restarted:
        assert restarted.all_steps() == [1]
        restored = restarted.restore(*make_state(50))
        assert restored.step == 1 and restored.data_state == {"next_index": 10}
        assert_trees_equal(restored.params, saved[1][0])
        assert save_steps(restarted, [2]).keys() == {2}
        assert restarted.latest_step() == 2


def test_killed_save_leaves_temporary_folder_that_is_ignored(tmp_path):
    with Checkpointer(tmp_path, save_interval_steps=1) as ckpt:
        saved = save_steps(ckpt, [1, 2])
    # A process killed mid-save leaves a partly written temporary step folder behind.
    partial = tmp_path / f"3{atomicity.TMP_DIR_SUFFIX}"
    shutil.copytree(tmp_path / "2", partial)
    shutil.rmtree(partial / "opt_state")
    for marker in partial.glob("*CHECKPOINT_METADATA*"):
        marker.unlink()
    with Checkpointer(tmp_path, save_interval_steps=1) as restarted:
        assert restarted.latest_step() == 2
        restored = restarted.restore(*make_state(50))
    assert restored.step == 2
    assert_trees_equal(restored.opt_state, saved[2][1])
    assert not partial.exists()


def test_shape_mismatch_names_the_parameter_and_both_shapes(tmp_path):
    params, opt_state = make_state(1)
    with Checkpointer(tmp_path) as ckpt:
        ckpt.save(1, params=params, opt_state=opt_state, force=True)
        wrong = make_params(2)
        wrong["dense_layers"]["attn"]["o_proj"]["kernel"] = jnp.zeros((L, D, H, P + 1))
        with pytest.raises(CheckpointError, match=r"dense_layers/attn/o_proj/kernel.*\(2, 4, 2, 3\).*\(2, 4, 2, 4\)"):
            ckpt.restore(wrong)
        missing = make_params(2)
        missing["extra"] = {"scale": jnp.zeros((D,))}
        with pytest.raises(CheckpointError, match="no parameter 'extra/scale'"):
            ckpt.restore(missing)
        adamw_state = make_optimizer(OptimConfig(name="adamw"), params, config=CONFIG).init(params)
        with pytest.raises(CheckpointError, match="optimizer state"):
            ckpt.restore(params, adamw_state)
        with pytest.raises(CheckpointError, match="data_state must be JSON"):
            ckpt.save(2, params=params, opt_state=opt_state, data_state={"it": object()}, force=True)


def test_save_if_finite_never_replaces_last_good_checkpoint(tmp_path):
    params, opt_state = make_state(1)
    with Checkpointer(tmp_path, save_interval_steps=1, max_to_keep=1) as ckpt:
        assert ckpt.save_if_finite(1, loss=jnp.float32(2.5), params=params, opt_state=opt_state,
                                   data_state={"next_index": 1})
        with pytest.raises(NonFiniteStateError, match=r"loss=nan.*step 1"):
            ckpt.save_if_finite(2, loss=float("nan"), params=params, opt_state=opt_state)
        poisoned = make_params(1)
        poisoned["embed"]["embedding"] = poisoned["embed"]["embedding"].at[0, 0].set(jnp.inf)
        with pytest.raises(NonFiniteStateError, match=r"params\['embed/embedding'\]"):
            ckpt.save_if_finite(3, loss=1.0, params=poisoned, opt_state=opt_state)
        assert ckpt.all_steps() == [1]
        assert_trees_equal(ckpt.restore(params).params, params)


def test_read_only_checkpointer_leaves_another_runs_temporary_folders(tmp_path):
    import jax.numpy as jnp

    params = {"w": jnp.ones((2,))}
    with Checkpointer(tmp_path / "ckpt", save_interval_steps=1) as ckpt:
        ckpt.save(1, params=params, opt_state={"m": jnp.zeros((2,))})
    in_flight = tmp_path / "ckpt" / "2.orbax-checkpoint-tmp-123"  # a live run's save under way
    in_flight.mkdir()
    (in_flight / "params").write_text("partial")
    with Checkpointer(tmp_path / "ckpt", read_only=True) as reader:
        assert reader.restore(params).step == 1
    assert in_flight.exists()
    with Checkpointer(tmp_path / "ckpt", save_interval_steps=1) as owner:  # an owner's does clean them up
        owner.save(3, params=params, opt_state={"m": jnp.zeros((2,))})  # (orbax finishes its clean-up first)
    assert not in_flight.exists()
