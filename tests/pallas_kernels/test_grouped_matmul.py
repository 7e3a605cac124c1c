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
from aot_compile import CHIPS, SCOPED_VMEM_LIMIT, compile_for, mosaic_vmem_bytes
from gpu_compile import compile_lowered, lower_for, require_cuda_plugin

from pallas_kernels import grouped_matmul
from pallas_kernels.gpu_grouped_matmul import choose_gpu_tiling
from pallas_kernels.grouped_matmul import grouped_matmul_reference
from pallas_kernels.tpu_grouped_matmul import VMEM_BUDGET, _vmem_bytes, choose_tiling

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
    kernel = lambda a, b: grouped_matmul(a, b, sizes, group_offset=offset, platform=platform,  # noqa: E731
                                         interpret=True, tiling=tiling)
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


def test_glm5_tiling_fits_vmem_and_bounds_the_row_tiles_groups_add():
    m, k, n, groups = 16384, 6144, 2048, 32
    for itemsize in (2, 4):
        for dims in ((m, k, n), (m, n, k)):  # gate / up, then down
            tm, tk, tn = choose_tiling(*dims, groups, itemsize)
            assert dims[0] % tm == 0 and dims[1] % tk == 0 and dims[2] % tn == 0
            assert _vmem_bytes(tm, tk, tn, itemsize) <= VMEM_BUDGET
            assert 2 * (groups - 1) <= m // tm  # groups starting mid-tile add at most half the tiles
    assert choose_tiling(m, k, n, groups, 2) == (256, 1024, 1024)
    assert choose_tiling(m, k, n, 1, 2) == (512, 1024, 1024)  # MaxText's tiles when nothing shrinks them
    assert choose_tiling(128, 256, 384, 8, 2) == (128, 256, 384)  # small dims: one tile each
    assert choose_tiling(m, k, n, groups, 4, (512, 1024, 1024)) == (512, 1024, 1024)  # given: used as it is
    assert choose_tiling(256, 384, 640, groups, 2, (512, 1024, 256)) == (256, 384, 128)  # clamped to divisors


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
    (dict(lhs=jnp.zeros((4, 5)), rhs=jnp.zeros((2, 5, 6)), group_offset=jnp.zeros((1,), jnp.int32)),
     "group_offset must be an int or an integer scalar"),
    (dict(lhs=jnp.zeros((4, 5)), rhs=jnp.zeros((2, 5, 6)), group_sizes=jnp.zeros((3,), jnp.int32), group_offset=2),
     r"group_offset=2 is out of range: rhs holds 2 of 3 groups, so it must be in \[0, 1\]"),
])
def test_invalid_inputs_are_refused_naming_the_field(kwargs, message):
    kwargs.setdefault("group_sizes", jnp.zeros((kwargs["rhs"].shape[0],), jnp.int32))
    with pytest.raises(ValueError, match=message):
        grouped_matmul(kwargs.pop("lhs"), kwargs.pop("rhs"), kwargs.pop("group_sizes"), **kwargs)


# GLM-5's routed experts on one device holding 32 of them: 16384 rows, hidden 6144, expert width 2048.
GLM5_EXPERTS = dict(m=16384, k=6144, n=2048, groups=32)


def glm5_forward_and_gradients(dtype, platform):
    """(function of lhs, rhs, group_sizes, d_out -> out, d_lhs, d_rhs; its abstract arguments)."""
    m, k, n, g = GLM5_EXPERTS["m"], GLM5_EXPERTS["k"], GLM5_EXPERTS["n"], GLM5_EXPERTS["groups"]

    def forward_and_gradients(lhs, rhs, sizes, d_out):
        return _value_and_grads(lambda a, b: grouped_matmul(a, b, sizes, platform=platform), lhs, rhs, d_out)

    sds = jax.ShapeDtypeStruct
    return forward_and_gradients, (sds((m, k), dtype), sds((g, k, n), dtype), sds((g,), jnp.int32),
                                   sds((m, n), dtype))


def declared_kernel_flops(hlo_text: str) -> list[tuple[str, int]]:
    """(JAX operation, FLOPs) of each Mosaic kernel: the operation is the custom call's metadata op_name
    less its outer jit and "/pallas_call", the FLOPs its declared cost estimate (in backend_config)."""
    flops = []
    for line in hlo_text.splitlines():
        if 'custom_call_target="tpu_custom_call"' in line:
            op_name = re.search(r'op_name="([^"]+)"', line).group(1)
            cost = re.search(r'"cost_estimate":\{"flops":"(\d+)"', line).group(1)
            flops.append((op_name.split("/")[-2], int(cost)))
    return sorted(flops)


@pytest.mark.slow
@pytest.mark.tpu_aot
@pytest.mark.parametrize("chip", CHIPS)
def test_tpu_kernels_compile_at_glm5_expert_shapes(chip):
    fn, args = glm5_forward_and_gradients(jnp.bfloat16, "tpu")
    compiled = compile_for(fn, args, chip)
    text = compiled.as_text()
    vmem = mosaic_vmem_bytes(compiled)
    assert len(vmem) == 3 and max(vmem) < SCOPED_VMEM_LIMIT, vmem
    m, k, n, g = GLM5_EXPERTS.values()
    # Forward gmm, input gradient gmm (transposed), weight gradient tgmm: each declares 2*M*K*N.
    assert declared_kernel_flops(text) == [("jvp(jit(gmm))", 2 * m * k * n),
                                           ("transpose(jvp(jit(gmm)))", 2 * m * k * n),
                                           ("transpose(jvp(jit(tgmm)))", 2 * m * k * n)]
    assert not re.search(r"%ragged-dot", text)  # XLA:TPU's ragged-dot custom calls and their metadata
    assert not re.search(rf"\[{g},{m},", text) and not re.search(rf"\[{m},{g},", text)  # no [G, M, ...] expansion


@pytest.mark.gpu_aot
@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float32], ids=["bf16", "f32"])
@pytest.mark.parametrize("gpu", ["h100", "h200"])
def test_gpu_kernels_compile_at_glm5_expert_shapes(gpu, dtype):
    require_cuda_plugin()
    fn, args = glm5_forward_and_gradients(dtype, "gpu")
    # Kept out of the persistent cache (`compile_lowered`): a GPU executable compiled without a GPU cannot be read
    # back from it.
    text = compile_lowered(lower_for(fn, args, gpu)).as_text()
    kernels = sorted(re.search(r'op_name="[^"]*/([^"/]+)/pallas_call"', line).group(1)
                     for line in text.splitlines() if 'custom_call_target="__gpu$xla.gpu.triton"' in line)
    assert kernels == ["jvp(grouped_matmul)", "transpose(jvp(grouped_matmul_input_grad))",
                       "transpose(jvp(grouped_matmul_weight_grad))"], kernels
    m, g = GLM5_EXPERTS["m"], GLM5_EXPERTS["groups"]
    assert "ragged-dot" not in text
    assert not re.search(rf"\[{g},{m},", text) and not re.search(rf"\[{m},{g},", text)
