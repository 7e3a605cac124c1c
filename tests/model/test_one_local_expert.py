"""With one routed expert per device (the pod recipes: `expert` x `context` = n_routed_experts), the received
rows of the `ep` dispatch are already in expert order, filled rows first, so `_run_local_experts` runs the grouped
matmuls on the receive buffer as it is: the same values and gradients as sorting it (the identity permutation),
without the gather and scatter of the [R, D] buffer. With rows in blocks (TPU meshes) each source's chunk is
followed by the zero rows that pad it to whole blocks: the expert's group then runs up to the last filled row,
padding included, which gives zero rows."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from glm5_jax.model import expert_parallel
from glm5_jax.model.expert_parallel import _row_experts, _run_local_experts, dispatch_layout, receive_plan
from glm5_jax.model.experts import grouped_swiglu

SOURCES, TOKENS, TOP_K, D, F = 4, 6, 2, 16, 8
LAYOUT = dispatch_layout(TOKENS, TOP_K, SOURCES, SOURCES, 1.25)  # 4 experts over 4 devices: one each
BLOCKED = dispatch_layout(TOKENS, TOP_K, SOURCES, SOURCES, 1.25, row_block=4)  # chunks padded to blocks of 4 rows


def _received(seed: int, layout=LAYOUT):
    """A receiver's row experts for random chunk sizes (some sources over capacity), and a receive buffer
    whose empty rows are zero, as the exchange leaves them."""
    rng = np.random.RandomState(seed)
    sent = jnp.asarray(rng.randint(0, TOKENS * TOP_K // 2, size=(SOURCES, 1)), jnp.int32)
    accepted, _ = receive_plan(-(-sent // layout.row_block), layout.receive_blocks)
    expert = _row_experts(sent, accepted[:, 0], layout)
    filled = (expert < 1)[:, None]
    recv = jnp.where(filled, jnp.asarray(rng.randn(layout.receive_rows, D), jnp.float32), 0.0)
    return recv, expert


def _experts(seed: int) -> dict:
    keys = jax.random.split(jax.random.key(seed), 3)
    return {"gate_proj": jax.random.normal(keys[0], (1, D, F)), "up_proj": jax.random.normal(keys[1], (1, D, F)),
            "down_proj": jax.random.normal(keys[2], (1, F, D))}


def _weights(expert, seed: int):
    """Routing weights of the received rows; 0 on empty rows, as the exchange leaves them."""
    w = jnp.asarray(np.random.RandomState(seed + 100).uniform(0.1, 1.0, expert.shape[0]), jnp.float32)
    return jnp.where(expert < 1, w, 0.0)


def _sorted_path(experts, recv, weights, expert):
    """The general path: sort the rows by expert, grouped matmuls of the weighted rows, scatter back, empty rows
    zero."""
    order = jnp.argsort(expert, stable=True)
    group_sizes = jnp.bincount(expert, length=1).astype(jnp.int32)
    out_sorted = grouped_swiglu(experts, recv[order], group_sizes, "cpu", row_weights=weights[order])
    mask = (expert < 1)[order][:, None].astype(out_sorted.dtype)
    return jnp.zeros_like(recv).at[order].set(out_sorted * mask, unique_indices=True)


@pytest.fixture
def cpu_grouped_matmuls(monkeypatch):
    """The device path (`platform` "tpu") with the grouped matmuls `ragged_dot` runs on CPU."""
    monkeypatch.setattr(expert_parallel, "grouped_swiglu",
                        lambda e, x, g, platform, row_weights=None, **_: grouped_swiglu(e, x, g, "cpu",
                                                                                         row_weights=row_weights))


def test_received_rows_are_filled_first_in_expert_order():
    assert LAYOUT.local_experts == 1
    for seed in range(20):
        _, expert = _received(seed)
        filled = np.asarray(expert) < 1
        assert np.array_equal(np.sort(np.asarray(expert), kind="stable"), np.asarray(expert)), expert
        assert filled.sum() == 0 or filled[: filled.sum()].all()


def test_blocked_chunks_are_their_rows_then_padding_to_whole_blocks():
    """Source by source, as the hand count gives it: the rows that fit (whole blocks of the receive buffer, in
    rank order), then empty rows up to the chunk's last block; nothing after the last chunk."""
    g = BLOCKED.row_block
    for seed in range(20):
        rng = np.random.RandomState(seed)
        sent = rng.randint(0, TOKENS * TOP_K // 2, size=SOURCES)
        accepted, _ = receive_plan(jnp.asarray(-(-sent // g))[:, None], BLOCKED.receive_blocks)
        want, free = [], BLOCKED.receive_blocks
        for rows in sent:
            blocks = min(-(-rows // g), free)
            free -= blocks
            kept = min(rows, g * blocks)
            want += [0] * kept + [1] * (g * blocks - kept)
        want += [1] * (BLOCKED.receive_rows - len(want))
        expert = _row_experts(jnp.asarray(sent)[:, None], accepted[:, 0], BLOCKED)
        assert np.asarray(expert).tolist() == want, (sent, expert)


@pytest.mark.parametrize("seed,layout", [(0, LAYOUT), (1, LAYOUT), (2, LAYOUT), (0, BLOCKED), (1, BLOCKED)])
def test_one_local_expert_equals_the_sorted_path_in_values_and_gradients(seed, layout, cpu_grouped_matmuls):
    recv, expert = _received(seed, layout)
    weights = _weights(expert, seed)
    experts = _experts(seed)
    probe = jnp.cos(jnp.arange(recv.size, dtype=jnp.float32)).reshape(recv.shape)

    def grads(fn):
        return jax.value_and_grad(lambda e, r, w: (fn(e, r, w) * probe).sum(), argnums=(0, 1, 2))(
            experts, recv, weights)

    (value, (d_experts, d_recv, d_weights)) = grads(lambda e, r, w: _run_local_experts(e, r, w, expert, layout, "tpu"))
    (ref_value, (ref_experts, ref_recv, ref_weights)) = grads(lambda e, r, w: _sorted_path(e, r, w, expert))
    np.testing.assert_allclose(value, ref_value, rtol=1e-6)
    np.testing.assert_allclose(d_recv, ref_recv, rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(d_weights, ref_weights, rtol=1e-6, atol=1e-6)
    assert np.abs(np.asarray(d_weights)[np.asarray(expert) < 1]).min() > 0  # every filled row's weight is learned
    for name in experts:
        np.testing.assert_allclose(d_experts[name], ref_experts[name], rtol=1e-6, atol=1e-6, err_msg=name)


def test_one_local_expert_moves_no_row_of_the_receive_buffer(cpu_grouped_matmuls):
    """No gather or scatter of [R, D] rows in the forward or the gradient (the sorted path has both)."""
    recv, expert = _received(0)
    weights = _weights(expert, 0)
    experts = _experts(0)

    def moves(fn):
        jaxpr = jax.make_jaxpr(jax.grad(lambda e, r: fn(e, r).sum(), argnums=(0, 1)))(experts, recv)
        shape = f"[{LAYOUT.receive_rows},{D}]"
        return [line for line in str(jaxpr).splitlines() if shape in line and ("gather" in line or "scatter" in line)]

    assert moves(lambda e, r: _sorted_path(e, r, weights, expert))
    assert not moves(lambda e, r: _run_local_experts(e, r, weights, expert, LAYOUT, "tpu"))


@pytest.mark.parametrize("layout", [LAYOUT, BLOCKED])
def test_rows_past_the_last_filled_one_reach_no_filled_row(layout, cpu_grouped_matmuls):
    """Rows past the last filled one are outside the expert's group: whatever they hold (the TPU kernels leave
    their outputs undefined, `zero_outside=False`, as the exchange never sends them back), the filled rows'
    outputs are the sorted path's."""
    recv, expert = _received(3, layout)
    weights = _weights(expert, 3)
    empty = np.asarray(expert) >= 1
    assert empty.any() and (~empty).any()
    past_last = np.arange(empty.size) > np.flatnonzero(~empty).max()
    assert past_last.any()
    garbage = jnp.where(jnp.asarray(past_last)[:, None], 7.0, recv)
    out = _run_local_experts(_experts(3), garbage, weights, expert, layout, "tpu")
    want = _sorted_path(_experts(3), recv, weights, expert)
    np.testing.assert_allclose(np.asarray(out)[~empty], np.asarray(want)[~empty], rtol=1e-6, atol=1e-6)


@pytest.mark.slow  # ~15 s of TPU interpret mode
def test_undefined_rows_past_the_received_ones_reach_nothing(monkeypatch):
    """On TPU the receive buffers are not zero-filled first (`ops.buffers.fill_buffer`): rows past the received
    ones hold whatever memory held. With NaN there (rows and routing weights), the one-expert kernels (TPU
    interpret mode) give the filled rows the values and gradients of the sorted path on clean buffers."""
    from glm5_jax.model import experts as experts_module
    from pallas_kernels.grouped_matmul import grouped_matmul as kernels

    def interpreted(x, w, sizes, platform, zero_outside, vmem_limit, expected_rows):
        return kernels(x, w, sizes, platform="tpu", interpret=True, zero_outside=zero_outside,
                       vmem_limit=vmem_limit, expected_rows=expected_rows)

    monkeypatch.setattr(experts_module, "grouped_matmul", interpreted)
    layout = dataclasses.replace(BLOCKED, kernel_vmem=32 * 2**20)
    recv, expert = _received(3, layout)
    weights = _weights(expert, 3)
    filled = np.asarray(expert) < 1
    past_last = jnp.asarray(np.arange(filled.size) > np.flatnonzero(filled).max())
    nan_recv = jnp.where(past_last[:, None], jnp.nan, recv)
    nan_weights = jnp.where(past_last, jnp.nan, weights)
    experts = _experts(3)
    probe = jnp.where(jnp.asarray(filled)[:, None], jnp.cos(jnp.arange(recv.size, dtype=jnp.float32)).reshape(
        recv.shape), 0.0)  # the exchange sends back only received rows: the rest get no cotangent

    def grads(fn, r, w):
        return jax.value_and_grad(lambda e, r, w: (jnp.where(probe != 0, fn(e, r, w), 0.0) * probe).sum(),
                                  argnums=(0, 1, 2))(experts, r, w)

    value, (d_experts, d_recv, d_weights) = grads(
        lambda e, r, w: _run_local_experts(e, r, w, expert, layout, "tpu"), nan_recv, nan_weights)
    ref_value, (ref_experts, ref_recv, ref_weights) = grads(
        lambda e, r, w: _sorted_path(e, r, w, expert), recv, weights)
    np.testing.assert_allclose(value, ref_value, rtol=1e-5)
    np.testing.assert_allclose(np.asarray(d_recv)[filled], np.asarray(ref_recv)[filled], rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(np.asarray(d_weights)[filled], np.asarray(ref_weights)[filled], rtol=1e-5, atol=1e-5)
    for name in experts:
        np.testing.assert_allclose(d_experts[name], ref_experts[name], rtol=1e-5, atol=1e-5, err_msg=name)
