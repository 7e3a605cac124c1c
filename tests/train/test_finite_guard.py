"""The non-finite guard: a step with a non-finite loss or gradient (or one whose square overflows) is not applied,
an update that overflows from finite gradients is reported as a state that could not be kept, and the first bad
leaf is named; checkpoints refuse non-finite optimizer state too."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from glm5_jax.checkpoint import Checkpointer, NonFiniteStateError
from glm5_jax.train.finite_guard import checked_leaf_names, describe_non_finite, keep_state_unless_finite


def _setup():
    params = {"a": jnp.ones((2, 3)), "b": {"kernel": jnp.full((3,), 2.0)}}
    optimizer = optax.adam(1e-3)
    return params, optimizer, optimizer.init(params)


def _step(params, optimizer, opt_state, grads, loss):
    """The guarded update, compiled as `make_train_step` compiles it: the new state from the optimizer."""
    updates, new_opt_state = optimizer.update(grads, opt_state, params)
    new_params = optax.apply_updates(params, updates)
    return jax.jit(keep_state_unless_finite)(params, opt_state, new_params, new_opt_state, grads, {"loss": loss})


def test_finite_step_is_applied():
    params, optimizer, opt_state = _setup()
    grads = jax.tree.map(jnp.ones_like, params)
    new_params, _, metrics = _step(params, optimizer, opt_state, grads, jnp.float32(1.0))
    assert int(metrics["non_finite"]) == 0 and int(metrics["non_finite_leaf"]) == -1
    assert not np.allclose(new_params["a"], params["a"])


@pytest.mark.parametrize("loss, bad_grad, expected", [
    (1.0, np.inf, "grads/b/kernel"),
    (np.nan, 0.0, "loss"),
    (1.0, 1e30, "grads/b/kernel"),  # finite, but its square (Adam's second moment) overflows: refused with the rest
])
def test_non_finite_step_keeps_the_old_state_and_names_the_leaf(loss, bad_grad, expected):
    params, optimizer, opt_state = _setup()
    grads = {"a": jnp.ones((2, 3)), "b": {"kernel": jnp.array([0.0, bad_grad, 0.0], jnp.float32)}}
    new_params, new_opt_state, metrics = _step(params, optimizer, opt_state, grads, jnp.float32(loss))
    assert int(metrics["non_finite"]) == 1 and int(metrics["non_finite_state"]) == 0
    names = checked_leaf_names(params, opt_state)
    assert names[int(metrics["non_finite_leaf"])] == expected
    for new, old in zip(jax.tree.leaves((new_params, new_opt_state)), jax.tree.leaves((params, opt_state))):
        np.testing.assert_array_equal(new, old)
    host = {"non_finite_leaf": int(metrics["non_finite_leaf"]), "loss": loss, "grad_norm": float("inf")}
    message = describe_non_finite(7, host, names, {"optim.lr": 0.1, "optim.grad_clip_norm": 0.0}, params, 6,
                                  ["optim.lr: 0.001 -> 0.1"])
    assert f"step 7 is not finite: {expected} is the first non-finite value" in message
    assert "optim.lr: 0.001 -> 0.1" in message and "gradient clipping is off" in message


def test_an_update_that_overflows_from_finite_gradients_is_a_state_that_could_not_be_kept():
    params = {"a": jnp.ones((2, 3)), "b": {"kernel": jnp.full((3,), 2.0)}}
    optimizer = optax.sgd(3e38)  # finite gradients of 10: updates of -3e39, beyond fp32
    grads = jax.tree.map(lambda p: jnp.full_like(p, 10.0), params)
    new_params, _, metrics = _step(params, optimizer, optimizer.init(params), grads, jnp.float32(1.0))
    assert int(metrics["non_finite"]) == 1 and int(metrics["non_finite_state"]) == 1
    assert np.isfinite(float(metrics["grad_norm"]))
    names = checked_leaf_names(params, optimizer.init(params))
    assert names[int(metrics["non_finite_leaf"])] == "params/a"
    assert not np.isfinite(np.asarray(new_params["a"])).any()  # applied: the old state was updated in place
    host = {"non_finite_leaf": int(metrics["non_finite_leaf"]), "non_finite_state": 1, "loss": 1.0,
            "grad_norm": float(metrics["grad_norm"])}
    message = describe_non_finite(4, host, names, {}, new_params, 3, [])
    assert "step 4 is not finite: params/a is the first non-finite value" in message
    assert "the update overflowed from finite gradients" in message and "never saved" in message


def test_the_gradient_norm_is_optax_s():
    params, optimizer, opt_state = _setup()
    grads = {"a": jnp.arange(6.0).reshape(2, 3), "b": {"kernel": jnp.array([0.5, -2.0, 3.0])}}
    _, _, metrics = _step(params, optimizer, opt_state, grads, jnp.float32(1.0))
    assert float(metrics["grad_norm"]) == float(optax.tree.norm(grads))


def test_diverged_parameters_are_called_out():
    params = {"w": jnp.array([1.0, -5e29])}
    message = describe_non_finite(3, {"non_finite_leaf": 0, "loss": float("nan")}, ["loss"], {}, params, 2, [])
    assert "largest |parameter| before this step: 5e+29 in params/w" in message
    assert "already diverging" in message and "checkpoint (step 2)" in message


def test_checkpoint_refuses_non_finite_optimizer_state(tmp_path):
    params, optimizer, opt_state = _setup()
    adam = opt_state[0]
    bad = (adam._replace(nu=jax.tree.map(lambda x: jnp.full_like(x, jnp.inf), adam.nu)), *opt_state[1:])
    with Checkpointer(tmp_path / "ckpt", save_interval_steps=1) as ckpt:
        with pytest.raises(NonFiniteStateError, match=r"opt_state\['0/nu/a'\] is not finite"):
            ckpt.save_if_finite(1, loss=1.0, params=params, opt_state=bad)
        assert ckpt.all_steps() == []
