"""grouped_matmul: values and both gradients of the TPU (Mosaic) and GPU (Triton) kernels equal `ragged_dot`'s
(interpret mode on CPU), with empty groups, rows past sum(group_sizes), a device's share of the groups
(group_offset) and shapes that are not multiples of the tiles; the tiling choice; and the kernels compiled
ahead of time at GLM-5's expert shapes for TPU v5p / v6e and for H100 / H200."""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from aot_compile import SCOPED_VMEM_LIMIT, chip_sharding, compile_for, mosaic_vmem_bytes
from gpu_compile import lower_for, require_cuda_plugin

from glm5_jax.parallel.hlo_stats import hlo_stats
from pallas_kernels import grouped_matmul
from pallas_kernels._grouped_rows import visited_rows
from pallas_kernels.gpu_grouped_matmul import choose_gpu_tiling
from pallas_kernels.grouped_matmul import grouped_matmul_reference, kernel_rows
from pallas_kernels._common import round_up
from pallas_kernels.tpu_grouped_matmul import (MOSAIC_SCRATCH, VMEM_BUDGET, GroupedTiles, choose_tiles,
                                              declared_costs, gmm_hbm_bytes, gmm_vmem_bytes, tgmm_hbm_bytes,
                                              tgmm_vmem_bytes, vmem_budget)

# name: (M, K, N, group_sizes, held groups (offset, count) or None, tiling limit)
CASES = {
    # 157 of 200 rows in groups (the rest padding), an empty group; one tile in each dim after padding.
    "padding_rows": (200, 72, 40, (30, 0, 50, 17, 60), None, None),
    # 128-tiles: groups cross row-tile boundaries, K and N span several (partial) tiles, an empty last group.
    "several_tiles": (300, 260, 200, (0, 130, 41, 120, 0), None, (128, 128, 128)),
    # The device holds groups [2, 5) of 7: rows of groups 0, 1, 5, 6 and the padding rows give zeros.
    "group_offset": (190, 136, 130, (25, 10, 40, 0, 33, 20, 30), (2, 3), (128, 128, 128)),
}
TOLERANCE = {jnp.float32: dict(rtol=2e-5, atol=2e-5), jnp.bfloat16: dict(rtol=3e-2, atol=3e-2)}


def _inputs(case, dtype):
    m, k, n, sizes, held, _ = CASES[case]
    rng = np.random.RandomState(len(case))
    offset, count = held or (0, len(sizes))
    lhs = jnp.asarray(rng.randn(m, k), dtype)
    rhs = jnp.asarray(rng.randn(count, k, n) / np.sqrt(k), dtype)
    d_out = jnp.asarray(rng.randn(m, n), dtype)  # nonzero on every row, padding rows included
    return lhs, rhs, jnp.asarray(sizes, jnp.int32), (None if held is None else offset), d_out


def _value_and_grads(fn, lhs, rhs, d_out):
    out, vjp = jax.vjp(fn, lhs, rhs)
    return (out, *vjp(d_out))


