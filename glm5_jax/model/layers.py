"""Basic layers: norms, rotary embeddings, SwiGLU, embedding and projections (array functions, and the NNX
modules that apply them to their own weights).

Dimension letters are fixed in `glm5_jax.model.__init__`.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.ad_checkpoint import checkpoint_name

from glm5_jax.distributed.logical_axes import constrain
from glm5_jax.model.variables import normal, param


def rms_norm(x: jax.Array, scale: jax.Array, eps: float) -> jax.Array:
    """x * rsqrt(mean(x^2) + eps) computed in fp32, cast back to x's dtype, then times scale."""
    x32 = x.astype(jnp.float32)
    normed = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + eps)
    return normed.astype(x.dtype) * scale.astype(x.dtype)


def layer_norm(x: jax.Array, scale: jax.Array, bias: jax.Array, eps: float) -> jax.Array:
    """Standard LayerNorm (mean and variance over the last axis) in fp32, cast back to x's dtype."""
    x32 = x.astype(jnp.float32)
    mean = jnp.mean(x32, axis=-1, keepdims=True)
    var = jnp.mean(jnp.square(x32 - mean), axis=-1, keepdims=True)
    normed = (x32 - mean) * jax.lax.rsqrt(var + eps)
    return (normed * scale.astype(jnp.float32) + bias.astype(jnp.float32)).astype(x.dtype)


def rope_angles(positions: jax.Array, rotary_dim: int, theta: float) -> tuple[jax.Array, jax.Array]:
    """cos/sin of shape [..., rotary_dim // 2]; pair i turns at inv_freq_i = theta^(-2i/rotary_dim)."""
    inv_freq = 1.0 / (theta ** (jnp.arange(0, rotary_dim, 2, dtype=jnp.float32) / rotary_dim))
    angles = positions.astype(jnp.float32)[..., None] * inv_freq
    return jnp.cos(angles), jnp.sin(angles)


def apply_rope_interleaved(x: jax.Array, cos: jax.Array, sin: jax.Array) -> jax.Array:
    """Rotate interleaved pairs (x0,x1),(x2,x3),...; the result is laid out de-interleaved (rotated evens,
    then rotated odds), exactly as Hugging Face returns it. Only dot products between rotated queries and
    keys are ever used, so the layout is free as long as queries and keys share it.

    x: [B, S, ..., R]; cos/sin: [B, S, R/2] (broadcast over the middle axes).
    """
    extra = x.ndim - cos.ndim
    cos = cos.reshape(cos.shape[:2] + (1,) * extra + cos.shape[2:])
    sin = sin.reshape(sin.shape[:2] + (1,) * extra + sin.shape[2:])
    half = x.shape[-1] // 2
    evens_odds = _deinterleave(x).astype(jnp.float32)
    even, odd = evens_odds[..., :half], evens_odds[..., half:]
    rotated = jnp.concatenate([even * cos - odd * sin, odd * cos + even * sin], axis=-1)
    return rotated.astype(x.dtype)


def _deinterleave(x: jax.Array) -> jax.Array:
    """[x[..., 0::2], x[..., 1::2]] as one [R, R] permutation matmul in x's dtype, exact (each output is one input
    times 1). XLA:TPU writes lane-strided slices out in fp32, and their gradients' pads; the matmul's output feeds the
    rotation's fusion instead (a [2048, 64, 64] rotation and its gradient compiled for v6e: 159 -> 59 MB of HBM
    traffic; GLM-5's q and k rotations on v6e-256, benchmarks/BENCHMARKS.md)."""
    r = x.shape[-1]
    source = np.concatenate([np.arange(0, r, 2), np.arange(1, r, 2)])
    permutation = np.zeros((r, r), np.float32)
    permutation[source, np.arange(r)] = 1.0
    return jnp.einsum("...R,RQ->...Q", x, jnp.asarray(permutation, x.dtype), precision=jax.lax.Precision.HIGHEST)


def deinterleave_tail(kernel: jax.Array, rope_dim: int) -> jax.Array:
    """`kernel` with the last `rope_dim` entries of its output axis de-interleaved (`_deinterleave`): a matmul by
    it writes its rope dims already in `apply_rope_interleaved`'s output layout, for `apply_rope_to_tail`."""
    return jnp.concatenate([kernel[..., :-rope_dim], _deinterleave(kernel[..., -rope_dim:])], axis=-1)


