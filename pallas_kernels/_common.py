"""Shared pieces of the DSA kernels: masking constant, padding, backend/platform choice, row gather, input checks.

Dimension letters: B batch, S query len, T key len, H heads, C kv latent, R rope dim, N top-k,
I indexer heads, J indexer head dim.
"""

from __future__ import annotations

import os

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental.pallas import tpu as pltpu
from jax.experimental.pallas import triton as plgpu

# Finite stand-in for -inf: a fully masked row must give a finite lse and 0 output, never NaN.
NEG_INF = -1e30

# Triton tensors need power-of-two sizes and tl.dot needs at least 16 rows/columns, so kernels see
# operands padded with zeros to these sizes (zero columns leave every dot product unchanged).
MIN_BLOCK = 16


def default_platform() -> str:
    """The platform computations go to when nothing places them: `jax.default_device`'s when one is set (the
    host CPU of a GPU machine under `jax.default_device(cpu)`), else the default backend."""
    device = jax.config.jax_default_device  # a Device, a platform name, or None
    if device is None:
        return jax.default_backend()
    return device if isinstance(device, str) else device.platform


def resolve_interpret(interpret: bool | None) -> bool:
    """None means: interpret on CPU (the only way Pallas runs there), compile elsewhere."""
    return default_platform() == "cpu" if interpret is None else bool(interpret)


PLATFORMS = ("gpu", "tpu")


def resolve_platform(platform: str | None) -> str:
    """Which kernels to build: "gpu" (Triton) or "tpu" (Mosaic); None = "tpu" when `default_platform` is a TPU,
    else "gpu"."""
    if platform is None:
        return "tpu" if default_platform() == "tpu" else "gpu"
    if platform not in PLATFORMS:
        raise ValueError(f"platform must be one of {PLATFORMS} or None; got {platform!r}")
    return platform


# TPU interpret mode simulates what a TPU would do (DMAs, semaphores, SMEM; out-of-bounds reads raise,
# uninitialised memory reads NaN) through a host callback per operation. Plain interpret mode evaluates the
# kernel as one XLA program: the same values, ~1000x faster (the sparse MLA forward + backward at S = 64, H = 4:
# 0.016 s against 17.8 s per call, 2026-12-04). "0" here selects the plain mode: for tests of the whole model,
# whose kernels the kernel tests check in TPU interpret mode.
TPU_INTERPRET_CHECKS = "PALLAS_TPU_INTERPRET_CHECKS"


def tpu_interpret(interpret: bool):
    """pallas_call's `interpret` for the Mosaic kernels: TPU interpret mode on CPU, or the plain interpret mode
    where the environment sets PALLAS_TPU_INTERPRET_CHECKS=0 (or JAX has no TPU interpret mode)."""
    if not interpret:
        return False
    params = getattr(pltpu, "InterpretParams", None)
    return params() if params is not None and os.environ.get(TPU_INTERPRET_CHECKS, "1") != "0" else True


def next_power_of_two(n: int, minimum: int = 1) -> int:
    return max(minimum, 1 << max(0, int(n) - 1).bit_length())