def _as_f32(x):
    return np.asarray(x.astype(jnp.float32))


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16], ids=["f32", "bf16"])
@pytest.mark.parametrize("case", sorted(CASES))
@pytest.mark.parametrize("platform", ["tpu", "gpu"])
def test_kernels_equal_ragged_dot_in_values_and_both_gradients(platform, case, dtype):
    lhs, rhs, sizes, offset, d_out = _inputs(case, dtype)
    tiling = CASES[case][5]
    # The rows the groups fill, as a caller expecting them declares (the kernels' cost only, never a value).
    filled = int(np.sum(np.asarray(sizes)))
    kernel = lambda a, b: grouped_matmul(a, b, sizes, group_offset=offset, platform=platform,  # noqa: E731
                                         interpret=True, tiling=tiling, expected_rows=filled)
    reference = lambda a, b: grouped_matmul_reference(a, b, sizes, group_offset=offset)  # noqa: E731
    got = jax.jit(lambda a, b, d: _value_and_grads(kernel, a, b, d))(lhs, rhs, d_out)
    want = jax.jit(lambda a, b, d: _value_and_grads(reference, a, b, d))(lhs, rhs, d_out)
    for name, g, w in zip(("out", "d_lhs", "d_rhs"), got, want):
        assert g.dtype == w.dtype and g.shape == w.shape, name
        np.testing.assert_allclose(_as_f32(g), _as_f32(w), err_msg=name, **TOLERANCE[dtype])
    # Rows outside the held groups: zero output and zero input gradient, whatever their cotangent.
    bounds = np.concatenate([[0], np.cumsum(np.asarray(sizes))])
    first, count = (offset or 0), rhs.shape[0]
    outside = np.ones(lhs.shape[0], bool)
    outside[bounds[first]:bounds[first + count]] = False
    assert outside.any()
    assert not np.any(_as_f32(got[0])[outside]) and not np.any(_as_f32(got[1])[outside])


@pytest.mark.parametrize("case", ["padding_rows", "group_offset"])
def test_rows_outside_the_groups_may_be_left_undefined(case):
    """`zero_outside=False` (the TPU kernels): the held groups' rows of the output and the input gradient, and the
    weight gradient, are the reference's even when the rows outside hold NaN and get NaN cotangents (tgmm
    selects the groups' rows); the rows outside are whatever the kernels leave."""
    lhs, rhs, sizes, offset, d_out = _inputs(case, jnp.float32)
    bounds = np.concatenate([[0], np.cumsum(np.asarray(sizes))])
    first = offset or 0
    inside = np.zeros(lhs.shape[0], bool)
    inside[bounds[first]:bounds[first + rhs.shape[0]]] = True
    lhs = jnp.where(jnp.asarray(inside)[:, None], lhs, jnp.nan)
    d_out = jnp.where(jnp.asarray(inside)[:, None], d_out, jnp.nan)
    kernel = lambda a, b: grouped_matmul(a, b, sizes, group_offset=offset, platform="tpu",  # noqa: E731
                                         interpret=True, tiling=CASES[case][5], zero_outside=False)
    reference = lambda a, b: grouped_matmul_reference(a, b, sizes, group_offset=offset)  # noqa: E731
    got = jax.jit(lambda a, b, d: _value_and_grads(kernel, a, b, d))(lhs, rhs, d_out)
    want = jax.jit(lambda a, b, d: _value_and_grads(reference, a, b, jnp.nan_to_num(d)))(
        jnp.nan_to_num(lhs), rhs, d_out)
    for name, g, w in zip(("out", "d_lhs"), got, want):
        np.testing.assert_allclose(_as_f32(g)[inside], _as_f32(w)[inside], err_msg=name, **TOLERANCE[jnp.float32])
    np.testing.assert_allclose(_as_f32(got[2]), _as_f32(want[2]), err_msg="d_rhs", **TOLERANCE[jnp.float32])