def apply_rope_to_tail(x: jax.Array, cos: jax.Array, sin: jax.Array, rope_dim: int) -> jax.Array:
    """x [B, S, ..., K] with its last `rope_dim` entries rotated as `apply_rope_interleaved` rotates them, where
    they are already de-interleaved (`deinterleave_tail` on the weight that made x).

    Written over the whole of K, x * c + swapped(x) * s with c = [1.. ; cos ; cos] and s = [0.. ; -sin ; sin]
    (the same products as the rotation): XLA:TPU computes it in the one fusion that writes x's consumer, where a
    concatenation of [nope ; rotated rope] wrote the rotated halves out on their own, each padded to a 128-lane
    tile, and their gradients in fp32."""
    nope, half = x.shape[-1] - rope_dim, rope_dim // 2
    extra = x.ndim - cos.ndim
    expand = lambda a: a.reshape(a.shape[:2] + (1,) * extra + a.shape[2:])  # noqa: E731  (over the middle axes)
    ones = jnp.ones(cos.shape[:-1] + (nope,), jnp.float32)
    c = expand(jnp.concatenate([ones, cos, cos], axis=-1))
    s = expand(jnp.concatenate([ones * 0, -sin, sin], axis=-1))
    swapped = jnp.concatenate([x[..., :nope], x[..., nope + half:], x[..., nope:nope + half]], axis=-1)
    return (x.astype(jnp.float32) * c + swapped.astype(jnp.float32) * s).astype(x.dtype)


def apply_rope_half_split(x: jax.Array, cos: jax.Array, sin: jax.Array) -> jax.Array:
    """Rotate pairs (x_i, x_{i+R/2}) (the DeepSeek-V3.2 indexer layout)."""
    extra = x.ndim - cos.ndim
    cos = cos.reshape(cos.shape[:2] + (1,) * extra + cos.shape[2:])
    sin = sin.reshape(sin.shape[:2] + (1,) * extra + sin.shape[2:])
    x32 = x.astype(jnp.float32)
    half = x.shape[-1] // 2
    first, second = x32[..., :half], x32[..., half:]
    rotated = jnp.concatenate([first * cos - second * sin, second * cos + first * sin], axis=-1)
    return rotated.astype(x.dtype)


def swiglu(x: jax.Array, gate: jax.Array, up: jax.Array, down: jax.Array) -> jax.Array:
    """down(silu(x @ gate) * (x @ up)) for x [..., D], gate/up [D, F], down [F, D]."""
    dtype = x.dtype
    # Named for remat "full_keep_projections" (2F values per token spare 4 D F FLOPs of recompute).
    gated, linear = (checkpoint_name(x @ w.astype(dtype), "ffn_gate_up") for w in (gate, up))
    hidden = jax.nn.silu(gated) * linear
    return hidden @ down.astype(dtype)


class Scale(nnx.Module):
    """The weight of RMSNorm ("scale"); with `bias=True` also LayerNorm's bias (the indexer's key norm)."""

    def __init__(self, dim: int, dtype, *, bias: bool = False):
        self.scale = param(jnp.ones((dim,), dtype), ("norm",))
        if bias:
            self.bias = param(jnp.zeros((dim,), dtype), ("norm",))

    def rms_norm(self, x: jax.Array, eps: float) -> jax.Array:
        return rms_norm(x, self.scale[...], eps)

    def layer_norm(self, x: jax.Array, eps: float) -> jax.Array:
        return layer_norm(x, self.scale[...], self.bias[...], eps)


class Linear(nnx.Module):
    """A projection "kernel" of any shape; its first dim is the input (the einsum that reads it names the rest),
    except in MLA's o_proj [D, H, P] (`glm5_jax.train.optim` knows it).
    Called, a [D_in, D_out] kernel projects x [..., D_in] in x's dtype."""

    def __init__(self, shape: tuple[int, ...], axes: tuple[str, ...], rngs: nnx.Rngs, std: float, dtype):
        self.kernel = param(normal(rngs, shape, std, dtype), axes)

    def weight(self, dtype) -> jax.Array:
        return self.kernel[...].astype(dtype)

    def __call__(self, x: jax.Array) -> jax.Array:
        return x @ self.weight(x.dtype)


class Embed(nnx.Module):
    def __init__(self, vocab: int, dim: int, rngs: nnx.Rngs, std: float, dtype):
        self.embedding = param(normal(rngs, (vocab, dim), std, dtype), ("vocab", "embed"))

    def __call__(self, tokens: jax.Array, dtype, mesh=None) -> jax.Array:
        """The rows of `tokens` [B, S] as [B, S, D] activations (split over the batch axes and `context`)."""
        x = self.embedding[...][tokens].astype(dtype)
        # The table is FSDP-sharded on D, so its rows come out split on D. When that split spans two mesh axes
        # (`expert` and `context`), GSPMD cannot move it onto B and S in one step and replicates the whole
        # activation instead: move it to B first, then to S.
        return constrain(constrain(x, ("batch", None, "embed"), mesh), ("batch", "seq", "embed"), mesh)


class SwiGLU(nnx.Module):
    """The dense MLP and the shared expert: down(silu(x @ gate) * (x @ up))."""

    def __init__(self, dim: int, hidden: int, rngs: nnx.Rngs, std: float, dtype):
        self.gate_proj = Linear((dim, hidden), ("embed", "mlp"), rngs, std, dtype)
        self.up_proj = Linear((dim, hidden), ("embed", "mlp"), rngs, std, dtype)
        self.down_proj = Linear((hidden, dim), ("mlp", "embed"), rngs, std, dtype)

    def __call__(self, x: jax.Array) -> jax.Array:
        return swiglu(x, self.gate_proj.kernel[...], self.up_proj.kernel[...], self.down_proj.kernel[...])