def round_up(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple


def pad_axis(x: jax.Array, axis: int, size: int, value=0) -> jax.Array:
    """Pads `axis` of `x` at the end up to `size` with `value` (no copy when already that size)."""
    extra = size - x.shape[axis]
    if extra == 0:
        return x
    widths = [(0, 0)] * x.ndim
    widths[axis] = (0, extra)
    return jnp.pad(x, widths, constant_values=value)


def triton_params(*, num_warps: int, num_stages: int):
    """Always the Triton backend for GPU lowering: newer JAX defaults pallas_call to Mosaic GPU there.

    Interpret mode ignores these, and a CPU process exporting for CUDA lowers exactly as a GPU one would.
    """
    return plgpu.CompilerParams(num_warps=num_warps, num_stages=num_stages)


def gather_rows(ref, idx: jax.Array, valid: jax.Array, columns: slice | None = None) -> jax.Array:
    """rows[n] = ref[idx[n], columns] for valid slots, zeros elsewhere; ref is 2-D [T, width], columns a
    static slice (default: all).

    A masked pointer gather: lowers to one vectorised load per row block on Triton and to a plain
    gather in interpret mode. Invalid slots read row 0 under a false mask, so no address leaves ref.
    """
    start, stop, _ = (columns or slice(None)).indices(ref.shape[-1])
    shape = (idx.shape[0], stop - start)
    rows = jnp.broadcast_to(jnp.where(valid, idx, 0)[:, None], shape)
    cols = start + lax.broadcasted_iota(jnp.int32, shape, 1)
    mask = jnp.broadcast_to(valid[:, None], shape)
    return plgpu.load(ref.at[rows, cols], mask=mask, other=0)


def atomic_add_rows(ref, rows: jax.Array, values: jax.Array, columns: slice) -> None:
    """ref[rows[n], columns] += values[n] for every n, atomically (other programs add to the same rows); ref is
    2-D [T', width], rows int [block] inside it, values [block, columns' width], columns a static slice.

    Unmasked (interpret mode has no masked atomics): a caller sends rows it must not add to a spare row instead.
    Interpret mode applies a block's adds as one gather-add-set, so rows repeated within one call keep only one
    add there: only the spare row may repeat."""
    start, stop, _ = columns.indices(ref.shape[-1])
    shape = (rows.shape[0], stop - start)
    plgpu.atomic_add(ref, (jnp.broadcast_to(rows[:, None], shape), start + lax.broadcasted_iota(jnp.int32, shape, 1)),
                     values)


def dot_nt(a: jax.Array, b: jax.Array, precision=None) -> jax.Array:
    """a [M, K] x b [N, K] -> [M, N] in fp32."""
    return lax.dot_general(a, b, (((1,), (1,)), ((), ())), precision=precision,
                           preferred_element_type=jnp.float32)


def dot_tn(a: jax.Array, b: jax.Array, precision=None) -> jax.Array:
    """a [K, M] x b [K, N] -> [M, N] in fp32."""
    return lax.dot_general(a, b, (((0,), (0,)), ((), ())), precision=precision,
                           preferred_element_type=jnp.float32)


def dot_nn(a: jax.Array, b: jax.Array, precision=None) -> jax.Array:
    """a [M, K] x b [K, N] -> [M, N] in fp32."""
    return lax.dot_general(a, b, (((1,), (0,)), ((), ())), precision=precision,
                           preferred_element_type=jnp.float32)


def check_rank(name: str, x, rank: int, layout: str) -> None:
    if getattr(x, "ndim", None) != rank:
        shape = getattr(x, "shape", type(x).__name__)
        raise ValueError(f"{name} must have rank {rank} ({layout}); got shape {shape}")


def check_equal(what: str, got, expected, hint: str) -> None:
    if got != expected:
        raise ValueError(f"{what} is {got}, but must be {expected} ({hint})")


def check_int_dtype(name: str, x) -> None:
    if not jnp.issubdtype(x.dtype, jnp.integer):
        raise ValueError(f"{name} must be an integer array; got dtype {x.dtype}")


def check_float_dtype(name: str, x) -> None:
    if not jnp.issubdtype(x.dtype, jnp.floating):
        raise ValueError(f"{name} must be a floating-point array; got dtype {x.dtype}")


def check_block(name: str, value: int) -> None:
    """Block sizes are powers of two >= 16: Triton needs power-of-two tiles and 16-wide dots."""
    if not isinstance(value, int) or value < MIN_BLOCK or value & (value - 1):
        raise ValueError(f"{name} must be a power of two >= {MIN_BLOCK}; got {value!r}")


def check_positive_int(name: str, value) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ValueError(f"{name} must be a positive int; got {value!r}")


def check_scale(scale) -> None:
    if not isinstance(scale, (int, float)) or isinstance(scale, bool) or not scale > 0:
        raise ValueError(f"scale must be a positive Python float; got {scale!r}")


def check_q_offset(q_offset) -> None:
    """q_offset: a Python int >= 0 or an integer scalar array (e.g. a traced decode position)."""
    if isinstance(q_offset, bool):
        raise ValueError(f"q_offset must be an int >= 0; got {q_offset!r}")
    if isinstance(q_offset, int):
        if q_offset < 0:
            raise ValueError(f"q_offset must be >= 0; got {q_offset}")
        return
    if getattr(q_offset, "shape", None) != () or not jnp.issubdtype(q_offset.dtype, jnp.integer):
        raise ValueError(f"q_offset must be an int or an integer scalar array; got {q_offset!r}")


def check_segments(q_segment_ids, k_segment_ids, batch: int, q_len: int, k_len: int) -> None:
    if (q_segment_ids is None) != (k_segment_ids is None):
        raise ValueError("q_segment_ids and k_segment_ids must be given together or both be None; "
                         f"got q_segment_ids={'None' if q_segment_ids is None else 'array'}, "
                         f"k_segment_ids={'None' if k_segment_ids is None else 'array'}")
    if q_segment_ids is None:
        return
    check_int_dtype("q_segment_ids", q_segment_ids)
    check_int_dtype("k_segment_ids", k_segment_ids)
    check_equal("q_segment_ids.shape", tuple(q_segment_ids.shape), (batch, q_len), "[B, S]")
    check_equal("k_segment_ids.shape", tuple(k_segment_ids.shape), (batch, k_len), "[B, T]")


def static_q_offset(q_offset, cost_q_offset: int | None = None) -> int | None:
    """q_offset as a Python int for the declared cost; when it is an array (traced), `cost_q_offset` (the offset
    the caller's cost stands for, e.g. the mean of a chip's two chunks in the balanced order) or None (every
    key tile counted)."""
    if isinstance(q_offset, int):
        return q_offset
    check_cost_offset(cost_q_offset)
    return cost_q_offset


def check_cost_offset(cost_q_offset) -> None:
    """cost_q_offset (the static query position a kernel's declared cost assumes): None or a Python int >= 0."""
    if cost_q_offset is not None and (not isinstance(cost_q_offset, int) or isinstance(cost_q_offset, bool)
                                      or cost_q_offset < 0):
        raise ValueError(f"cost_q_offset must be None or a non-negative int; got {cost_q_offset!r}")


def positions_and_segments(q_offset, q_segment_ids, k_segment_ids, batch: int, q_len: int, k_len: int):
    """Query positions [S] and segment ids [B, S], [B, T] (all zeros when not given), int32."""
    q_pos = jnp.asarray(q_offset, jnp.int32) + jnp.arange(q_len, dtype=jnp.int32)
    if q_segment_ids is None:
        return q_pos, jnp.zeros((batch, q_len), jnp.int32), jnp.zeros((batch, k_len), jnp.int32)
    return q_pos, q_segment_ids.astype(jnp.int32), k_segment_ids.astype(jnp.int32)


def key_valid(q_pos, q_seg, k_pos, k_seg, k_len: int):
    """Key t is visible to query s iff t <= pos(s), t < T and both carry the same segment id."""
    return (k_pos <= q_pos) & (k_pos < k_len) & (k_seg == q_seg)