@pytest.mark.parametrize("rows", [437, 0])
def test_one_group_with_its_own_vmem_limit_runs_its_own_kernels(rows, monkeypatch):
    """One group of one, rows past it left undefined and a VMEM limit (the pod recipes' expert on v6e):
    `tpu_one_group_matmul`'s kernels, whose row-tile grid covers the active tiles only. The group's rows of the
    output and the input gradient, and the weight gradient, equal the reference's with NaN rows and cotangents
    past the group (4 row tiles of 128 for 437 rows, the last partial; K and N over several tiles); no rows: a
    zero weight gradient."""
    import pallas_kernels.tpu_grouped_matmul as tpu_module

    calls = []
    one_group = tpu_module.one_group_matmul
    monkeypatch.setattr(tpu_module, "one_group_matmul", lambda *a: calls.append(1) or one_group(*a))
    m, k, n = 600, 260, 200
    rng = np.random.RandomState(3)
    inside = np.arange(m) < rows
    lhs = jnp.where(inside[:, None], jnp.asarray(rng.randn(m, k), jnp.float32), jnp.nan)
    rhs = jnp.asarray(rng.randn(1, k, n) / np.sqrt(k), jnp.float32)
    d_out = jnp.where(inside[:, None], jnp.asarray(rng.randn(m, n), jnp.float32), jnp.nan)
    sizes = jnp.array([rows], jnp.int32)
    kernel = lambda a, b: grouped_matmul(a, b, sizes, platform="tpu", interpret=True,  # noqa: E731
                                         tiling=(128, 128, 128), zero_outside=False, vmem_limit=96 * 2**20)
    reference = lambda a, b: grouped_matmul_reference(a, b, sizes)  # noqa: E731
    got = jax.jit(lambda a, b, d: _value_and_grads(kernel, a, b, d))(lhs, rhs, d_out)
    want = jax.jit(lambda a, b, d: _value_and_grads(reference, a, b, d))(jnp.nan_to_num(lhs), rhs,
                                                                         jnp.nan_to_num(d_out))
    assert calls
    for name, g, w in zip(("out", "d_lhs"), got, want):
        np.testing.assert_allclose(_as_f32(g)[inside], _as_f32(w)[inside], err_msg=name, **TOLERANCE[jnp.float32])
    np.testing.assert_allclose(_as_f32(got[2]), _as_f32(want[2]), err_msg="d_rhs", **TOLERANCE[jnp.float32])
    assert rows or not np.any(_as_f32(got[2]))


def test_reference_with_group_offset_is_each_rows_own_group():
    lhs, rhs, sizes, offset, _ = _inputs("group_offset", jnp.float32)
    got = np.asarray(grouped_matmul_reference(lhs, rhs, sizes, group_offset=offset))
    want = np.zeros(got.shape, np.float32)
    start = 0
    for group, size in enumerate(np.asarray(sizes)):
        if offset <= group < offset + rhs.shape[0]:
            want[start:start + size] = np.asarray(lhs)[start:start + size] @ np.asarray(rhs)[group - offset]
        start += size
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("platform", ["tpu", "gpu"])
def test_group_offset_may_be_traced(platform):
    lhs, rhs, sizes, offset, _ = _inputs("group_offset", jnp.float32)
    run = jax.jit(lambda o: grouped_matmul(lhs, rhs, sizes, group_offset=o, platform=platform, interpret=True,
                                           tiling=(128, 128, 128)))
    np.testing.assert_allclose(run(jnp.int32(offset)), grouped_matmul_reference(lhs, rhs, sizes, group_offset=offset),
                               rtol=2e-5, atol=2e-5)


def _kernel_bytes(m, k, n, groups, tiles, itemsize):
    """(HBM bytes, VMEM bytes) of the forward, input-gradient and weight-gradient kernels by megablox's cost model."""
    return ([gmm_hbm_bytes(m, k, n, groups, tiles.forward, itemsize),
             gmm_hbm_bytes(m, n, k, groups, tiles.input_grad, itemsize),
             tgmm_hbm_bytes(m, k, n, groups, tiles.weight_grad, itemsize)],
            [gmm_vmem_bytes(tiles.forward, itemsize), gmm_vmem_bytes(tiles.input_grad, itemsize),
             tgmm_vmem_bytes(tiles.weight_grad, itemsize)])


# (M, K, N, groups): 32 experts on a device (16384 rows), and the pod recipes' one expert per chip receiving 1.25x
# an even load of 4096 (v5p) or 2048 (v6e) tokens' 8 assignments; gate / up, then down.
EXPERT_SHAPES = [(16384, 6144, 2048, 32), (16384, 2048, 6144, 32), (40960, 6144, 2048, 1), (40960, 2048, 6144, 1),
                 (20480, 6144, 2048, 1)]
MAXTEXT_TILING = (512, 1024, 1024)


@pytest.mark.parametrize("m,k,n,groups", EXPERT_SHAPES)
@pytest.mark.parametrize("itemsize", [2, 4])
@pytest.mark.parametrize("chip", ["TPU v5", "TPU v6 lite"])
def test_each_kernels_tiles_divide_the_dims_and_fit_vmem(m, k, n, groups, itemsize, chip):
    budget = vmem_budget(chip)
    tiles = choose_tiles(m, k, n, groups, itemsize, budget=budget)
    rows = round_up(m, tiles.row_multiple)
    assert rows == round_up(m, tiles.forward[0])  # padded to the forward's row tile, which the others divide
    for (tm, tc, to), (c, o) in zip((tiles.forward, tiles.input_grad, tiles.weight_grad), ((k, n), (n, k), (k, n))):
        assert rows % tm == 0 and c % tc == 0 and o % to == 0
        assert 2 * (groups - 1) <= rows // tm or tm == 128  # groups starting mid-tile add at most half the tiles
    assert tiles.forward[0] == tiles.input_grad[0]
    for name in ("forward", "input_grad"):  # each step contracts at least 512 deep
        assert getattr(tiles, name)[1] >= 512
    assert max(_kernel_bytes(rows, k, n, groups, tiles, itemsize)[1]) <= budget


def test_the_vmem_budget_is_the_chips_default_scoped_vmem_less_mosaics_scratch():
    assert vmem_budget("TPU v6 lite") == 32 * 2**20 - MOSAIC_SCRATCH
    for kind in ("TPU v5", "TPU v5p", "TPU v5 lite", "TPU v4", None, "cpu"):  # jax names v5p "TPU v5"
        assert vmem_budget(kind) == VMEM_BUDGET == 16 * 2**20 - MOSAIC_SCRATCH


def _layer_bytes(m, k, n, groups, tiling=None, budget=VMEM_BUDGET) -> int:
    """HBM bytes of one layer's gate, up and down matmuls (bf16), forward and both gradients."""
    gate_up = choose_tiles(m, k, n, groups, 2, tiling, budget)
    down = choose_tiles(m, n, k, groups, 2, tiling, budget)
    return 2 * sum(_kernel_bytes(m, k, n, groups, gate_up, 2)[0]) + sum(_kernel_bytes(m, n, k, groups, down, 2)[0])


def test_per_kernel_tiles_move_fewer_bytes_than_maxtexts_tiles():
    # The pod recipes' one expert per chip (v5p-512: 40960 rows): 512-row tiles re-read a 25 MB weight tile
    # column 80 times per kernel; 1024-row tiles, 512 deep to fit, 23% fewer bytes.
    assert choose_tiles(40960, 6144, 2048, 1, 2) == GroupedTiles((1024, 512, 1024), (1024, 512, 1024),
                                                                  (512, 1024, 1024))
    assert _layer_bytes(40960, 6144, 2048, 1) == pytest.approx(20.21e9, rel=1e-3)
    assert _layer_bytes(40960, 6144, 2048, 1, MAXTEXT_TILING) == pytest.approx(26.25e9, rel=1e-3)
    # 32 experts on a device: the groups keep the row tile at 256 (as before); the gate / up forward's N tile of
    # 2048 reads the rows once: 5% fewer bytes than the 256 x 1024 x 1024 tiles chosen before.
    assert choose_tiles(16384, 6144, 2048, 32, 2).forward == (256, 768, 2048)
    assert _layer_bytes(16384, 6144, 2048, 32) == pytest.approx(21.19e9, rel=1e-3)
    assert _layer_bytes(16384, 6144, 2048, 32, (256, 1024, 1024)) == pytest.approx(22.40e9, rel=1e-3)
    # v6e's 32 MiB of scoped VMEM: the v6e recipe's expert (20480 rows) in wider tiles, 6.8 against 10.1 GB with the
    # 16 MiB chips' tiles.
    v6e = vmem_budget("TPU v6 lite")
    assert choose_tiles(20480, 6144, 2048, 1, 2, budget=v6e).forward == (1280, 512, 2048)
    assert _layer_bytes(20480, 6144, 2048, 1, budget=v6e) == pytest.approx(6.77e9, rel=1e-3)
    assert _layer_bytes(20480, 6144, 2048, 1) == pytest.approx(10.14e9, rel=1e-3)


def test_the_kernels_declare_the_row_tiles_the_expected_rows_take():
    """A grid visits the tiles holding rows, one more per group boundary inside a tile, never past the buffer."""
    assert visited_rows(40960, 1024, 1, None) == 40960  # no expectation: the whole buffer
    assert visited_rows(40960, 1024, 1, 32768) == 32768  # whole tiles
    assert visited_rows(40960, 1024, 1, 32769) == 33792  # a started tile is computed whole
    assert visited_rows(40960, 1024, 4, 32768) == 32768 + 3 * 1024  # three boundaries may split tiles
    assert visited_rows(40960, 1024, 32, 40000) == 40960  # capped at the buffer


@pytest.mark.parametrize("chip", ["TPU v5", "TPU v6 lite"])
def test_kernel_rows_are_the_rows_the_kernels_pad_to(chip):
    """`kernel_rows` is the row count the TPU kernels pad lhs to (no copy at that count); other platforms pad
    nothing. 22,400 rows (v6e's receive buffer with blocks' padding) pad to 18 of v6e's 1280-row tiles."""
    for m, k, n in ((22400, 6144, 2048), (22400, 2048, 6144), (20480, 6144, 2048), (1000, 256, 384)):
        rows = kernel_rows(m, k, n, 1, jnp.bfloat16, platform="tpu", device_kind=chip)
        tiles = choose_tiles(round_up(m, 128), k, n, 1, 2, budget=vmem_budget(chip))
        assert rows == round_up(m, tiles.row_multiple) >= m
        assert kernel_rows(m, k, n, 1, jnp.bfloat16, platform="gpu") == m
    v6e = kernel_rows(22400, 6144, 2048, 1, jnp.bfloat16, platform="tpu", device_kind="TPU v6 lite")
    assert v6e == 23040


def test_a_given_tiling_is_clamped_to_the_dims_and_shared_by_the_three_kernels():
    groups = 32
    assert choose_tiles(128, 256, 384, 8, 2, (512, 1024, 1024)) == GroupedTiles(
        (128, 256, 384), (128, 384, 256), (128, 256, 384))  # small dims: one tile each
    assert choose_tiles(256, 384, 640, groups, 2, (512, 1024, 256)).forward == (256, 384, 128)  # divisors
    assert choose_tiles(16384, 6144, 2048, groups, 4, (512, 1024, 1024)).weight_grad == (512, 1024, 1024)


def test_gpu_tiles_are_powers_of_two_clamped_to_the_dims_and_shared_memory():
    assert choose_gpu_tiling(16384, 6144, 2048, 2) == (128, 64, 128)
    assert choose_gpu_tiling(20, 5, 40, 2) == (32, 16, 64)
    assert choose_gpu_tiling(16384, 6144, 2048, 2, (100, 300, 64)) == (64, 256, 64)
    # fp32 [256, 128] x [128, 128] tiles with their fp32 output exceed sm_90's 227 KiB: the row tile halves.
    assert choose_gpu_tiling(16384, 6144, 2048, 4, (256, 128, 128)) == (128, 128, 128)


@pytest.mark.parametrize("kwargs,message", [
    (dict(lhs=jnp.zeros((4, 3)), rhs=jnp.zeros((2, 5, 6))), "lhs K=3 differs from rhs K=5"),
    (dict(lhs=jnp.zeros((4, 5), jnp.bfloat16), rhs=jnp.zeros((2, 5, 6))), "share one dtype"),
    (dict(lhs=jnp.zeros((4, 5), jnp.int32), rhs=jnp.zeros((2, 5, 6), jnp.int32)), "share one dtype"),
    (dict(lhs=jnp.zeros((4, 5)), rhs=jnp.zeros((2, 5, 6)), group_sizes=jnp.zeros((3,), jnp.int32)),
     "pass group_offset"),
    (dict(lhs=jnp.zeros((4, 5)), rhs=jnp.zeros((2, 5, 6)), group_sizes=jnp.zeros((2,))), "int32"),
    (dict(lhs=jnp.zeros((4, 5)), rhs=jnp.zeros((2, 5, 6)), platform="npu"), "platform must be one of"),
    (dict(lhs=jnp.zeros((4, 5)), rhs=jnp.zeros((2, 5, 6)), tiling=(128, 0, 128)), "tiling must be"),
    (dict(lhs=jnp.zeros((4, 5)), rhs=jnp.zeros((2, 5, 6)), device_kind=6), "device_kind must be None or"),
    (dict(lhs=jnp.zeros((4, 5)), rhs=jnp.zeros((2, 5, 6)), group_offset=jnp.zeros((1,), jnp.int32)),
     "group_offset must be an int or an integer scalar"),
    (dict(lhs=jnp.zeros((4, 5)), rhs=jnp.zeros((2, 5, 6)), group_sizes=jnp.zeros((3,), jnp.int32), group_offset=2),
     r"group_offset=2 is out of range: rhs holds 2 of 3 groups, so it must be in \[0, 1\]"),
    (dict(lhs=jnp.zeros((4, 5)), rhs=jnp.zeros((2, 5, 6)), expected_rows=5),
     r"expected_rows must be None \(every row\) or an int in \[1, 4\] \(lhs's rows\); got 5"),
    (dict(lhs=jnp.zeros((4, 5)), rhs=jnp.zeros((2, 5, 6)), expected_rows=2.0), "expected_rows must be None"),
])
def test_invalid_inputs_are_refused_naming_the_field(kwargs, message):
    kwargs.setdefault("group_sizes", jnp.zeros((kwargs["rhs"].shape[0],), jnp.int32))
    with pytest.raises(ValueError, match=message):
        grouped_matmul(kwargs.pop("lhs"), kwargs.pop("rhs"), kwargs.pop("group_sizes"), **kwargs)


# GLM-5's routed experts on one device holding 32 of them: 16384 rows, hidden 6144, expert width 2048.
GLM5_EXPERTS = dict(m=16384, k=6144, n=2048, groups=32)
# The v5p-512 recipe's one expert per chip: 1.25x an even load of one 4096-token sequence's 8 assignments.
POD_EXPERT = dict(m=40960, k=6144, n=2048, groups=1)


def glm5_forward_and_gradients(dtype, platform, experts=GLM5_EXPERTS, device_kind=None, vmem_limit=None,
                               expected_rows=None):
    """(function of lhs, rhs, group_sizes, d_out -> out, d_lhs, d_rhs; its abstract arguments). With `vmem_limit`
    the rows past the groups are left undefined (the pod recipes' one expert per chip)."""
    m, k, n, g = experts["m"], experts["k"], experts["n"], experts["groups"]

    def forward_and_gradients(lhs, rhs, sizes, d_out):
        return _value_and_grads(lambda a, b: grouped_matmul(a, b, sizes, platform=platform, device_kind=device_kind,
                                                            vmem_limit=vmem_limit, zero_outside=vmem_limit is None,
                                                            expected_rows=expected_rows),
                                lhs, rhs, d_out)

    sds = jax.ShapeDtypeStruct
    return forward_and_gradients, (sds((m, k), dtype), sds((g, k, n), dtype), sds((g,), jnp.int32),
                                   sds((m, n), dtype))


def declared_kernel_costs(hlo_text: str) -> list[tuple[str, int, int]]:
    """(JAX operation, FLOPs, HBM bytes) of each Mosaic kernel: the operation is the custom call's metadata op_name
    less its outer jit and "/pallas_call", the FLOPs and bytes its declared cost estimate (in backend_config)."""
    costs = []
    for line in hlo_text.splitlines():
        if 'custom_call_target="tpu_custom_call"' in line:
            op_name = re.search(r'op_name="([^"]+)"', line).group(1)
            cost = re.search(r'"cost_estimate":\{"flops":"(\d+)"[^}]*"bytes_accessed":"(\d+)"', line)
            costs.append((op_name.split("/")[-2], int(cost.group(1)), int(cost.group(2))))
    return sorted(costs)


@pytest.mark.slow
@pytest.mark.tpu_aot
# The largest tiles of each chip (one expert per chip: 13.4 MiB of v5p's 16, 28.2 of v6e's 32) and, on v5p, the
# 256-row tiles of 32 experts per device. The pod expert's buffer holds 1.25x an even load, which the caller
# expects (32,768 rows), so the kernels declare the work of those rows' tiles.
@pytest.mark.parametrize("chip, experts, expected_rows", [("v5p", GLM5_EXPERTS, None), ("v5p", POD_EXPERT, 32768),
                                                          ("v6e", POD_EXPERT, 32768)],
                         ids=["v5p-32_experts", "v5p-pod_expert", "v6e-pod_expert"])
def test_tpu_kernels_compile_at_glm5_expert_shapes(chip, experts, expected_rows):
    device_kind = chip_sharding(chip).mesh.devices.flat[0].device_kind  # tiled for the chip, as the model does
    fn, args = glm5_forward_and_gradients(jnp.bfloat16, "tpu", experts, device_kind, expected_rows=expected_rows)
    compiled = compile_for(fn, args, chip)
    text = compiled.as_text()
    vmem = mosaic_vmem_bytes(compiled)
    # Within the chip's default scoped VMEM (megablox sets no limit): 16 MiB on v5p, 32 MiB on v6e.
    assert len(vmem) == 3 and max(vmem) < vmem_budget(device_kind) + MOSAIC_SCRATCH, vmem
    if chip == "v5p":
        assert max(vmem) < SCOPED_VMEM_LIMIT
    m, k, n, g = experts.values()
    # Forward gmm, input gradient gmm (transposed), weight gradient tgmm: each declares 2*M*K*N, and the HBM bytes
    # the tile choice minimised (its cost model is megablox's own).
    tiles = choose_tiles(m, k, n, g, 2, budget=vmem_budget(device_kind))
    assert declared_kernel_costs(text) == [
        ("jvp(jit(gmm))", 2 * m * k * n, gmm_hbm_bytes(m, k, n, g, tiles.forward, 2)),
        ("transpose(jvp(jit(gmm)))", 2 * m * k * n, gmm_hbm_bytes(m, n, k, g, tiles.input_grad, 2)),
        ("transpose(jvp(jit(tgmm)))", 2 * m * k * n, tgmm_hbm_bytes(m, k, n, g, tiles.weight_grad, 2))]
    # What the counter takes: the caller's declared cost before megablox's, over the row tiles the expected rows
    # take (v5p's 1024-row tiles hold 32,768 rows whole; v6e's 1280-row gmm tiles take 33,280), else megablox's.
    counted = hlo_stats(text, 1).kernel_flops
    assert counted == sum(flops for flops, _ in declared_costs(m, k, n, g, tiles, 2, expected_rows))
    rows = [visited_rows(m, t[0], g, expected_rows) for t in (tiles.forward, tiles.input_grad, tiles.weight_grad)]
    assert counted == 2 * sum(rows) * k * n
    assert rows == ([m] * 3 if expected_rows is None else [32768] * 3 if chip == "v5p" else [33280, 33280, 32768])
    assert not re.search(r"%ragged-dot", text)  # XLA:TPU's ragged-dot custom calls and their metadata
    assert not re.search(rf"\[{g},{m},", text) and not re.search(rf"\[{m},{g},", text)  # no [G, M, ...] expansion


@pytest.mark.slow
@pytest.mark.tpu_aot
def test_the_one_group_kernels_take_their_own_vmem_limit_on_v6e():
    """The v6e recipe's gate and up projection (`model.moe_kernel_vmem_mib: 96`: 23,040 received rows, [6144,
    4096] weights, one expert; 18,304 of them expected: an even load and the blocks' padding): `tpu_one_group_matmul`'s
    kernels compile with more than the chip's default 32 MiB of scoped VMEM, within their own 96, in a program
    compiled with no option, and the three move over 20% fewer HBM bytes than megablox's at the default (larger row
    tiles re-read the weights fewer times), as declared over the expected rows' tiles. The weight gradient's stays
    within the default 32 (module docstring of `tpu_one_group_matmul`)."""
    limit, expected = 96 * 2**20, 18304
    experts = dict(m=23040, k=6144, n=4096, groups=1)
    device_kind = chip_sharding("v6e").mesh.devices.flat[0].device_kind
    fn, args = glm5_forward_and_gradients(jnp.bfloat16, "tpu", experts, device_kind, vmem_limit=limit,
                                          expected_rows=expected)
    compiled = compile_for(fn, args, "v6e")
    vmem = mosaic_vmem_bytes(compiled)
    # The weight gradient's kernel within the default (XLA may fuse it into a dynamic update slice, which gets it).
    assert len(vmem) == 3 and 32 * 2**20 < max(vmem) < limit and min(vmem) < 32 * 2**20, vmem
    m, k, n, g = experts.values()

    def declared(budget):
        tiles = choose_tiles(m, k, n, g, 2, budget=budget, weight_grad_budget=vmem_budget(device_kind))
        return declared_costs(m, k, n, g, tiles, 2, expected), tiles

    costs, tiles = declared(vmem_budget(device_kind, limit))
    compiled_costs = declared_kernel_costs(compiled.as_text())
    assert sorted(flops for _, flops, _ in compiled_costs) == sorted(flops for flops, _ in costs)
    # Each kernel over the row tiles the expected rows take, fewer than the buffer's.
    assert all(flops == 2 * visited_rows(m, t[0], 1, expected) * k * n < 2 * m * k * n
               for flops, t in zip((f for f, _ in costs), (tiles.forward, tiles.input_grad, tiles.weight_grad)))
    moved = sum(accessed for _, _, accessed in compiled_costs)
    assert moved == sum(accessed for _, accessed in costs)
    assert moved < 0.8 * sum(accessed for _, accessed in declared(vmem_budget(device_kind))[0])


@pytest.mark.gpu_aot
@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float32], ids=["bf16", "f32"])
@pytest.mark.parametrize("gpu", ["h100", "h200"])
def test_gpu_kernels_compile_at_glm5_expert_shapes(gpu, dtype):
    require_cuda_plugin()
    fn, args = glm5_forward_and_gradients(dtype, "gpu")
    text = lower_for(fn, args, gpu).compile().as_text()  # kept out of the persistent cache (tests/conftest.py)
    kernels = sorted(re.search(r'op_name="[^"]*/([^"/]+)/pallas_call"', line).group(1)
                     for line in text.splitlines() if 'custom_call_target="__gpu$xla.gpu.triton"' in line)
    assert kernels == ["jvp(grouped_matmul)", "transpose(jvp(grouped_matmul_input_grad))",
                       "transpose(jvp(grouped_matmul_weight_grad))"], kernels
    m, g = GLM5_EXPERTS["m"], GLM5_EXPERTS["groups"]
    assert "ragged-dot" not in text
    assert not re.search(rf"\[{g},{m},", text) and not re.search(rf"\[{m},{g},", text)
